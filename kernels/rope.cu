// NeoX (rotate-half) RoPE in place on bf16 heads (nosa-model.md §1), from
// precomputed f32 tables cos/sin [table_rows, D/2] indexed by each row's position:
//   (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), x1 = x[:D/2], x2 = x[D/2:].
// Row i's heads start at x + i*row_stride + col_off, `n_heads` heads of head_dim each
// (for a fused [q | k | v] row, q and k heads are contiguous: one launch does both).
// Grid: (n_rows, n_heads); any block size. A position outside the table writes NaN.

extern "C" __global__ void rope_neox(bf16_t* __restrict__ x, int row_stride, int col_off, int head_dim,
                                     const int* __restrict__ pos, const float* __restrict__ cos_t,
                                     const float* __restrict__ sin_t, int table_rows) {
    const int row = blockIdx.x, head = blockIdx.y;
    const int half = head_dim >> 1;
    bf16_t* v = x + (u64)row * row_stride + col_off + (u64)head * head_dim;
    const int p = pos[row];
    if (p < 0 || p >= table_rows) {
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) v[i] = BF16_NAN;
        return;
    }
    const float* c = cos_t + (u64)p * half;
    const float* s = sin_t + (u64)p * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float a = bf2f(v[i]), b = bf2f(v[i + half]);
        v[i] = f2bf(a * c[i] - b * s[i]);
        v[i + half] = f2bf(b * c[i] + a * s[i]);
    }
}

// Split-K combine of decode attention partials (see attention.cuh): for each
// (b, g) row r of B*H, merges its nsplit partials in split order:
//   M = max_s m_s, L = sum_s l_s e^(m_s - M), out[r, d] = bf16(sum_s o_s[d] e^(m_s - M) / L)
// (0 when L = 0, e.g. an empty sequence). out row r sits at out + (r/H)*out_stride + (r%H)*D.
// Grid: B*H blocks; any block size.

extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        bf16_t* __restrict__ out, int out_stride, int H, int D, int nsplit) {
    const int r = blockIdx.x;
    const float* ml = part_ml + (u64)r * nsplit * 2;
    float M = -INFINITY;
    for (int s = 0; s < nsplit; ++s) M = fmaxf(M, ml[2 * s]);
    float L = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
        const float m = ml[2 * s];
        if (m != -INFINITY) L += ml[2 * s + 1] * expf(m - M);
    }
    bf16_t* o = out + (u64)(r / H) * out_stride + (u64)(r % H) * D;
    const float* po = part_o + (u64)r * nsplit * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < nsplit; ++s) {
            const float m = ml[2 * s];
            if (m != -INFINITY) a += po[(u64)s * D + d] * expf(m - M);
        }
        o[d] = f2bf(L > 0.0f ? a / L : 0.0f);
    }
}

// Finishes the fused QKV GEMM output of n query rows and appends the new tokens to the KV
// cache (nosa-model.md §1 RoPE, §3 state):
//   - q heads (columns [0, H*D)) and k heads ([H*D, (H+hkv)*D)) are rotated in place
//     with NeoX RoPE at position pos[r] (f32 math, rounded to bf16, as rope.cu);
//   - the rotated k heads and the v heads ([(H+hkv)*D, (H+2*hkv)*D)) are written to the
//     cache of row r: K/V bf16 [cap, hkv, D] at kptr[r] / vptr[r], token slot pos[r]
//     (pos[r] % ring when ring > 0: the tail ring of an offloaded layer, kv/mod.rs);
//   - with an eviction head (A non-null), the block of v head h also computes the eviction
//     score c[pos[r], h] = A[h] * softplus(z), z = sum_j delta[h, j] * v[j] + eb[h] over the
//     row's whole v (j in [0, hkv*D): every KV head's values, bf16 as the GEMM (+ v bias)
//     left them, widened to f32), all in f32 (nosa-model.md §3; softplus linear above 20):
//     one warp's dot product (lane-strided partial sums in ascending j, then a shuffle
//     tree). delta: f32 [hkv, hkv*D]; eb: f32 [hkv] or null; A: f32 [hkv]. c is written
//     as f32 to the c cache [cap, hkv] at cptr[r], row pos[r] (not the ring slot; skipped
//     when cptr or cptr[r] is null).
// Guard: a row whose position lies outside the RoPE table (pos[r] < 0 or >= table_rows) is
// skipped (nothing rotated, appended or scored) and reported to the device error record err
// (nullable; common.cuh): DEVERR_ROPE_POSITION, row r, `layer`, value pos[r], limit table_rows.
// The host guarantees 0 <= pos[r] < the row's cache capacity (ring slot < ring).
// Grid: (n, ceil((H + 2*hkv) / blockDim.y)); block (blockDim.x, blockDim.y): head j =
// blockIdx.y * blockDim.y + threadIdx.y (a row of blockDim.x threads, a multiple of 32, per
// head; several heads a block, so a prefill chunk is not tens of thousands of tiny blocks).

extern "C" __global__ void qkv_rope_append(bf16_t* __restrict__ qkv, int row_stride, int H, int hkv, int D,
                                           const int* __restrict__ pos, const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, int table_rows,
                                           const u64* __restrict__ kptr, const u64* __restrict__ vptr,
                                           const u64* __restrict__ cptr, const float* __restrict__ A,
                                           const float* __restrict__ delta, const float* __restrict__ eb,
                                           int ring, int* __restrict__ err, int layer) {
    pdl_wait();
    pdl_trigger();
    const int r = blockIdx.x, j = blockIdx.y * blockDim.y + threadIdx.y;
    if (j >= H + 2 * hkv) return;  // whole rows of threads: whole warps
    const int half = D >> 1;
    bf16_t* x = qkv + (u64)r * row_stride;
    const int p = pos[r];
    if (p < 0 || p >= table_rows) {
        if (j == 0 && threadIdx.x == 0) raise_device_error(err, DEVERR_ROPE_POSITION, r, layer, -1, p, table_rows);
        return;
    }
    const u64 kv_row = ring > 0 ? (u64)(p % ring) : (u64)p;
    if (j < H + hkv) {
        bf16_t* v = x + (u64)j * D;
        const float* c = cos_t + (u64)p * half;
        const float* s = sin_t + (u64)p * half;
        bf16_t* K = nullptr;
        if (j >= H) K = (bf16_t*)kptr[r] + (kv_row * hkv + (j - H)) * D;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const float a = bf2f(v[i]), b = bf2f(v[i + half]);
            const bf16_t lo = f2bf(a * c[i] - b * s[i]);
            const bf16_t hi = f2bf(b * c[i] + a * s[i]);
            v[i] = lo;
            v[i + half] = hi;
            if (K != nullptr) {
                K[i] = lo;
                K[i + half] = hi;
            }
        }
    } else {
        const int h = j - H - hkv;
        // The row's v: all hkv heads, read only (this kernel writes q and k heads alone).
        const bf16_t* vrow = x + (u64)(H + hkv) * D;
        const bf16_t* src = vrow + (u64)h * D;
        bf16_t* V = (bf16_t*)vptr[r] + (kv_row * hkv + h) * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) V[i] = src[i];
        // Warp 0 of the head's row whole (blockDim.x a multiple of 32: lanes are threadIdx.x & 31);
        // cptr[r] is the same for every lane.
        if (A != nullptr && cptr != nullptr && threadIdx.x < 32 && cptr[r] != 0ull) {
            const int kvd = hkv * D;
            const float c = eviction_c(delta + (u64)h * kvd, vrow, kvd, eb != nullptr ? eb[h] : 0.0f, A[h]);
            if (threadIdx.x == 0) ((float*)cptr[r])[(u64)p * hkv + h] = c;
        }
    }
}

// Incremental compressed keys and pooled eviction scores (nosa-model.md §3).
//
// Window i of a sequence covers tokens [stride*i, stride*i + ksize) and exists
// once the sequence holds T >= stride*i + ksize tokens, so Mc(T) = (T-ksize)/stride + 1
// windows for T >= ksize, else 0 (common.cuh sel_windows). For each window the kernel writes
//   Kc[i, h, :] = inv * sum over the window's tokens t (ascending) of K[t, h, :]   (f32)
//   p[i, h]     = inv * sum over the window's tokens t (ascending) of c[t, h]      (f32)
// with inv = 1/ksize passed from the host: the same additions in the same order
// as the CPU reference (LayerKv::compress), so the result is bitwise equal for
// the same bf16 K and f32 c.
//
// Per sequence b (pointer tables, one entry per sequence):
//   kptr[b]  -> bf16 K  [>= T, hkv, D] (post-RoPE key cache; with ring > 0 a tail ring
//               holding token t at row t % ring, which must still hold the window's tokens)
//   cptr[b]  -> f32  c  [>= T, hkv]    (eviction scores); cptr or pptr null: p is not written
//   kcptr[b] -> f32  Kc [cap, hkv, D]
//   pptr[b]  -> f32  p  [cap, hkv]
//   lens[b]  =  T, the tokens stored after the append.
// Windows computed: those completed by the last n_new tokens, i.e. i in
// [Mc(max(T - n_new, 0)), Mc(T)); n_new >= T rebuilds every window (prefill).
// Grid: (x, B); block x handles windows Mc(T - n_new) + x, + gridDim.x, ... (grid-stride),
// its threads stride over the hkv*D elements of a window row.

extern "C" __global__ void compress_windows(const u64* __restrict__ kptr, const u64* __restrict__ cptr,
                                            const u64* __restrict__ kcptr, const u64* __restrict__ pptr,
                                            const int* __restrict__ lens, int n_new, int hkv, int D, int stride,
                                            int ksize, float inv, int ring) {
    const int b = blockIdx.y;
    const int T = lens[b];
    const int T0 = T > n_new ? T - n_new : 0;
    const int w_lo = sel_windows(T0, stride, ksize);
    const int w_hi = sel_windows(T, stride, ksize);
    const int kvd = hkv * D;
    const bf16_t* K = (const bf16_t*)kptr[b];
    float* Kc = (float*)kcptr[b];
    const float* C = (cptr != nullptr && pptr != nullptr) ? (const float*)cptr[b] : nullptr;
    float* P = (cptr != nullptr && pptr != nullptr) ? (float*)pptr[b] : nullptr;
    for (int w = w_lo + (int)blockIdx.x; w < w_hi; w += gridDim.x) {
        const u64 t0 = (u64)w * stride;
        for (int e = threadIdx.x; e < kvd; e += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < ksize; ++j) {
                const u64 t = t0 + j;
                acc += bf2f(K[(ring > 0 ? t % (u64)ring : t) * kvd + e]);
            }
            Kc[(u64)w * kvd + e] = acc * inv;
        }
        if (C != nullptr) {
            for (int e = threadIdx.x; e < hkv; e += blockDim.x) {
                float acc = 0.0f;
                for (int j = 0; j < ksize; ++j) acc += C[(t0 + j) * hkv + e];
                P[(u64)w * hkv + e] = acc * inv;
            }
        }
    }
}

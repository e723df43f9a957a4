// SparDA forecast window scores (nosa-model.md §4 "Forecast mode"):
//   s[(r*hkv + h)*w_stride + i] = f_h . Kc[i, h]   for i < Mc(win_lens[r])
// a plain dot product (no scale, no softmax, no head sum), f32 accumulation.
// f: bf16, row r's forecast at f + r*f_stride, KV head h at h*D (post-RoPE);
// Kc: f32 [>= Mc, hkv, D] at kcptr[r] (the scored layer's compressed keys);
// Mc(T) = (T - ksize)/stride + 1 for T >= ksize, else 0. Entries i >= Mc are not written.
// Grid (x, hkv, rows), FC_THREADS threads: one warp per window, grid-stride over windows;
// lanes stride over D in pairs (D even, at most 256).

#define FC_THREADS 256

extern "C" __global__ void forecast_scores(const bf16_t* __restrict__ f, int f_stride, const u64* __restrict__ kcptr,
                                           const int* __restrict__ win_lens, float* __restrict__ s, int w_stride,
                                           int hkv, int D, int stride, int ksize) {
    const int h = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = FC_THREADS / 32;
    const int T = win_lens[r];
    const int mc = T >= ksize ? (T - ksize) / stride + 1 : 0;
    const bf16_t* fr = f + (u64)r * f_stride + (u64)h * D;
    float fv[8];
    int nfv = 0;
    for (int d = lane * 2; d < D && nfv < 8; d += 64) {
        fv[nfv++] = bf2f(fr[d]);
        fv[nfv++] = bf2f(fr[d + 1]);
    }
    const float* Kc = (const float*)kcptr[r];
    float* out = s + ((u64)r * hkv + h) * w_stride;
    for (int w = blockIdx.x * nw + warp; w < mc; w += gridDim.x * nw) {
        const float* kw = Kc + ((u64)w * hkv + h) * D;
        float acc = 0.0f;
        int k = 0;
        for (int d = lane * 2; d < D && k < 8; d += 64) {
            const float2 kv = *(const float2*)(kw + d);
            acc += fv[k++] * kv.x;
            acc += fv[k++] * kv.y;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) out[w] = acc;
    }
}

// Test aid: spins one thread for `ns` nanoseconds of %globaltimer (injects a delay on a
// stream, e.g. the copy stream in the prefetch stress check). Grid (1), any block.
extern "C" __global__ void spin_wait(u64 ns) {
    if (threadIdx.x != 0) return;
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// NOSA eviction score (nosa-model.md §3): c[i, h] = A[h] * softplus(delta[h, :] . v[i, :] + b[h]),
// softplus(x) = log(1 + e^x), linear above x = 20; f32 out [n, hkv].
// v: bf16 rows of kvdim = Hkv*D values at stride ld_v; delta: f32 [hkv, kvdim] (the checkpoint's
// values, as kv_append.cu's qkv_rope_append reads them);
// bias (nullable) and A: f32 [hkv]. One warp per (row, head); blockDim.x a multiple of 32.

extern "C" __global__ void eviction_score(const bf16_t* __restrict__ v, int ld_v, const float* __restrict__ delta,
                                          const float* __restrict__ bias, const float* __restrict__ A,
                                          float* __restrict__ c, int n, int hkv, int kvdim) {
    const int wid = (int)((blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (wid >= n * hkv) return;
    const int row = wid / hkv, h = wid % hkv;
    const float ch = eviction_c(delta + (u64)h * kvdim, v + (u64)row * ld_v, kvdim,
                                bias != nullptr ? bias[h] : 0.0f, A[h]);
    if (lane == 0) c[(u64)row * hkv + h] = ch;
}

// Dense decode attention, no bias (nosa-model.md §5 "Dense"): one query token per
// sequence, attending to all of its tokens 0 .. len-1 (the current one included).
// q: bf16, sequence b's head g at q + b*q_stride + g*D. K/V of sequence b: bf16
// [len_b, hkv, D] at kptr[b] / vptr[b]. Query head g reads KV head g / (H/hkv).
// Grid: (nsplit, H, B), block 32*ATT_WARPS threads; split s covers tokens
// [s*chunk, min((s+1)*chunk, len)). Partials go to slot (b*H + g)*nsplit + s.

extern "C" __global__ void attn_dense_partial(const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr,
                                              const u64* __restrict__ vptr, const int* __restrict__ lens,
                                              float* __restrict__ part_o, float* __restrict__ part_ml, int H, int hkv,
                                              int D, int chunk, int nsplit, float scale) {
    const int s = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = g / (H / hkv);
    const int len = lens[b];
    const int t0 = s * chunk;
    const int t1 = min(t0 + chunk, len);
    const bf16_t* K = (const bf16_t*)kptr[b];
    const bf16_t* V = (const bf16_t*)vptr[b];
    float qv[ATT_MAXE], acc[ATT_MAXE];
    att_load_q(q + (u64)b * q_stride + (u64)g * D, D, lane, qv);
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = t0 + warp; j < t1; j += ATT_WARPS) {
        const u64 off = ((u64)j * hkv + h) * D;
        att_token(qv, K + off, V + off, 0.0f, scale, D, lane, m, l, acc);
    }
    att_write_partial(m, l, acc, D, ((u64)b * H + g) * nsplit + s, part_o, part_ml);
}

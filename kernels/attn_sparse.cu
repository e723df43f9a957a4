// Sparse block attention decode with additive bias (nosa-model.md §5): one query
// token per sequence (position t = len-1), attending to the tokens j <= t of the
// selected blocks of its KV head, in the order the list gives (ascending block
// ids), with logit q.k*scale + c[j, h] (the bias added to the *scaled* logit).
// sel: i32 [B, hkv, s_max] block ids, nsel: i32 [B, hkv] valid entries; block m
// covers tokens [m*block_size, (m+1)*block_size) clipped to len (causal at the
// current token). cptr[b] (or a null cptr / null entry: no bias) points to f32
// c [len_b, hkv]. Other layouts as attn_dense.cu. Negative ids are skipped.
// Grid: (nsplit, H, B); split s covers list entries [s*bps, (s+1)*bps).

extern "C" __global__ void attn_sparse_partial(const bf16_t* __restrict__ q, int q_stride,
                                               const u64* __restrict__ kptr, const u64* __restrict__ vptr,
                                               const u64* __restrict__ cptr, const int* __restrict__ lens,
                                               const int* __restrict__ sel, const int* __restrict__ nsel, int s_max,
                                               int block_size, int bps, float* __restrict__ part_o,
                                               float* __restrict__ part_ml, int H, int hkv, int D, int nsplit,
                                               float scale) {
    const int s = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = g / (H / hkv);
    const int len = lens[b];
    const int nb = min(nsel[b * hkv + h], s_max);
    const int i0 = s * bps;
    const int i1 = min(i0 + bps, nb);
    const int ntok = i1 > i0 ? (i1 - i0) * block_size : 0;
    const int* list = sel + ((u64)b * hkv + h) * s_max;
    const bf16_t* K = (const bf16_t*)kptr[b];
    const bf16_t* V = (const bf16_t*)vptr[b];
    const float* C = cptr != nullptr ? (const float*)cptr[b] : nullptr;
    float qv[ATT_MAXE], acc[ATT_MAXE];
    att_load_q(q + (u64)b * q_stride + (u64)g * D, D, lane, qv);
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int i = warp; i < ntok; i += ATT_WARPS) {
        const int blk = list[i0 + i / block_size];
        if (blk < 0) continue;
        const long long j = (long long)blk * block_size + i % block_size;
        if (j >= len) continue;
        const u64 off = ((u64)j * hkv + h) * D;
        const float bias = C != nullptr ? C[(u64)j * hkv + h] : 0.0f;
        att_token(qv, K + off, V + off, bias, scale, D, lane, m, l, acc);
    }
    att_write_partial(m, l, acc, D, ((u64)b * H + g) * nsplit + s, part_o, part_ml);
}

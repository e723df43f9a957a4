// Embedding gather (nosa-model.md §1 scale_emb): out[i, :] = bf16(table[ids[i], :] * scale).
// Grid: one block per row; any block size (multiple of 32).
// An id outside [0, vocab) writes NaN (callers validate ids on the host first).

extern "C" __global__ void embed_gather(const bf16_t* __restrict__ table, const u32* __restrict__ ids,
                                        bf16_t* __restrict__ out, int n, int d, int vocab, float scale) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const u32 id = ids[row];
    bf16_t* o = out + (u64)row * d;
    if (id >= (u32)vocab) {
        for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = BF16_NAN;
        return;
    }
    const bf16_t* src = table + (u64)id * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = f2bf(bf2f(src[j]) * scale);
}

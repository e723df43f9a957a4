// Dense rows inside a sparse decode call (nosa-model.md §1 dense_len: a sequence
// shorter than dense_len attends densely, with no bias, while others of the batch
// are sparse): for every row r with dense[r] != 0, each KV head's block list becomes
// every existing block 0 .. q (q = (lens[r]-1) / block_size), padded with -1, and
// nsel = q + 1. Rows with dense[r] == 0 are left as the selection kernel wrote them.
// sel: i32 [n, hkv, s_max] (s_max >= q + 1 for dense rows; the host sizes it);
// nsel: i32 [n, hkv]. Grid: (n, hkv); any block size.

extern "C" __global__ void sel_fill_dense(int* __restrict__ sel, int* __restrict__ nsel,
                                          const int* __restrict__ dense, const int* __restrict__ lens, int hkv,
                                          int s_max, int block_size) {
    const int r = blockIdx.x, h = blockIdx.y;
    if (dense[r] == 0) return;
    const int T = lens[r];
    const int nb = T > 0 ? (T - 1) / block_size + 1 : 0;
    int* out = sel + ((u64)r * hkv + h) * s_max;
    for (int i = threadIdx.x; i < s_max; i += blockDim.x) out[i] = i < nb ? i : -1;
    if (threadIdx.x == 0) nsel[(u64)r * hkv + h] = min(nb, s_max);
}

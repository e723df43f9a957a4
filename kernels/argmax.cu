// Greedy sampling on the GPU: out[r] = the index of the largest value of row r of
// the f32 logits x [n, V] (ties to the lower index; NaN never wins; a row of only
// NaN gives 0), matching sample.rs `argmax` on finite rows.
// Grid: n blocks; blockDim.x a multiple of 32, at most 1024 (both kernels).

__device__ __forceinline__ void am_better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The argmax of row r of x (ties to the lower index, NaN never wins), in thread 0 of the block.
__device__ __forceinline__ u32 argmax_row(const float* __restrict__ row, int V) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = row[j];
        if (v == v) am_better(bv, bi, v, j);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        am_better(bv, bi, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            am_better(bv, bi, ov, oi);
        }
    }
    return bi == 0x7fffffff ? 0u : (u32)bi;
}

extern "C" __global__ void argmax_rows(const float* __restrict__ x, int n, int V, u32* __restrict__ out) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const u32 id = argmax_row(x + (u64)r * V, V);
    if (threadIdx.x == 0) out[r] = id;
}

// Greedy decode on the device: as argmax_rows, then advances the decode step inputs of
// row r for the next step: io = u32 [ids n | pos n | lens n | seq_lens n] (one sequence
// per row): ids[r] = the argmax, pos[r] += 1, lens[r] += 1, seq_lens[r] += 1.
extern "C" __global__ void argmax_advance(const float* __restrict__ x, int n, int V, u32* __restrict__ out,
                                          u32* __restrict__ io) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const u32 id = argmax_row(x + (u64)r * V, V);
    if (threadIdx.x == 0) {
        out[r] = id;
        io[r] = id;
        io[n + r] += 1u;
        io[2 * n + r] += 1u;
        io[3 * n + r] += 1u;
    }
}

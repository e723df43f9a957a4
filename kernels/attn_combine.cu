// Split-K combine of decode attention partials (kernels/attn_decode.cu): for each (row, head)
// pair r of rows*H, merges its nsplit partials:
//   M = max_s m_s, w_s = e^(m_s - M) (0 for an empty split, m_s = -inf), L = sum_s l_s w_s,
//   out[r, d] = bf16(sum_s o_s[d] w_s / L)   (0 when L = 0, e.g. an empty sequence).
// out row r sits at out + (r/H)*out_stride + (r%H)*D. Empty splits form a suffix (splits
// past the row's length or list), and every split before the last non-empty one has its o
// written (zeros when all its tokens were skipped), so only splits s < nvalid (one past the
// last non-empty split) are read, without branches, four loads in flight per thread.
// The splits are spread over the block: threads stride over them for M, L and nvalid (block
// reductions); the weights go to shared memory in chunks of COMB_CHUNK splits; thread t sums
// the splits s = t/D, t/D + groups, ... of dimension t % D (groups = blockDim.x / D); the
// groups' sums are then added in group order. The order is fixed by nsplit and the block size
// (deterministic).
// Register path (nsplit <= COMB_REGS * groups, nsplit <= blockDim.x, nsplit <= COMB_CHUNK: batch
// 1, where the few blocks are bound by latency): every load a thread needs (split t's max and sum,
// its splits' maxima and values) is issued at once, one round trip to memory instead of three,
// and the same sums are then formed in the same order from registers (the same result, bit for
// bit, as the chunked path).
// Grid: rows*H blocks; blockDim.x a multiple of 32, at least D, at most 1024.

#define COMB_CHUNK 256
#define COMB_REGS 16

__device__ __forceinline__ float comb_block_max(float v, float* shm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    const float t = lane < nw ? shm[lane] : -INFINITY;
    return warp_max(t);
}

extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        bf16_t* __restrict__ out, int out_stride, int H, int D, int nsplit) {
    __shared__ float red[32];
    __shared__ float wsh[COMB_CHUNK];
    __shared__ float acc_sh[1024];
    pdl_wait();
    pdl_trigger();
    const int r = blockIdx.x;
    const float* ml = part_ml + (u64)r * nsplit * 2;
    if (nsplit <= COMB_REGS * (int)(blockDim.x / D) && nsplit <= (int)blockDim.x && nsplit <= COMB_CHUNK) {
        const int t = threadIdx.x, groups = blockDim.x / D;
        const int d = t % D, g = t / D;
        const bool active = g < groups;
        const float* po = part_o + (u64)r * nsplit * D + d;
        // split t's (max, sum) for M, nvalid and L; splits g + k*groups' maxima and values
        const float m_t = t < nsplit ? ml[2 * t] : -INFINITY;
        const float l_t = t < nsplit ? ml[2 * t + 1] : 0.0f;
        float ms[COMB_REGS], v[COMB_REGS];
#pragma unroll
        for (int k = 0; k < COMB_REGS; ++k) {
            const int s = g + k * groups;
            const bool in = active && s < nsplit;
            ms[k] = in ? ml[2 * s] : -INFINITY;
            v[k] = in ? po[(u64)s * D] : 0.0f;
        }
        const float M = comb_block_max(m_t, red);
        const int nvalid = (int)comb_block_max(m_t != -INFINITY ? (float)t : -1.0f, red) + 1;
        float l = 0.0f;
        if (t < nvalid && m_t != -INFINITY) l += l_t * expf(m_t - M);
        const float L = block_sum(l, red);
        // The chunked path's order: four accumulators over i = g, g + groups, ... while
        // i + 3*groups < nvalid, then the rest into the first.
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < COMB_REGS; ++k) {
            const float wk = ms[k] != -INFINITY ? expf(ms[k] - M) : 0.0f;
            const bool in_main = g + ((k & ~3) + 3) * groups < nvalid;
            if (in_main) {
                a[k & 3] += v[k] * wk;
            } else if (g + k * groups < nvalid) {
                a[0] += v[k] * wk;
            }
        }
        if (active) acc_sh[t] = (a[0] + a[1]) + (a[2] + a[3]);
        __syncthreads();
        bf16_t* o = out + (u64)(r / H) * out_stride + (u64)(r % H) * D;
        for (int dd = t; dd < D; dd += blockDim.x) {
            float sum = 0.0f;
            for (int gg = 0; gg < groups; ++gg) sum += acc_sh[gg * D + dd];
            o[dd] = f2bf(L > 0.0f ? sum / L : 0.0f);
        }
        return;
    }
    float m = -INFINITY, last = -1.0f;
    for (int s = threadIdx.x; s < nsplit; s += blockDim.x) {
        const float ms = ml[2 * s];
        m = fmaxf(m, ms);
        if (ms != -INFINITY) last = (float)s;
    }
    const float M = comb_block_max(m, red);
    const int nvalid = (int)comb_block_max(last, red) + 1;
    float l = 0.0f;
    for (int s = threadIdx.x; s < nvalid; s += blockDim.x) {
        const float ms = ml[2 * s];
        if (ms != -INFINITY) l += ml[2 * s + 1] * expf(ms - M);
    }
    const float L = block_sum(l, red);
    const int groups = blockDim.x / D;
    const int d = threadIdx.x % D, g = threadIdx.x / D;
    const bool active = g < groups;
    const float* po = part_o + (u64)r * nsplit * D + d;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int base = 0; base < nvalid; base += COMB_CHUNK) {
        const int cnt = min(COMB_CHUNK, nvalid - base);
        __syncthreads();  // the previous chunk's weights are consumed
        for (int i = threadIdx.x; i < cnt; i += blockDim.x) {
            const float ms = ml[2 * (base + i)];
            wsh[i] = ms != -INFINITY ? expf(ms - M) : 0.0f;
        }
        __syncthreads();
        if (active) {
            int i = g;
            for (; i + 3 * groups < cnt; i += 4 * groups) {
                const float v0 = po[(u64)(base + i) * D];
                const float v1 = po[(u64)(base + i + groups) * D];
                const float v2 = po[(u64)(base + i + 2 * groups) * D];
                const float v3 = po[(u64)(base + i + 3 * groups) * D];
                a0 += v0 * wsh[i];
                a1 += v1 * wsh[i + groups];
                a2 += v2 * wsh[i + 2 * groups];
                a3 += v3 * wsh[i + 3 * groups];
            }
            for (; i < cnt; i += groups) a0 += po[(u64)(base + i) * D] * wsh[i];
        }
    }
    if (active) acc_sh[threadIdx.x] = (a0 + a1) + (a2 + a3);  // = acc_sh[g*D + d]
    __syncthreads();
    bf16_t* o = out + (u64)(r / H) * out_stride + (u64)(r % H) * D;
    for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
        float t = 0.0f;
        for (int gg = 0; gg < groups; ++gg) t += acc_sh[gg * D + dd];
        o[dd] = f2bf(L > 0.0f ? t / L : 0.0f);
    }
}

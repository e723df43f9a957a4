// Split-K combine of decode attention partials (kernels/attn_decode.cu): for each (row, head)
// pair r of rows*H, merges its nsplit partials:
//   M = max_s m_s, w_s = e^(m_s - M) (0 for an empty split, m_s = -inf), L = sum_s l_s w_s,
//   out[r, d] = bf16(sum_s o_s[d] w_s / L)   (0 when L = 0, e.g. an empty sequence).
// out row r sits at out + (r/H)*out_stride + (r%H)*D. An empty split's o is never used (it
// may be unwritten): its weight is 0 and its values are not added.
// Method: thread t takes dimension d = t % D of the splits g, g + groups, g + 2*groups, ...
// (g = t / D, groups = blockDim.x / D), COMB_BATCH of them per pass with every load of a pass
// (max, sum, value) issued before any is used, so a pass costs one round trip to memory. The
// thread keeps an online-softmax state (its running max, its weighted sum of values and of
// sums relative to that max); the groups' states are then merged in group order through
// shared memory. The order is fixed by nsplit and the block size (deterministic).
// Grid: rows*H blocks; blockDim.x a multiple of 32, at least D, at most 1024.

#define COMB_BATCH 8

extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        bf16_t* __restrict__ out, int out_stride, int H, int D, int nsplit) {
    __shared__ float gm[64];        // per group (at most 1024 / 16): its running max
    __shared__ float gl[64];        // per group: its sum of l_s e^(m_s - max)
    __shared__ float acc_sh[1024];  // [groups][D]: the groups' weighted sums
    pdl_wait();
    pdl_trigger();
    const int r = blockIdx.x;
    const int groups = blockDim.x / D;
    const int d = threadIdx.x % D, g = threadIdx.x / D;
    const bool active = g < groups;
    const float* ml = part_ml + (u64)r * nsplit * 2;
    const float* po = part_o + (u64)r * nsplit * D + d;
    float mt = -INFINITY, at = 0.0f, lt = 0.0f;
    if (active) {
        for (int base = g; base < nsplit; base += COMB_BATCH * groups) {
            float ms[COMB_BATCH], ls[COMB_BATCH], os[COMB_BATCH];
#pragma unroll
            for (int k = 0; k < COMB_BATCH; ++k) {
                const int s = base + k * groups;
                const bool in = s < nsplit;
                ms[k] = in ? ml[2 * s] : -INFINITY;
                ls[k] = in ? ml[2 * s + 1] : 0.0f;
                os[k] = in ? po[(u64)s * D] : 0.0f;
            }
            float mn = mt;
#pragma unroll
            for (int k = 0; k < COMB_BATCH; ++k) mn = fmaxf(mn, ms[k]);
            if (mn != -INFINITY) {
                const float c = mt == -INFINITY ? 0.0f : expf(mt - mn);
                at *= c;
                lt *= c;
#pragma unroll
                for (int k = 0; k < COMB_BATCH; ++k) {
                    if (ms[k] != -INFINITY) {
                        const float e = expf(ms[k] - mn);
                        at += os[k] * e;
                        lt += ls[k] * e;
                    }
                }
                mt = mn;
            }
        }
        acc_sh[threadIdx.x] = at;  // = acc_sh[g*D + d]
        if (d == 0) {
            gm[g] = mt;
            gl[g] = lt;
        }
    }
    __syncthreads();
    bf16_t* o = out + (u64)(r / H) * out_stride + (u64)(r % H) * D;
    for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
        float M = -INFINITY;
        for (int gg = 0; gg < groups; ++gg) M = fmaxf(M, gm[gg]);
        float t = 0.0f, L = 0.0f;
        if (M != -INFINITY) {
            for (int gg = 0; gg < groups; ++gg) {
                const float mg = gm[gg];
                if (mg != -INFINITY) {
                    const float e = expf(mg - M);
                    t += acc_sh[gg * D + dd] * e;
                    L += gl[gg] * e;
                }
            }
        }
        o[dd] = f2bf(L > 0.0f ? t / L : 0.0f);
    }
}

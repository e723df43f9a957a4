// Shared decode-attention pieces (prepended after common.cuh to attn_dense.cu
// and attn_sparse.cu; not a compilation unit of its own).
//
// One thread block computes one split of one (sequence b, query head) pair:
// ATT_WARPS warps walk the split's tokens (warp w takes every ATT_WARPS-th one,
// in ascending order), each keeping an online softmax (max m, sum l, f32
// accumulator with head dim spread over the lanes: element d lives in lane
// d % 32, slot d / 32, so D <= 32*ATT_MAXE = 128). The warps are then merged
// in warp order and the split's partial (m, l, unnormalised acc[D]) is written
// to the workspace; attn_combine.cu merges the splits in split order.

#define ATT_WARPS 4
#define ATT_MAXE 4

// Processes one key/value token for one query: s = q.k * scale + bias, online-softmax update.
__device__ __forceinline__ void att_token(const float (&qv)[ATT_MAXE], const bf16_t* __restrict__ k,
                                          const bf16_t* __restrict__ v, float bias, float scale, int D,
                                          int lane, float& m, float& l, float (&acc)[ATT_MAXE]) {
    float part = 0.0f;
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) {
        const int d = lane + 32 * e;
        if (d < D) part += qv[e] * bf2f(k[d]);
    }
    const float s = warp_sum(part) * scale + bias;
    const float m_new = fmaxf(m, s);
    const float corr = (m == -INFINITY) ? 0.0f : expf(m - m_new);
    const float p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) {
        const int d = lane + 32 * e;
        acc[e] = acc[e] * corr + (d < D ? p * bf2f(v[d]) : 0.0f);
    }
    m = m_new;
}

// Loads one query head (bf16, D values) into lane-distributed f32 registers.
__device__ __forceinline__ void att_load_q(const bf16_t* __restrict__ q, int D, int lane, float (&qv)[ATT_MAXE]) {
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < D ? bf2f(q[d]) : 0.0f;
    }
}

// Merges the ATT_WARPS warp states of this block (in warp order) and writes the split's partial:
// part_o[slot*D + d] = sum_w acc_w[d] * exp(m_w - M), part_ml[2*slot] = M, part_ml[2*slot+1] = L.
// An empty split writes M = -inf, L = 0, acc = 0.
__device__ __forceinline__ void att_write_partial(float m, float l, const float (&acc)[ATT_MAXE], int D,
                                                  u64 slot, float* __restrict__ part_o,
                                                  float* __restrict__ part_ml) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][32 * ATT_MAXE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < ATT_MAXE; ++e) sm_acc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, sm_m[w]);
    float wgt[ATT_WARPS];
    float L = 0.0f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
        wgt[w] = (sm_m[w] == -INFINITY) ? 0.0f : expf(sm_m[w] - M);
        L += sm_l[w] * wgt[w];
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) a += sm_acc[w][d] * wgt[w];
        part_o[slot * D + d] = a;
    }
    if (threadIdx.x == 0) {
        part_ml[2 * slot] = M;
        part_ml[2 * slot + 1] = L;
    }
}

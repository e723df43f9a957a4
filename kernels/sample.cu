// Temperature / top-k / top-p sampling on the GPU, one block per row, the same
// rule as sample.rs `sample_with_u` given the same uniform draw u in [0, 1):
//   1. the finite logits, ordered by (logit descending, index ascending);
//   2. top_k > 0 keeps the first top_k of that order;
//   3. p_i = exp(f64((l_i - max) / T)), normalised by their sum;
//   4. top_p < 1 keeps the shortest prefix whose cumulative mass reaches top_p;
//   5. the token where the cumulative mass of the kept prefix first exceeds
//      u · (its total).
// No sort: each cut is found by a radix descent over a 64-bit key that encodes
// the order (the logit's order-preserving bits, then the complement of the
// index), 8 bits a pass, with a 256-bin histogram of counts (step 2) or of
// masses (steps 4, 5) in shared memory. Sums are in f64; their order differs
// from the CPU's, so a draw within ~1e-15 of a cumulative boundary may land on
// the neighbouring token.
// Greedy (T == 0 or top_k == 1): the argmax (ties to the lower index), as sample.rs does.
// A row no token can be chosen from (sample.rs `check_logits`: a NaN, a +inf, or no finite
// logit) goes through argmax_row too, which reports it to the device error record `rec`
// (null: not reported) with the row, the lowest offending id, V and the count.
// Grid: rows blocks of SAMPLE_THREADS threads; logits f32 [rows, ld] (V used),
// u f64 [rows], out u32 [rows].

#define SAMPLE_THREADS 1024

__device__ __forceinline__ u64 sample_key(float x, int i) {
    const u32 b = __float_as_uint(x);
    const u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - (u32)i);
}

__device__ __forceinline__ int sample_key_index(u64 k) { return (int)(0xFFFFFFFFu - (u32)(k & 0xFFFFFFFFull)); }

// Block-wide sum of a double (all threads get it).
__device__ double sample_block_sum(double v, double* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < nw; ++w) t += scratch[w];
    __syncthreads();
    return t;
}

// Mass of element i in a descent: 1 (count) or its normalised probability.
struct SampleMass {
    const float* row;
    float mx, temp;
    double total;  // 0: count mode
    __device__ double of(float l) const {
        if (total == 0.0) return 1.0;
        return exp((double)((l - mx) / temp)) / total;
    }
};

// Radix descent over the keys of the finite elements with key >= lo: returns the key
// K of the element where the cumulative mass, in descending key order, first
// reaches (ge) or exceeds (!ge) target. When rounding leaves no such element, the
// smallest eligible key (the last of the order).
__device__ u64 sample_descend(const float* row, int V, u64 lo, SampleMass m, double target, bool ge,
                              double* bins, double* scratch) {
    __shared__ u64 s_prefix;
    __shared__ double s_target;
    __shared__ int s_last;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_target = target;
        s_last = 0;
    }
    __syncthreads();
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) bins[b] = 0.0;
        __syncthreads();
        const u64 prefix = s_prefix;
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            const float l = row[j];
            if (!isfinite(l)) continue;
            const u64 k = sample_key(l, j);
            if (k < lo) continue;
            if (shift < 56 && ((k ^ prefix) >> (shift + 8)) != 0) continue;
            atomicAdd(&bins[(k >> shift) & 255], m.of(l));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double cum = 0.0;
            int pick = -1, lowest = -1;
            for (int b = 255; b >= 0; --b) {
                const double c = bins[b];
                if (c <= 0.0) continue;
                lowest = b;
                if (!s_last && pick < 0 && (ge ? cum + c >= s_target : cum + c > s_target)) {
                    pick = b;
                    break;
                }
                cum += c;
            }
            if (pick < 0) {  // rounding: take the last element of the order
                pick = lowest < 0 ? 0 : lowest;
                s_last = 1;
            } else {
                s_target -= cum;
            }
            s_prefix = prefix | ((u64)pick << shift);
        }
        __syncthreads();
    }
    const u64 k = s_prefix;
    __syncthreads();
    return k;
}

extern "C" __global__ void sample_rows(const float* __restrict__ logits, long long ld, int rows, int V,
                                       float temperature, int top_k, float top_p, const double* __restrict__ u01,
                                       u32* __restrict__ out, int* rec) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + (u64)r * (u64)ld;
    __shared__ double bins[256];
    __shared__ double scratch[32];
    __shared__ float smax[32];
    // the largest finite logit and the number of finite ones
    float mx = -INFINITY;
    double nfin = 0.0;
    bool bad = false;  // a NaN or a +inf (check_logits)
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float l = row[j];
        if (isfinite(l)) {
            mx = fmaxf(mx, l);
            nfin += 1.0;
        } else if (!(l < 0.0f)) {
            bad = true;
        }
    }
    bad = __syncthreads_or(bad);
    mx = warp_max(mx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) smax[warp] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, smax[w]);
    nfin = sample_block_sum(nfin, scratch);
    if (temperature == 0.0f || top_k == 1 || nfin == 0.0 || bad) {
        const RowPick p = argmax_row(row, V);
        report_row_pick(rec, p, r, V);
        if (threadIdx.x == 0) out[r] = p.id;
        return;
    }
    SampleMass m{row, mx, temperature, 0.0};
    // 2. top-k: the key of the top_k-th element of the order
    u64 lo = 0;
    if (top_k > 0 && (double)top_k < nfin) lo = sample_descend(row, V, 0, m, (double)top_k, true, bins, scratch);
    // 3. the normaliser over the kept set
    double total = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float l = row[j];
        if (isfinite(l) && sample_key(l, j) >= lo) total += exp((double)((l - mx) / temperature));
    }
    total = sample_block_sum(total, scratch);
    m.total = total;
    // 4. top-p: the key where the cumulative mass reaches top_p
    if (top_p < 1.0f) lo = sample_descend(row, V, lo, m, (double)top_p, true, bins, scratch);
    // 5. the draw over the kept prefix
    double kept = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float l = row[j];
        if (isfinite(l) && sample_key(l, j) >= lo) kept += m.of(l);
    }
    kept = sample_block_sum(kept, scratch);
    const u64 k = sample_descend(row, V, lo, m, u01[r] * kept, false, bins, scratch);
    if (threadIdx.x == 0) out[r] = (u32)sample_key_index(k);
}

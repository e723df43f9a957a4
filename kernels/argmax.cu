// Greedy sampling on the GPU: out[r] = the index of the largest value of row r of
// the f32 logits x [n, V] (ties to the lower index; NaN never wins; a row of only
// NaN gives 0), matching sample.rs `argmax` on finite rows.
// A row no token can be chosen from (sample.rs `check_logits`: a NaN, a +inf, or no
// finite entry) is reported to the device error record `rec` (null: not reported) with
// the row, the lowest offending id, V and the count; its id is still written.
// A row at a 16-byte aligned address is read in 16-byte loads, four in flight per thread.
// Grid: n blocks; blockDim.x a multiple of 32, at most 1024 (both kernels).

__device__ __forceinline__ void am_better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The argmax of one row and what check_logits says about it, valid in thread 0.
struct RowPick {
    u32 id;     // the argmax (ties to the lower index, NaN never wins; 0 without a non-NaN entry)
    int fault;  // 0, DEVERR_LOGITS_NAN, DEVERR_LOGITS_POSINF or DEVERR_LOGITS_NO_FINITE
    int at;     // the lowest offending id (-1 for NO_FINITE)
    int count;  // offending entries (NaN or +inf; V for NO_FINITE)
};

// The argmax of row `row` (V values) and its fault, in thread 0 of the block. Every
// thread of the block must call it (it synchronises).
__device__ __forceinline__ RowPick argmax_row(const float* __restrict__ row, int V) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int s_nan_at, s_nan_n, s_inf_n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    int nan_at = 0x7fffffff, nan_n = 0, inf_n = 0;
    auto visit = [&](float v, int j) {
        if (v == v) {
            am_better(bv, bi, v, j);
            inf_n += (v == INFINITY);
        } else {
            nan_at = min(nan_at, j);
            ++nan_n;
        }
    };
    const int bd = blockDim.x;
    if ((reinterpret_cast<u64>(row) & 15) == 0) {
        // 16-byte loads, four in flight per thread, then the scalar tail past V/4*4
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int V4 = V >> 2;
        int j = threadIdx.x;
        for (; j + 3 * bd < V4; j += 4 * bd) {
            float4 a[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) a[k] = r4[j + k * bd];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int i = 4 * (j + k * bd);
                visit(a[k].x, i);
                visit(a[k].y, i + 1);
                visit(a[k].z, i + 2);
                visit(a[k].w, i + 3);
            }
        }
        for (; j < V4; j += bd) {
            const float4 a = r4[j];
            visit(a.x, 4 * j);
            visit(a.y, 4 * j + 1);
            visit(a.z, 4 * j + 2);
            visit(a.w, 4 * j + 3);
        }
        for (int i = 4 * V4 + threadIdx.x; i < V; i += bd) visit(row[i], i);
    } else {
        for (int j = threadIdx.x; j < V; j += bd) visit(row[j], j);
    }
    // NaN and +inf are rare: count them only when some thread saw one.
    const bool odd = __syncthreads_or(nan_n > 0 || inf_n > 0);
    if (odd) {
        if (threadIdx.x == 0) {
            s_nan_at = 0x7fffffff;
            s_nan_n = 0;
            s_inf_n = 0;
        }
        __syncthreads();
        if (nan_n > 0) {
            atomicMin(&s_nan_at, nan_at);
            atomicAdd(&s_nan_n, nan_n);
        }
        if (inf_n > 0) atomicAdd(&s_inf_n, inf_n);
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
    RowPick p;
    p.id = bi == 0x7fffffff ? 0u : (u32)bi;
    p.fault = 0;
    p.at = -1;
    p.count = 0;
    if (odd && s_nan_n > 0) {
        p.fault = DEVERR_LOGITS_NAN;
        p.at = s_nan_at;
        p.count = s_nan_n;
    } else if (odd && s_inf_n > 0) {
        // the lowest +inf id is the argmax (ties to the lower index)
        p.fault = DEVERR_LOGITS_POSINF;
        p.at = (int)p.id;
        p.count = s_inf_n;
    } else if (!(bv > -INFINITY)) {
        p.fault = DEVERR_LOGITS_NO_FINITE;
        p.count = V;
    }
    // the shared counters are read above before any caller reuses them
    __syncthreads();
    return p;
}

// Reports row r's fault (thread 0, after argmax_row) to the record, layer -1 (after the
// last layer), head -1.
__device__ __forceinline__ void report_row_pick(int* rec, const RowPick& p, int r, int V) {
    if (threadIdx.x == 0 && p.fault != 0) raise_device_error_n(rec, p.fault, r, -1, -1, p.at, V, p.count);
}

extern "C" __global__ void argmax_rows(const float* __restrict__ x, int n, int V, u32* __restrict__ out,
                                       int* rec) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const RowPick p = argmax_row(x + (u64)r * V, V);
    report_row_pick(rec, p, r, V);
    if (threadIdx.x == 0) out[r] = p.id;
}

// Greedy decode on the device: as argmax_rows, then advances the decode step inputs of
// row r for the next step: io = u32 [ids n | pos n | lens n | seq_lens n] (one sequence
// per row): ids[r] = the argmax, pos[r] += 1, lens[r] += 1, seq_lens[r] += 1.
extern "C" __global__ void argmax_advance(const float* __restrict__ x, int n, int V, u32* __restrict__ out,
                                          u32* __restrict__ io, int* rec) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const RowPick p = argmax_row(x + (u64)r * V, V);
    report_row_pick(rec, p, r, V);
    if (threadIdx.x == 0) {
        out[r] = p.id;
        io[r] = p.id;
        io[n + r] += 1u;
        io[2 * n + r] += 1u;
        io[3 * n + r] += 1u;
    }
}

// Decode attention partials on the tensor cores (nosa-model.md §5), dense or sparse,
// split-K over tokens; attn_combine.cu merges the splits.
//
// One thread block (ATT_WARPS warps) computes, for one query row r (a decode sequence,
// or one prompt token of a prefill chunk), one KV head h and a group of up to 16 of its
// G = H/hkv query heads (heads g0 .. g0+15, g0 = 16*(blockIdx.y % ngroups)), one split s
// of the row's tokens:
//   dense  (sel == null): tokens [s*span, min((s+1)*span, len));
//   sparse (sel != null): the blocks listed in entries [s*span, (s+1)*span) of the row's
//          list sel[(r*hkv + h)*s_max ...] (ascending block ids; -1 entries skipped;
//          nsel[r*hkv + h] valid entries); block m covers tokens
//          [m*block_size, (m+1)*block_size) clipped to len (causal at the current token).
// len = lens[r]: the row attends to tokens 0 .. len-1 (its own token, at len-1, included).
// The K and V heads of each query head are read once per block for all of the group's
// query heads.
//
// Logit of token j for query head g: (q_g . k_j) * scale + c[j, h], the bias c read from
// f32 c [cap, hkv] at cptr[r] when cptr and cptr[r] are non-null (NOSA), else 0.
//
// Layouts: q bf16, row r's H*D query values at r*q_stride (q_stride even), head g at g*D;
// K/V of row r: bf16 [cap, hkv, D] at kptr[r] / vptr[r] (16-byte aligned); with ring > 0
// the cache is a tail ring: token j at row j % ring.
// Offloaded rows (slot_list != null, sparse only; kv/mod.rs): list entry i of
// (r, h) has slot slot_list[(r*hkv + h)*s_max + i]; slot >= 0 reads the block from the slot
// pool bf16 [hkv][pool_slots][2][block_size][D] at pool_ptr[r] (K tile, then V tile);
// slot -1 reads it from the tail ring. The bias c is always indexed by the token id j.
// D a multiple of 16, at most 128.
//
// Method: the block walks its tokens in tiles of ATT_TILE = 64 (token order, list order
// for sparse), double-buffered in shared memory with cp.async (rows of invalid tokens
// zero-filled). Warp w takes tokens 16w .. 16w+15 of each tile: S = Q.K^T (16 query-head
// rows x 16 tokens, mma.sync m16n8k16 bf16 -> f32), online softmax in f32 per warp,
// P rounded to bf16, O += P.V (mma, f32 accumulators). The 4 warp states are merged in
// warp order (four output elements per thread and pass) and the split's partial is written
// (16-byte stores: part_o 16-byte aligned):
//   part_o[slot*D + d] = unnormalised sum_j p_j v_j[d] (relative to M),
//   part_ml[2*slot] = M (max logit, -inf when the split is empty), part_ml[2*slot+1] = L,
// slot = (r*H + g)*nsplit + s. An empty split writes only (M, L) = (-inf, 0).
// Grid: (nsplit, hkv*ngroups, rows), ngroups = ceil(G/16); block ATT_THREADS threads;
// dynamic shared memory attn_smem_bytes(D) = 4*64*(D+8)*2 + 2*64*8 bytes.
//
// cta_log: null, or u64 [gridDim.z][gridDim.y][gridDim.x][3] per-CTA timeline (common.cuh
// cta_log_start), for the timing study of bench --cta-timeline; it changes no result.
// The tensor-core helpers (cp.async, ldmatrix, mma.sync) come from mma.cuh, a prelude.

#define ATT_TILE 64
#define ATT_WARPS 4
#define ATT_THREADS (32 * ATT_WARPS)
#define ATT_PAD 8

extern "C" __global__ __launch_bounds__(ATT_THREADS, 3) void attn_partial(const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr,
                 const u64* __restrict__ vptr, const u64* __restrict__ cptr, const int* __restrict__ lens,
                 const int* __restrict__ sel, const int* __restrict__ nsel, int s_max, int block_size, int span,
                 float* __restrict__ part_o, float* __restrict__ part_ml, int H, int hkv, int D, int nsplit,
                 float scale, const int* __restrict__ slot_list, const u64* __restrict__ pool_ptr, int pool_slots, int ring,
                 u64* __restrict__ cta_log) {
    extern __shared__ __align__(16) unsigned char att_sh[];
    pdl_wait();
    pdl_trigger();
    cta_log_start(cta_log);
    const int s = blockIdx.x, r = blockIdx.z;
    const int G = H / hkv, ngroups = (G + 15) / 16;
    const int h = blockIdx.y / ngroups, g0 = (blockIdx.y % ngroups) * 16;
    const int gc = min(16, G - g0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int RS = D + ATT_PAD;  // shared row stride, bf16 elements
    // Independent global reads first (one round trip for all of them): length, list count,
    // cache pointers, the query fragments.
    const int len = lens[r];
    const int nsel_r = sel != nullptr ? nsel[(u64)r * hkv + h] : 0;
    const bf16_t* K = (const bf16_t*)kptr[r];
    const bf16_t* V = (const bf16_t*)vptr[r];
    const float* C = (cptr != nullptr) ? (const float*)cptr[r] : nullptr;
    // Q fragments (A operand): rows = query heads g0 .. g0+15 (zero past gc), cols = dims.
    u32 qa[8][4];
    {
        const bf16_t* qb = q + (u64)r * q_stride + ((u64)h * G + g0) * D;
        const int qr = lane >> 2, qc = (lane & 3) * 2;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            if (kk * 16 < D) {
                const int c0 = kk * 16 + qc;
                qa[kk][0] = qr < gc ? *(const u32*)(qb + (u64)qr * D + c0) : 0u;
                qa[kk][1] = qr + 8 < gc ? *(const u32*)(qb + (u64)(qr + 8) * D + c0) : 0u;
                qa[kk][2] = qr < gc ? *(const u32*)(qb + (u64)qr * D + c0 + 8) : 0u;
                qa[kk][3] = qr + 8 < gc ? *(const u32*)(qb + (u64)(qr + 8) * D + c0 + 8) : 0u;
            } else {
                qa[kk][0] = qa[kk][1] = qa[kk][2] = qa[kk][3] = 0u;
            }
        }
    }
    int ntok = 0, t0 = 0, i0 = 0;
    const int* list = nullptr;
    if (sel == nullptr) {
        t0 = s * span;
        ntok = max(0, min(t0 + span, len) - t0);
    } else {
        list = sel + ((u64)r * hkv + h) * s_max;
        const int nb = min(nsel_r, s_max);
        i0 = s * span;
        const int i1 = min(i0 + span, nb);
        ntok = i1 > i0 ? (i1 - i0) * block_size : 0;
    }
    const u64 slot0 = ((u64)r * H + (u64)h * G + g0) * nsplit + s;  // head g0+i: slot0 + i*nsplit
    if (ntok == 0) {
        for (int i = threadIdx.x; i < gc; i += blockDim.x) {
            const u64 slot = slot0 + (u64)i * nsplit;
            part_ml[2 * slot] = -INFINITY;
            part_ml[2 * slot + 1] = 0.0f;
        }
        cta_log_end(cta_log);
        return;
    }
    bf16_t* Ks = (bf16_t*)att_sh;                 // [2][ATT_TILE][RS]
    bf16_t* Vs = Ks + 2 * ATT_TILE * RS;           // [2][ATT_TILE][RS]
    float* Bs = (float*)(Vs + 2 * ATT_TILE * RS);  // [2][ATT_TILE] bias
    int* Ok = (int*)(Bs + 2 * ATT_TILE);           // [2][ATT_TILE] token valid
    // Loader layout: thread t copies 16-byte chunk t % cpr of rows t / cpr, + rows_per_pass, ...
    // of each tile (threads past rows_per_pass * cpr only compute).
    const int cpr = D >> 3;                       // 16-byte chunks per row
    const int rows_per_pass = ATT_THREADS / cpr;  // rows one pass of the block covers
    const int my_row = threadIdx.x / cpr;
    const int my_part = threadIdx.x - my_row * cpr;
    const bool loader = my_row < rows_per_pass;
    const u64 tok_stride = (u64)hkv * D;  // elements from one token's row to the next
    const bf16_t* Kh = K + (u64)h * D + my_part * 8;
    const bf16_t* Vh = V + (u64)h * D + my_part * 8;
    const float* Ch = C != nullptr ? C + h : nullptr;
    // Offloaded rows: list entry i's block sits in pool slot slist[i] (>= 0) or, for -1,
    // in the tail ring (token-major K/V at kptr/vptr, token t at row t % ring).
    const int* slist = (slot_list != nullptr && list != nullptr) ? slot_list + ((u64)r * hkv + h) * s_max : nullptr;
    const bf16_t* Ph = slist != nullptr
                           ? (const bf16_t*)pool_ptr[r] + (u64)h * pool_slots * 2 * block_size * D + my_part * 8
                           : nullptr;

    // Issues the copies of tile t into stage st.
    auto load_tile = [&](int t, int st) {
        if (!loader) return;
        for (int row = my_row; row < ATT_TILE; row += rows_per_pass) {
            const int e = t * ATT_TILE + row;
            long long j = -1;
            int slot = -1;
            if (e < ntok) {
                if (list == nullptr) {
                    j = t0 + e;
                } else {
                    const int blk = list[i0 + e / block_size];
                    if (blk >= 0) j = (long long)blk * block_size + e % block_size;
                    if (slist != nullptr) slot = slist[i0 + e / block_size];
                }
                if (j >= len) j = -1;
            }
            const bool ok = j >= 0;
            const bf16_t* ksrc = Kh;
            const bf16_t* vsrc = Vh;
            if (ok) {
                if (slot >= 0) {
                    const u64 o = ((u64)slot * 2 * block_size + (u64)(e % block_size)) * D;
                    ksrc = Ph + o;
                    vsrc = Ph + o + (u64)block_size * D;
                } else {
                    const u64 o = (u64)(ring > 0 ? j % ring : j) * tok_stride;
                    ksrc = Kh + o;
                    vsrc = Vh + o;
                }
            }
            const int srow = st * ATT_TILE + row;
            cp_async16(Ks + srow * RS + my_part * 8, ksrc, ok);
            cp_async16(Vs + srow * RS + my_part * 8, vsrc, ok);
            if (my_part == 0) {
                Ok[srow] = ok ? 1 : 0;
                const bool cb = ok && Ch != nullptr;
                cp_async4(Bs + srow, cb ? (const void*)(Ch + (u64)j * hkv) : (const void*)K, cb);
            }
        }
    };

    // ldmatrix row addresses of this lane in stage 0, in the warp's 16 tokens (mma.cuh
    // ldsm_k_lane / ldsm_v_lane)
    const u32 ks_lane = smem_addr(Ks + warp * 16 * RS + ldsm_k_lane(lane, RS));
    const u32 vs_lane = smem_addr(Vs + warp * 16 * RS + ldsm_v_lane(lane, RS));

    float o[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Rows lane/4 (m0, l0) and lane/4 + 8 (m1, l1); l is this lane's share until the end.
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int ntiles = (ntok + ATT_TILE - 1) / ATT_TILE;
    const int nk = D >> 4, nd = D >> 3;

    load_tile(0, 0);
    cp_async_commit();
    for (int t = 0; t < ntiles; ++t) {
        const int st = t & 1;
        if (t + 1 < ntiles) {
            load_tile(t + 1, st ^ 1);
            cp_async_commit();
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();
        // This lane's ldmatrix row addresses in stage st (shared window, bytes).
        const u32 ks = ks_lane + st * (ATT_TILE * RS * 2);
        const u32 vs = vs_lane + st * (ATT_TILE * RS * 2);
        // S = Q.K^T: sa = tokens 0..7 of the warp's 16, sb = tokens 8..15.
        float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            if (kk < nk) {
                u32 b[4];
                ldsm_x4_at(b, ks + kk * 32);
                mma_bf16(sa, qa[kk], b[0], b[1]);
                mma_bf16(sb, qa[kk], b[2], b[3]);
            }
        }
        // Scaled logits plus bias; invalid tokens -inf. sv[0..3]: row lane/4, sv[4..7]: row lane/4+8;
        // columns (tokens) tb, tb+1, tb+8, tb+9.
        const int tb = st * ATT_TILE + warp * 16 + (lane & 3) * 2;
        float bias[4];
        {
            const int ti[4] = {tb, tb + 1, tb + 8, tb + 9};
#pragma unroll
            for (int e = 0; e < 4; ++e) bias[e] = Ok[ti[e]] ? Bs[ti[e]] : -INFINITY;
        }
        float sv[8] = {sa[0] * scale + bias[0], sa[1] * scale + bias[1], sb[0] * scale + bias[2],
                       sb[1] * scale + bias[3], sa[2] * scale + bias[0], sa[3] * scale + bias[1],
                       sb[2] * scale + bias[2], sb[3] * scale + bias[3]};
        float mx0 = fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3]));
        float mx1 = fmaxf(fmaxf(sv[4], sv[5]), fmaxf(sv[6], sv[7]));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float u0 = n0 == -INFINITY ? 0.0f : n0, u1 = n1 == -INFINITY ? 0.0f : n1;
        // a row that had seen no token has O = L = 0: factor 1, so the rescale can be skipped
        const float c0 = m0 == -INFINITY ? 1.0f : expf(m0 - u0), c1 = m1 == -INFINITY ? 1.0f : expf(m1 - u1);
        m0 = n0;
        m1 = n1;
        float p[8];
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            // P rounded to bf16, a pair per conversion
            const u32 q0 = pack_bf2_rn(expf(sv[e] - u0), expf(sv[e + 1] - u0));
            const u32 q1 = pack_bf2_rn(expf(sv[e + 4] - u1), expf(sv[e + 5] - u1));
            p[e] = bf2_lo(q0);
            p[e + 1] = bf2_hi(q0);
            p[e + 4] = bf2_lo(q1);
            p[e + 5] = bf2_hi(q1);
        }
        l0 = l0 * c0 + ((p[0] + p[1]) + (p[2] + p[3]));
        l1 = l1 * c1 + ((p[4] + p[5]) + (p[6] + p[7]));
        // The rescale of O, skipped when no row of the warp raised its maximum (every
        // factor 1: the same values).
        if (__any_sync(FULL_MASK, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                o[j][0] *= c0;
                o[j][1] *= c0;
                o[j][2] *= c1;
                o[j][3] *= c1;
            }
        }
        const u32 pa[4] = {pack_bf2(p[0], p[1]), pack_bf2(p[4], p[5]), pack_bf2(p[2], p[3]),
                           pack_bf2(p[6], p[7])};
        // O += P.V over output column tiles of 8 dims, two per ldmatrix.
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
            if (j < nd) {
                u32 b[4];
                ldsm_x4_trans_at(b, vs + j * 16);
                mma_bf16(o[j], pa, b[0], b[1]);
                mma_bf16(o[j + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads();
    }

    // Merge the warps (shared memory reused: every copy has landed, every warp is past the
    // loop). For each output element, in warp order: M = max of the warps' maxima, then
    // L += l_w e^(m_w - M) and O += o_w e^(m_w - M) over the warps that saw a token. Each
    // thread forms four consecutive elements of one head per pass (16-byte shared loads and
    // global stores), so the weights are computed once per four elements.
    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    const int OS = D + 8;                      // shared row stride of the O states, floats
    float* sm_o = (float*)att_sh;              // [ATT_WARPS][16][OS]
    float* sm_m = sm_o + ATT_WARPS * 16 * OS;  // [ATT_WARPS][16]
    float* sm_l = sm_m + ATT_WARPS * 16;       // [ATT_WARPS][16]
    const int gr = lane >> 2, cc = (lane & 3) * 2;
    if ((lane & 3) == 0) {
        sm_m[warp * 16 + gr] = m0;
        sm_m[warp * 16 + gr + 8] = m1;
        sm_l[warp * 16 + gr] = l0;
        sm_l[warp * 16 + gr + 8] = l1;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        if (j < nd) {
            *(float2*)(sm_o + (warp * 16 + gr) * OS + j * 8 + cc) = make_float2(o[j][0], o[j][1]);
            *(float2*)(sm_o + (warp * 16 + gr + 8) * OS + j * 8 + cc) = make_float2(o[j][2], o[j][3]);
        }
    }
    __syncthreads();
    const int D4 = D >> 2;
    for (int idx = threadIdx.x; idx < gc * D4; idx += ATT_THREADS) {
        const int gi = idx / D4, d = (idx - gi * D4) * 4;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, sm_m[w * 16 + gi]);
        float L = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float mw = sm_m[w * 16 + gi];
            if (mw != -INFINITY) {
                const float wt = expf(mw - M);
                const float4 v = *(const float4*)(sm_o + (w * 16 + gi) * OS + d);
                L += sm_l[w * 16 + gi] * wt;
                acc.x += v.x * wt;
                acc.y += v.y * wt;
                acc.z += v.z * wt;
                acc.w += v.w * wt;
            }
        }
        const u64 slot = slot0 + (u64)gi * nsplit;
        *(float4*)(part_o + slot * D + d) = acc;
        if (d == 0) {
            part_ml[2 * slot] = M;
            part_ml[2 * slot + 1] = L;
        }
    }
    cta_log_end(cta_log);
}

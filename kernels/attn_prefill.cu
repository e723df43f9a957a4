// Prefill attention on the tensor cores (nosa-model.md §5, §6), in the manner of
// FlashAttention-2: one pass over the keys with an online softmax, no split-K and no
// partials. Two members of one family, sharing attn_prefill_impl:
//   dense  (attn_prefill_d*): causal attention over keys 0 .. pos of each row, no bias;
//   sparse (attn_prefill_sparse_d*): block-sparse causal attention over the blocks each row
//          selected (§4, §6: a per-query, per-KV-head selection), with the NOSA bias c[j, h]
//          added to the scaled logits when cptr is set (none in InfLLM-V2 mode).
//
// Rows: the call's query rows r = 0 .. rows-1 (one prompt token each). A run is a maximal
// range of consecutive rows of one sequence at consecutive positions (a prefill chunk is one
// run); row r sits at position pos_r = lens[r] - 1 and attends to keys 0 .. pos_r of its
// sequence (the cache already holds them: chunked prefill with T0 > 0 sees the earlier
// chunks' keys).
//
// GQA packing: for KV head h, the M dimension of the matrix products is the run's
// (row, query head) pairs flattened as m = i*G + g (row r0 + i of the run, query head h*G + g,
// G = H / hkv), so one K/V tile in shared memory serves all G query heads of the rows in the
// tile (a short chunk with a large G still fills the tile).
//
// Work items: tiles[3*b .. 3*b+2] = (r0, nrows, m0) for thread block b: the run starting at
// row r0 with nrows rows; the block computes the flattened entries m0 .. min(m0 + 64, nrows*G)
// - 1 of that run for KV head blockIdx.y (src/cuda/ops/prefill_attention.rs `prefill_tiles` builds
// them, longest-context tiles first). The tile's query rows are i_lo = m0 / G .. i_hi =
// (mend - 1) / G of the run (at most 64 rows); tile row k is run row i_lo + k. Grid (ntiles,
// hkv); block PF_THREADS threads; dynamic shared memory prefill_smem_bytes(D) =
// 2*PF_STAGES*64*(D+8)*2 bytes (PF_STAGES stages of K and V tiles, see below), plus
// PF_STAGES*64*4 bytes of bias stages for the sparse kernel.
//
// Sparse union (prefill_sel_union, one block per (tile, KV head), same grid and tiles): the
// blocks that any row of the tile selected for KV head h, ascending, each with the 64-bit mask
// of the tile rows that selected it (bit k: tile row k; the G query heads of a row share its
// KV head's selection). Row r's list is sel[(r*hkv + h)*s_max ...], nsel[r*hkv + h] valid
// entries (those of attn_partial; -1 entries and ids past the row's current block
// (lens[r]-1)/block_size are skipped). Written to ublk / umask [ntiles, hkv, u_max] and
// un [ntiles, hkv]; u_max >= min(blocks of the tile's last row, rows * s_max) bounds the union
// (the host sizes it so). Block ids are swept in passes of PF_UNION_CHUNK through a
// shared-memory mask table, so any context length works.
//
// Layouts (those of attn_partial): q bf16, row r's H*D post-RoPE query values at r*q_stride,
// head g at g*D; K/V of row r: bf16 [cap, hkv, D] at kptr[r] / vptr[r] (every row of a run
// has the same cache); bias c f32 [cap, hkv] at cptr[r0] (sparse, cptr and cptr[r0] non-null:
// NOSA; rows of a run share it); out bf16, row r's H*D values at r*out_stride, head g at g*D.
//
// Method: warp w owns the 16 M-rows m0 + 16w .. +15 (Q as mma A fragments in registers, f32
// output accumulators). Keys in tiles of 64, staged in shared memory (PF_STAGES) with cp.async
// (keys outside the tile's range zero-filled). Dense: key tile t = keys 64t .. 64t+63, up to
// the tile's last position. Sparse: union entry e, block b, covers keys b*block_size ..
// (b+1)*block_size - 1 in spb = ceil(block_size / 64) key tiles (a block of fewer than 64
// keys leaves the rest of its tile masked). Per key tile: S = Q.K^T (mma m16n8k16 bf16, f32),
// logits S*scale (+ c[j, h] in NOSA mode) in log2 units, -inf past each row's position and,
// sparse, for the rows whose mask bit is clear, online softmax in f32 (running max and sum per
// row), P rounded to bf16 (the sum adds the rounded P, as in attn_partial), O = O*e^(m_old -
// m_new) + P.V (mma; the rescale skipped when no row of the warp raised its maximum). A warp
// skips the key tiles none of its rows sees. At the end O / L is written as bf16 (0 for a row
// that saw no key). Arithmetic as attn_partial's (bf16 operands, f32 accumulation and
// softmax) but for the exponent: 2^x by ex2.approx.ftz (attn_partial: expf), and in dense
// mode the scale fused into it, P = 2^fma(S, scale*log2e, -m) with m the scaled running
// maximum; in another summation order.
//
// D is a template parameter: 64, 80 or 128, the entry points at the end (any multiple of 16
// up to 128 would compile).

#define PF_BM 64            // M-rows (row, head) pairs per block
#define PF_BN 64            // keys per shared-memory tile
#define PF_WARPS 4          // PF_BM / 16
#define PF_THREADS (32 * PF_WARPS)
#define PF_PAD 8            // bf16 padding per shared row (bank-conflict-free ldmatrix)
#define PF_UNION_CHUNK 2048  // block ids one pass of prefill_sel_union covers
#define PF_UNION_THREADS 256
// Blocks per SM the attention entry points are compiled for (__launch_bounds__' second
// argument; registers per thread at most 65536 / (PF_THREADS * PF_MIN_BLOCKS)): a tuning
// constant SPARDA_NVRTC_OPTIONS may set (-DPF_MIN_BLOCKS=3, slower: README, prefill section).
// Shared-memory stages of the K/V (and bias) tiles. PF_STAGES = 2 (the default) or 3: one
// block barrier per key tile, after which the copy of tile t + PF_STAGES - 1 is issued into
// the stage every warp finished at the tile before. PF_STAGES = 0: the earlier double buffer,
// two stages with two barriers per tile (the copy of tile t + 1 issued before tile t is
// waited for; the second barrier frees a stage for the next copy). The host sizes shared
// memory from the same option (prefill_stages in src/cuda/ops/prefill_attention.rs).
#ifndef PF_STAGES
#define PF_STAGES 2
#endif
#if PF_STAGES == 0
#undef PF_STAGES
#define PF_STAGES 2
#define PF_ONE_BARRIER 0
#elif PF_STAGES == 2 || PF_STAGES == 3
#define PF_ONE_BARRIER 1
#else
#error "PF_STAGES takes 0, 2 or 3"
#endif
#ifndef PF_MIN_BLOCKS
#define PF_MIN_BLOCKS 2
#endif

// The union of the block selections of one (tile, KV head); see the header. Grid (ntiles,
// hkv); block PF_UNION_THREADS threads; static shared memory only (16.9 KB).
extern "C" __global__ __launch_bounds__(PF_UNION_THREADS) void prefill_sel_union(
    const int* __restrict__ tiles, const int* __restrict__ lens, const int* __restrict__ sel,
    const int* __restrict__ nsel, int s_max, int H, int hkv, int block_size, int* __restrict__ ublk,
    u64* __restrict__ umask, int* __restrict__ un, int u_max) {
    __shared__ u64 tab[PF_UNION_CHUNK];  // rows' bits per block id b0 + i
    __shared__ int rq[PF_BM];            // each tile row's current block
    __shared__ int rn[PF_BM];            // each tile row's list length
    __shared__ int wsum[PF_UNION_THREADS / 32];
    constexpr int PER = PF_UNION_CHUNK / PF_UNION_THREADS;  // consecutive ids per thread
    const int h = blockIdx.y, G = H / hkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = tiles[3 * blockIdx.x], nrows = tiles[3 * blockIdx.x + 1], m0 = tiles[3 * blockIdx.x + 2];
    const int mend = min(m0 + PF_BM, nrows * G);
    const int ilo = m0 / G;
    const int R = (mend - 1) / G - ilo + 1;  // tile rows, 1 .. 64
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        const int r = r0 + ilo + i;
        rq[i] = (lens[r] - 1) / block_size;
        rn[i] = min(nsel[(u64)r * hkv + h], s_max);
    }
    __syncthreads();
    const int nb = rq[R - 1] + 1;  // rows at ascending positions: the last has the most blocks
    const u64 obase = ((u64)blockIdx.x * hkv + h) * u_max;
    int total = 0;  // entries found so far (uniform over the block)
    for (int b0 = 0; b0 < nb; b0 += PF_UNION_CHUNK) {
        for (int i = threadIdx.x; i < PF_UNION_CHUNK; i += blockDim.x) tab[i] = 0ull;
        __syncthreads();
        for (int x = threadIdx.x; x < R * s_max; x += blockDim.x) {
            const int i = x / s_max, e = x - i * s_max;
            if (e >= rn[i]) continue;
            const int blk = sel[((u64)(r0 + ilo + i) * hkv + h) * s_max + e];
            if (blk < 0 || blk > rq[i] || blk < b0 || blk >= b0 + PF_UNION_CHUNK) continue;
            atomicOr(&tab[blk - b0], 1ull << i);
        }
        __syncthreads();
        // Compaction in id order: thread t owns ids b0 + PER*t .. +PER-1; block-wide scan.
        const int first = PER * threadIdx.x;
        int cnt = 0;
#pragma unroll
        for (int k = 0; k < PER; ++k) cnt += tab[first + k] != 0ull ? 1 : 0;
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) wsum[warp] = incl;
        __syncthreads();
        int woff = 0, pass_total = 0;
#pragma unroll
        for (int w = 0; w < PF_UNION_THREADS / 32; ++w) {
            woff += w < warp ? wsum[w] : 0;
            pass_total += wsum[w];
        }
        int at = total + woff + incl - cnt;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const u64 m = tab[first + k];
            if (m != 0ull) {
                if (at < u_max) {
                    ublk[obase + at] = b0 + first + k;
                    umask[obase + at] = m;
                }
                ++at;
            }
        }
        total += pass_total;
        __syncthreads();  // tab and wsum are rewritten by the next pass
    }
    if (threadIdx.x == 0) un[(u64)blockIdx.x * hkv + h] = min(total, u_max);
}

// One (tile, KV head) of either kernel (see the header). SPARSE: the key tiles are the
// tile's union entries (ublk / umask / un at u_max per (tile, head), block_size tokens per
// block) and the bias c is read from cptr[r0] when set; dense: cptr, ublk, umask, un unused.
template <int D, bool SPARSE>
__device__ __forceinline__ void attn_prefill_impl(const bf16_t* __restrict__ q, int q_stride,
                                                  const u64* __restrict__ kptr, const u64* __restrict__ vptr,
                                                  const u64* __restrict__ cptr, const int* __restrict__ lens,
                                                  const int* __restrict__ tiles, const int* __restrict__ ublk,
                                                  const u64* __restrict__ umask, const int* __restrict__ un,
                                                  int u_max, int block_size, bf16_t* __restrict__ out,
                                                  int out_stride, int H, int hkv, float scale) {
    constexpr int RS = D + PF_PAD;  // shared row stride, bf16 elements
    constexpr int NK = D / 16;      // k-steps of S = Q.K^T
    constexpr int ND = D / 8;       // 8-column output tiles
    constexpr int CPR = D / 8;      // 16-byte chunks per K/V row
    constexpr int RPP = PF_THREADS / CPR;  // K/V rows one pass of the block loads
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(16) unsigned char pf_sh[];
    __shared__ int pf_kmax[PF_WARPS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.y;
    const int G = H / hkv;
    const int r0 = tiles[3 * blockIdx.x], nrows = tiles[3 * blockIdx.x + 1], m0 = tiles[3 * blockIdx.x + 2];
    const int mend = min(m0 + PF_BM, nrows * G);
    const int ilo = m0 / G;

    // This lane's two fragment rows (lane/4 and lane/4 + 8 of the warp's 16): query row,
    // query head, position (-1 for an M-row past the tile's end: it sees no key), tile row.
    int rr[2], hh[2], pp[2], ti[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int m = m0 + warp * 16 + (lane >> 2) + 8 * k;
        if (m < mend) {
            const int i = m / G;
            rr[k] = r0 + i;
            hh[k] = h * G + (m - i * G);
            pp[k] = lens[rr[k]] - 1;
            ti[k] = i - ilo;
        } else {
            rr[k] = -1;
            hh[k] = 0;
            pp[k] = -1;
            ti[k] = -1;
        }
    }
    // Warp range of positions: tiles past wmax are skipped; tiles up to wmin need no causal mask.
    int wmax = max(pp[0], pp[1]), wmin = min(pp[0], pp[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmax = max(wmax, __shfl_xor_sync(FULL_MASK, wmax, o));
        wmin = min(wmin, __shfl_xor_sync(FULL_MASK, wmin, o));
    }
    if (lane == 0) pf_kmax[warp] = wmax;
    // Sparse: the warp's tile rows as a bit set (halves lo/hi), to skip union entries none
    // of them selected.
    u32 wb_lo = 0u, wb_hi = 0u;
    if (SPARSE) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            if (ti[k] >= 0) {
                if (ti[k] < 32)
                    wb_lo |= 1u << ti[k];
                else
                    wb_hi |= 1u << (ti[k] - 32);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wb_lo |= __shfl_xor_sync(FULL_MASK, wb_lo, o);
            wb_hi |= __shfl_xor_sync(FULL_MASK, wb_hi, o);
        }
    }
    const u64 wbits = ((u64)wb_hi << 32) | (u64)wb_lo;

    // Q fragments (A operand, row-major 16 x 16 per k-step): rows lane/4 (+8), columns
    // 2*(lane%4) (+1) and +8 of each k-step.
    u32 qa[NK][4];
    {
        const int qc = (lane & 3) * 2;
        const bf16_t* q0 = rr[0] >= 0 ? q + (u64)rr[0] * q_stride + (u64)hh[0] * D : nullptr;
        const bf16_t* q1 = rr[1] >= 0 ? q + (u64)rr[1] * q_stride + (u64)hh[1] * D : nullptr;
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
            const int c0 = kk * 16 + qc;
            qa[kk][0] = q0 != nullptr ? *(const u32*)(q0 + c0) : 0u;
            qa[kk][1] = q1 != nullptr ? *(const u32*)(q1 + c0) : 0u;
            qa[kk][2] = q0 != nullptr ? *(const u32*)(q0 + c0 + 8) : 0u;
            qa[kk][3] = q1 != nullptr ? *(const u32*)(q1 + c0 + 8) : 0u;
        }
    }
    __syncthreads();
    int kmax = -1;  // the block's last position: keys 0 .. kmax are read
#pragma unroll
    for (int w = 0; w < PF_WARPS; ++w) kmax = max(kmax, pf_kmax[w]);
    if (kmax < 0) return;  // no M-row (cannot happen for tiles the host built)
    // Key tiles: dense, 64 consecutive keys each up to kmax; sparse, spb per union entry.
    const int spb = SPARSE ? (block_size + PF_BN - 1) / PF_BN : 1;
    const u64 ubase = ((u64)blockIdx.x * hkv + h) * u_max;
    const int nkt = SPARSE ? un[(u64)blockIdx.x * hkv + h] * spb : kmax / PF_BN + 1;
    if (SPARSE) ublk += ubase;
    if (SPARSE) umask += ubase;

    bf16_t* Ks = (bf16_t*)pf_sh;                // [PF_STAGES][PF_BN][RS]
    bf16_t* Vs = Ks + PF_STAGES * PF_BN * RS;   // [PF_STAGES][PF_BN][RS]
    // ldmatrix row addresses of this lane in stage 0 (mma.cuh ldsm_k_lane / ldsm_v_lane)
    const u32 ks_lane = smem_addr(Ks + ldsm_k_lane(lane, RS));
    const u32 vs_lane = smem_addr(Vs + ldsm_v_lane(lane, RS));
    float* Bs = (float*)(Vs + PF_STAGES * PF_BN * RS);  // [PF_STAGES][PF_BN] bias (sparse with c only)
    const bf16_t* K = (const bf16_t*)kptr[r0];
    const bf16_t* V = (const bf16_t*)vptr[r0];
    const float* C = (SPARSE && cptr != nullptr) ? (const float*)cptr[r0] : nullptr;
    const u64 tok_stride = (u64)hkv * D;
    const int my_row = threadIdx.x / CPR, my_part = threadIdx.x - my_row * CPR;
    const bool loader = my_row < RPP;
    const bf16_t* Kh = K + (u64)h * D + my_part * 8;
    const bf16_t* Vh = V + (u64)h * D + my_part * 8;

    // Key tile t: its first key kt0 and its valid keys kt0 .. kt0 + nv - 1 (fewer than 64
    // only for a sparse block of fewer than 64 keys, or the last tile of a longer one).
    auto tile_keys = [&](int t, int& kt0, int& nv) {
        if (SPARSE) {
            const int e = t / spb, c = t - e * spb;
            kt0 = __ldg(ublk + e) * block_size + c * PF_BN;
            nv = min(PF_BN, block_size - c * PF_BN);
        } else {
            kt0 = t * PF_BN;
            nv = PF_BN;
        }
    };
    // Issues the copies of key tile t into stage st (keys past kmax or the tile's valid keys
    // zero-filled).
    // Pass i copies tile row my_row + i*RPP; the shared addresses are this thread's stage-0
    // ones plus constants, the global ones a base plus i strides.
    const u32 kd_lane = smem_addr(Ks + my_row * RS + my_part * 8);
    const u32 vd_lane = smem_addr(Vs + my_row * RS + my_part * 8);
    const u32 bd_lane = smem_addr(Bs + my_row);
    const u64 pass_stride = (u64)RPP * tok_stride;
    auto load_tile = [&](int t, int st) {
        if (!loader) return;
        int kt0, nv;
        tile_keys(t, kt0, nv);
        const u32 sto = st * (PF_BN * RS * 2);
        const u64 g0 = (u64)(kt0 + my_row) * tok_stride;
        const bf16_t* kg = Kh + g0;
        const bf16_t* vg = Vh + g0;
#pragma unroll
        for (int i = 0; i < (PF_BN + RPP - 1) / RPP; ++i) {
            const int row = my_row + i * RPP;
            if ((i + 1) * RPP > PF_BN && row >= PF_BN) break;  // only a last, partial pass tests
            const int j = kt0 + row;
            const bool ok = row < nv && j <= kmax;
            cp_async16_at(kd_lane + sto + i * (RPP * RS * 2), ok ? (const void*)(kg + i * pass_stride) : (const void*)Kh, ok);
            cp_async16_at(vd_lane + sto + i * (RPP * RS * 2), ok ? (const void*)(vg + i * pass_stride) : (const void*)Vh, ok);
            if (SPARSE && C != nullptr && my_part == 0)
                cp_async4_at(bd_lane + st * (PF_BN * 4) + i * (RPP * 4),
                             ok ? (const void*)(C + (u64)j * hkv + h) : (const void*)C, ok);
        }
    };

    float o[ND][4];
#pragma unroll
    for (int j = 0; j < ND; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Running max (of logits in log2 units) and this lane's share of the sum, rows lane/4 and +8.
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f};
    const float sl2 = scale * LOG2E;  // logits in log2 units: exp(x) = 2^(x log2 e)

#if PF_ONE_BARRIER
    // Tiles 0 .. PF_STAGES - 2 in flight; one group per tile, empty past the last tile, so
    // that "at most PF_STAGES - 2 pending" means tile t has landed.
#pragma unroll
    for (int s0 = 0; s0 < PF_STAGES - 1; ++s0) {
        if (s0 < nkt) load_tile(s0, s0);
        cp_async_commit();
    }
    int st = 0;  // t % PF_STAGES
    for (int t = 0; t < nkt; ++t) {
        cp_async_wait_n<PF_STAGES - 2>();
        __syncthreads();  // tile t visible to all; every warp is done with tile t - 1
        const int tn = t + PF_STAGES - 1;
        if (tn < nkt) load_tile(tn, st == 0 ? PF_STAGES - 1 : st - 1);
        cp_async_commit();
#else
    if (nkt > 0) {
        load_tile(0, 0);
        cp_async_commit();
    }
    for (int t = 0; t < nkt; ++t) {
        const int st = t & 1;
        if (t + 1 < nkt) {
            load_tile(t + 1, st ^ 1);
            cp_async_commit();
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();
#endif
        int kt0, nv;
        tile_keys(t, kt0, nv);
        // Sparse: the tile rows that selected this tile's block.
        const u64 sel_rows = SPARSE ? __ldg(umask + t / spb) : ~0ull;
        // Warp-uniform: some row of this warp sees a key of the tile.
        if (kt0 <= wmax && (!SPARSE || (sel_rows & wbits) != 0ull)) {
            // This lane's ldmatrix row addresses in stage st (shared window, bytes); the
            // (nb, kk) and (kk, j) steps below add constants.
            const u32 ks = ks_lane + st * (PF_BN * RS * 2);
            const u32 vs = vs_lane + st * (PF_BN * RS * 2);
            // S = Q.K^T: s[c] holds keys kt0 + 8c .. +7 (c = 0 .. 7).
            float s[8][4];
#pragma unroll
            for (int c = 0; c < 8; ++c) s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.0f;
            mma_qk_tile64<NK, RS>(s, qa, ks);
            // Logits in log2 units. Dense: causal mask where some row of the warp ends inside
            // the tile. Sparse: the bias on the scaled logit, -inf for rows that did not
            // select the block, keys past the row's position and keys past the block.
            const int cb = (lane & 3) * 2;  // this lane's first column of each 8
            float mx[2] = {-INFINITY, -INFINITY};
            if (SPARSE) {
                const float* bs = Bs + st * PF_BN;
                bool rs[2];
#pragma unroll
                for (int k = 0; k < 2; ++k) rs[k] = ti[k] >= 0 && ((sel_rows >> ti[k]) & 1ull) != 0ull;
                // Warp-uniform: every row of the warp selected the block, the block fills the
                // tile and ends at or before the warp's first position (wmin is -1 when the
                // warp has an empty row), so no element is masked.
                const bool unmasked = (sel_rows & wbits) == wbits && nv == PF_BN && kt0 + PF_BN - 1 <= wmin;
                if (unmasked) {
#pragma unroll
                    for (int c = 0; c < 8; ++c) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float bias = C != nullptr ? bs[cb + 8 * c + e] : 0.0f;
#pragma unroll
                            for (int k = 0; k < 2; ++k) {
                                const float v = (s[c][2 * k + e] * scale + bias) * LOG2E;
                                s[c][2 * k + e] = v;
                                mx[k] = fmaxf(mx[k], v);
                            }
                        }
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < 8; ++c) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = cb + 8 * c + e;
                            const int j = kt0 + col;
                            const float bias = C != nullptr ? bs[col] : 0.0f;
#pragma unroll
                            for (int k = 0; k < 2; ++k) {
                                float v = (s[c][2 * k + e] * scale + bias) * LOG2E;
                                if (!rs[k] || col >= nv || j > pp[k]) v = -INFINITY;
                                s[c][2 * k + e] = v;
                                mx[k] = fmaxf(mx[k], v);
                            }
                        }
                    }
                }
            } else {
                // Raw logits here (the maximum scaled after, as scaling by a positive factor
                // keeps the order); the scale joins the exponent's FFMA below.
                // Warp-uniform: only a tile past some row's position needs the causal mask.
                if (kt0 + PF_BN - 1 > wmin) {
#pragma unroll
                    for (int c = 0; c < 8; ++c) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int j = kt0 + cb + 8 * c + e;
#pragma unroll
                            for (int k = 0; k < 2; ++k)
                                if (j > pp[k]) s[c][2 * k + e] = -INFINITY;
                        }
                    }
                }
#pragma unroll
                for (int c = 0; c < 8; ++c) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[c][e]);
                }
                mx[0] *= sl2;
                mx[1] *= sl2;
            }
            float corr[2], u[2];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL_MASK, mx[k], 1));
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL_MASK, mx[k], 2));
                const float nm = fmaxf(mr[k], mx[k]);
                u[k] = nm == -INFINITY ? 0.0f : nm;  // a row that has seen no key yet stays at 0
                // a row that had seen no key has O = L = 0: factor 1, so the rescale can be skipped
                corr[k] = mr[k] == -INFINITY ? 1.0f : ex2_ftz(mr[k] - u[k]);
                mr[k] = nm;
            }
            // P rounded to bf16, a pair per conversion, kept packed as the A fragments of
            // P.V; the sum adds the rounded e = 0 then e = 1. Dense: 2^(s*scale*log2e - u)
            // in one FFMA (-inf stays -inf: P = 0); sparse: the logits already scaled.
            float ls[2] = {0.0f, 0.0f};
            u32 pb[8][2];
#pragma unroll
            for (int c = 0; c < 8; ++c) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    float x0, x1;
                    if (SPARSE) {
                        x0 = s[c][2 * k] - u[k];
                        x1 = s[c][2 * k + 1] - u[k];
                    } else {
                        x0 = fmaf(s[c][2 * k], sl2, -u[k]);
                        x1 = fmaf(s[c][2 * k + 1], sl2, -u[k]);
                    }
                    const u32 pk = pack_bf2_rn(ex2_ftz(x0), ex2_ftz(x1));
                    pb[c][k] = pk;
                    ls[k] += bf2_lo(pk);
                    ls[k] += bf2_hi(pk);
                }
            }
            lr[0] = lr[0] * corr[0] + ls[0];
            lr[1] = lr[1] * corr[1] + ls[1];
            // The rescale of O, skipped when no row of the warp raised its maximum (every
            // factor 1: the same values).
            if (__any_sync(FULL_MASK, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
                for (int j = 0; j < ND; ++j) {
                    o[j][0] *= corr[0];
                    o[j][1] *= corr[0];
                    o[j][2] *= corr[1];
                    o[j][3] *= corr[1];
                }
            }
            // O += P.V: P (16 x 64, A fragments packed above), V tile 64 x D.
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u32 pa[4] = {pb[2 * kk][0], pb[2 * kk][1], pb[2 * kk + 1][0], pb[2 * kk + 1][1]};
#pragma unroll
                for (int j = 0; j < ND; j += 2) {
                    u32 b[4];
                    ldsm_x4_trans_at(b, vs + (kk * 16 * RS + j * 8) * 2);
                    mma_bf16(o[j], pa, b[0], b[1]);
                    mma_bf16(o[j + 1], pa, b[2], b[3]);
                }
            }
        }
#if PF_ONE_BARRIER
        st = st + 1 == PF_STAGES ? 0 : st + 1;
#else
        __syncthreads();  // stage st is reloaded by the next iteration's copies
#endif
    }

    // The row sums: each lane holds the sum over its columns; add the quad's four.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        lr[k] += __shfl_xor_sync(FULL_MASK, lr[k], 1);
        lr[k] += __shfl_xor_sync(FULL_MASK, lr[k], 2);
    }
    const int cc = (lane & 3) * 2;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        if (rr[k] < 0) continue;
        const float inv = lr[k] > 0.0f ? 1.0f / lr[k] : 0.0f;
        bf16_t* orow = out + (u64)rr[k] * out_stride + (u64)hh[k] * D + cc;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
            *(u32*)(orow + j * 8) = (u32)f2bf(o[j][2 * k] * inv) | ((u32)f2bf(o[j][2 * k + 1] * inv) << 16);
        }
    }
}

// The entry points, one per supported head dim: dense (no bias, no union; arguments as
// attn_prefill_impl's) and sparse.
extern "C" __global__ __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS) void attn_prefill_d64(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const int* __restrict__ lens, const int* __restrict__ tiles, bf16_t* __restrict__ out, int out_stride, int H,
    int hkv, float scale) {
    attn_prefill_impl<64, false>(q, q_stride, kptr, vptr, nullptr, lens, tiles, nullptr, nullptr, nullptr, 0, 1, out,
                                 out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS) void attn_prefill_d80(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const int* __restrict__ lens, const int* __restrict__ tiles, bf16_t* __restrict__ out, int out_stride, int H,
    int hkv, float scale) {
    attn_prefill_impl<80, false>(q, q_stride, kptr, vptr, nullptr, lens, tiles, nullptr, nullptr, nullptr, 0, 1, out,
                                 out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS) void attn_prefill_d128(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const int* __restrict__ lens, const int* __restrict__ tiles, bf16_t* __restrict__ out, int out_stride, int H,
    int hkv, float scale) {
    attn_prefill_impl<128, false>(q, q_stride, kptr, vptr, nullptr, lens, tiles, nullptr, nullptr, nullptr, 0, 1, out,
                                 out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS) void attn_prefill_sparse_d64(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const u64* __restrict__ cptr, const int* __restrict__ lens, const int* __restrict__ tiles,
    const int* __restrict__ ublk, const u64* __restrict__ umask, const int* __restrict__ un, int u_max, int block_size,
    bf16_t* __restrict__ out, int out_stride, int H, int hkv, float scale) {
    attn_prefill_impl<64, true>(q, q_stride, kptr, vptr, cptr, lens, tiles, ublk, umask, un, u_max, block_size, out,
                                out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS) void attn_prefill_sparse_d80(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const u64* __restrict__ cptr, const int* __restrict__ lens, const int* __restrict__ tiles,
    const int* __restrict__ ublk, const u64* __restrict__ umask, const int* __restrict__ un, int u_max, int block_size,
    bf16_t* __restrict__ out, int out_stride, int H, int hkv, float scale) {
    attn_prefill_impl<80, true>(q, q_stride, kptr, vptr, cptr, lens, tiles, ublk, umask, un, u_max, block_size, out,
                                out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS) void attn_prefill_sparse_d128(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const u64* __restrict__ cptr, const int* __restrict__ lens, const int* __restrict__ tiles,
    const int* __restrict__ ublk, const u64* __restrict__ umask, const int* __restrict__ un, int u_max, int block_size,
    bf16_t* __restrict__ out, int out_stride, int H, int hkv, float scale) {
    attn_prefill_impl<128, true>(q, q_stride, kptr, vptr, cptr, lens, tiles, ublk, umask, un, u_max, block_size, out,
                                out_stride, H, hkv, scale);
}

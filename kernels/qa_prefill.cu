// Query-aware window scores of prefill rows on the tensor cores (nosa-model.md §4.1): for
// the rows of one sequence (a prefill chunk, every row reading the same compressed keys Kc),
// s[b, h, w] = sum over query heads g of KV head h (ascending) of softmax_w(q_g . Kc[w, h] /
// sqrt(D)) over the windows w < Mc(lens[b]) row b sees. The values of select.cu's
// qa_window_logits + qa_window_scores (and of the cuBLAS logits with qa_tile_stats), up to
// the summation order, computed without writing the f32 logits to device memory.
//
// Exact products: q is bf16; each f32 Kc value x is split into three bf16 parts hi + mid + lo
// = x (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid); the subtractions are exact
// in f32), so q . Kc = q . hi + q . mid + q . lo with every product exact and the sums in the
// f32 accumulators of mma.sync m16n8k16 (the accuracy of an f32 dot product, not of a bf16
// one).
//
// GQA packing as attn_prefill.cu, on 128 M-rows: block (blockIdx.x, h = blockIdx.y) takes
// R = 128 / G consecutive rows b0 = R*blockIdx.x .. b0 + R - 1 (fewer in the last block) and
// their G query heads each as the M-rows m = i*G + g (block row i, query head h*G + g); warp w
// of 8 owns M-rows 16w .. 16w+15 (Q as mma A fragments in registers). Every Kc tile a block
// reads and splits serves 128 M-rows: the L2 reads and the splitting per tensor-core product
// are half those of a 64-row block (2 blocks of 8 warps fit an SM, against 3 of 4; on the
// H200 NOSA-8B sparse prefill went from 19,600 to 21,050 tokens/s at 32K). Windows in
// tiles of 64: each tile of Kc[w0 .. w0+63, h, :] is read from device memory (f32, 16-byte
// loads), split and stored as three bf16 tiles in shared memory, and S = Q.Kc^T computed
// from them. Two passes over the tiles: the first keeps each M-row's running maximum and
// sum of exp (online softmax, expf, windows w >= Mc of the row masked); the second
// recomputes S, writes P = exp(S - M) / L to a shared tile and sums it over each row's G
// query heads into s (windows w >= Mc of a row are not written: select_blocks reads the
// first Mc).
//
// Layouts: q bf16, row b's H*D post-RoPE query values at b*q_stride, head g at g*D; kc f32
// [>= max Mc, hkv, D]; lens i32 [rows] (row b's query sees lens[b] tokens); s f32, row (b, h)
// at (b*hkv + h)*w_stride (w_stride >= every row's Mc). Grid (ceil(rows / R), hkv); block
// QP_THREADS threads; dynamic shared memory qa_prefill_smem_bytes(D, NP) (src/cuda/ops/prefill_scores.rs:
// NP*64*(D+8)*2 + 128*(64+1)*4 bytes, NP the Kc parts below). G <= 64; D a template parameter (64, 80, 128: the entry
// points at the end).

#define QP_BM 128  // (row, query head) M-rows per block
#define QP_BN 64   // windows per tile
#define QP_WARPS 8 // QP_BM / 16
#define QP_THREADS (32 * QP_WARPS)
#define QP_PAD 8   // bf16 padding per shared row (bank-conflict-free ldmatrix)
#define QP_PS (QP_BN + 1)  // f32 stride of the shared P tile

// Two f32 values x0, x1 as three bf16x2 registers of parts a + b + c = x exactly (finite x;
// each register holds x0's part in its low half, x1's in its high half).
__device__ __forceinline__ void qp_split2(float x0, float x1, u32& a, u32& b, u32& c) {
    a = pack_bf2_rn(x0, x1);
    const float r0 = x0 - bf2_lo(a), r1 = x1 - bf2_hi(a);
    b = pack_bf2_rn(r0, r1);
    c = pack_bf2_rn(r0 - bf2_lo(b), r1 - bf2_hi(b));
}

// Kc windows w0 .. w0+63 of one KV head (Kh: window 0 of the head, kc_row f32 elements per
// window) into the NP bf16 part tiles at Ks (rows of D + QP_PAD; windows >= mc_max as 0), by
// the block's THREADS threads. Thread tid takes float4 chunks tid + i*THREADS (row x / (D/4),
// column chunk x % (D/4)); the loads of a batch are all issued before the first is used, so a
// tile costs about one L2 latency per batch instead of one per chunk.
template <int D, int NP, int THREADS>
__device__ __forceinline__ void qp_load_tile(bf16_t* Ks, const float* __restrict__ Kh, u64 kc_row, int w0,
                                             int mc_max, int tid) {
    constexpr int RS = D + QP_PAD;
    constexpr int F4 = D / 4;
    constexpr int PART = QP_BN * RS;
    constexpr int LD_ITERS = QP_BN * F4 / THREADS;  // 4, 5, 8 for D = 64, 80, 128 at 256 threads
    static_assert(QP_BN * F4 % THREADS == 0, "whole load passes");
    constexpr int LD_BATCH = LD_ITERS >= 10 ? LD_ITERS / 2 : LD_ITERS;
    static_assert(LD_ITERS % LD_BATCH == 0, "whole load batches");
#pragma unroll
    for (int i0 = 0; i0 < LD_ITERS; i0 += LD_BATCH) {
        float4 v[LD_BATCH];
#pragma unroll
        for (int j = 0; j < LD_BATCH; ++j) {
            const int x = tid + (i0 + j) * THREADS;
            const int row = x / F4, c4 = x - row * F4;
            v[j] = w0 + row < mc_max ? *(const float4*)(Kh + (u64)(w0 + row) * kc_row + c4 * 4)
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < LD_BATCH; ++j) {
            const int x = tid + (i0 + j) * THREADS;
            const int row = x / F4, c4 = x - row * F4;
            u32 a0, b0, c0, a1, b1, c1;
            qp_split2(v[j].x, v[j].y, a0, b0, c0);
            qp_split2(v[j].z, v[j].w, a1, b1, c1);
            const int o = row * RS + c4 * 4;
            *(uint2*)(Ks + o) = make_uint2(a0, a1);
            *(uint2*)(Ks + PART + o) = make_uint2(b0, b1);
            if (NP == 3) *(uint2*)(Ks + 2 * PART + o) = make_uint2(c0, c1);
        }
    }
}

// Q of one A tile as mma A fragments (row-major 16 x 16 per k-step): this lane's fragment rows
// lane/4 and lane/4 + 8 at qr0 and qr1 (nullptr: a row past the block's rows, zeros), columns
// 2*(lane%4) (+1) and +8 of each of the NK k-steps.
template <int NK>
__device__ __forceinline__ void qp_q_frags(u32 (&qa)[NK][4], const bf16_t* qr0, const bf16_t* qr1, int lane) {
    const int qc = (lane & 3) * 2;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
        const int c0 = kk * 16 + qc;
        qa[kk][0] = qr0 != nullptr ? *(const u32*)(qr0 + c0) : 0u;
        qa[kk][1] = qr1 != nullptr ? *(const u32*)(qr1 + c0) : 0u;
        qa[kk][2] = qr0 != nullptr ? *(const u32*)(qr0 + c0 + 8) : 0u;
        qa[kk][3] = qr1 != nullptr ? *(const u32*)(qr1 + c0 + 8) : 0u;
    }
}

// The Mc (windows a row scores, sel_windows) of the block's nr >= 1 rows b0 .. b0+nr-1 into
// qp_mc, filled by the block's THREADS threads and visible to all after the barrier; then
// every thread's largest and smallest of them. Every thread of the block calls it.
template <int THREADS>
__device__ __forceinline__ void qp_block_mc(int* qp_mc, const int* __restrict__ lens, int b0, int nr, int stride,
                                            int ksize, int& mc_max, int& mc_min) {
    for (int i = threadIdx.x; i < nr; i += THREADS) qp_mc[i] = sel_windows(lens[b0 + i], stride, ksize);
    __syncthreads();
    mc_max = 0, mc_min = 0x7fffffff;
    for (int i = 0; i < nr; ++i) mc_max = max(mc_max, qp_mc[i]), mc_min = min(mc_min, qp_mc[i]);
}

// NP: the Kc parts summed, 3 (hi + mid + lo = x, the accuracy of an f32 dot product) or 2
// (hi + mid, within 2^-16 |x| of x: the qa_prefill_scores_bf16x2_d* entry points, an
// experiment in trading accuracy for a third fewer tensor-core products).
template <int D, int NP>
__device__ __forceinline__ void qa_prefill_scores_impl(const bf16_t* __restrict__ q, int q_stride,
                                                       const float* __restrict__ kc, const int* __restrict__ lens,
                                                       float* __restrict__ s_out, int rows, int H, int hkv,
                                                       int w_stride, int stride, int ksize, float scale) {
    constexpr int RS = D + QP_PAD;  // shared row stride of a Kc part tile, bf16 elements
    constexpr int NK = D / 16;      // k-steps of S = Q.Kc^T
    constexpr int PART = QP_BN * RS;  // bf16 elements per part tile
    extern __shared__ __align__(16) unsigned char qp_sh[];
    __shared__ int qp_mc[QP_BM];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y, G = H / hkv;
    const int R = QP_BM / G;  // block rows
    const int b0 = blockIdx.x * R;
    const int nr = min(R, rows - b0);
    if (nr <= 0) return;  // uniform over the block
    int mc_max, mc_min;
    qp_block_mc<QP_THREADS>(qp_mc, lens, b0, nr, stride, ksize, mc_max, mc_min);
    if (mc_max == 0) return;  // uniform: no row has a window yet

    // This lane's two fragment rows (lane/4 and lane/4 + 8 of the warp's 16): block row
    // (-1 past the block's rows) and that row's Mc.
    int ti[2], mcr[2];
    u32 qa[NK][4];
    {
        const bf16_t* qr[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int m = warp * 16 + (lane >> 2) + 8 * k;
            const int i = m / G;
            if (i < nr) {
                ti[k] = i;
                mcr[k] = qp_mc[i];
                qr[k] = q + (u64)(b0 + i) * q_stride + (u64)(h * G + (m - i * G)) * D;
            } else {
                ti[k] = -1;
                mcr[k] = 0;
                qr[k] = nullptr;
            }
        }
        qp_q_frags<NK>(qa, qr[0], qr[1], lane);
    }

    bf16_t* Ks = (bf16_t*)qp_sh;           // [NP][QP_BN][RS]: hi, mid (, lo)
    float* Ps = (float*)(Ks + NP * PART);  // [QP_BM][QP_PS]
    const u32 ks_lane = smem_addr(Ks + ldsm_k_lane(lane, RS));
    const u64 kc_row = (u64)hkv * D;       // f32 elements per window of Kc
    const float* Kh = kc + (u64)h * D;
    const int ntiles = (mc_max + QP_BN - 1) / QP_BN;

    auto load_tile = [&](int w0) { qp_load_tile<D, NP, QP_THREADS>(Ks, Kh, kc_row, w0, mc_max, tid); };
    // S = Q.Kc^T of the tile in shared memory, scaled, -inf at windows w >= the row's Mc:
    // s[c][2k + e] is fragment row lane/4 + 8k, window w0 + 8c + 2*(lane%4) + e.
    auto tile_logits = [&](int w0, float (&s)[8][4]) {
#pragma unroll
        for (int c = 0; c < 8; ++c) s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.0f;
#pragma unroll
        for (int p = 0; p < NP; ++p) mma_qk_tile64<NK, RS>(s, qa, ks_lane + p * PART * 2);
        const int cb = (lane & 3) * 2;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int w = w0 + cb + 8 * c + e;
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const float v = s[c][2 * k + e] * scale;
                    s[c][2 * k + e] = w < mcr[k] ? v : -INFINITY;
                }
            }
        }
    };

    // Pass 1: running maximum and this lane's share of the sum of exp, per fragment row (the
    // maximum is kept equal over the row's four lanes).
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f};
    for (int t = 0; t < ntiles; ++t) {
        const int w0 = t * QP_BN;
        load_tile(w0);
        __syncthreads();
        float s[8][4];
        tile_logits(w0, s);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < 8; ++c) mx = fmaxf(mx, fmaxf(s[c][2 * k], s[c][2 * k + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            const float mn = fmaxf(mr[k], mx);
            if (mn != -INFINITY) {
                float l = mr[k] != -INFINITY ? lr[k] * expf(mr[k] - mn) : 0.0f;
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    l += expf(s[c][2 * k] - mn);  // exp(-inf) = 0 for masked windows
                    l += expf(s[c][2 * k + 1] - mn);
                }
                lr[k] = l;
                mr[k] = mn;
            }
        }
        __syncthreads();  // the part tiles are rewritten by the next tile
    }
    // The row's sum over its four lanes; 1/L (0 for a row without windows: P = 0).
    float il[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        float l = lr[k];
        l += __shfl_xor_sync(FULL_MASK, l, 1);
        l += __shfl_xor_sync(FULL_MASK, l, 2);
        il[k] = l > 0.0f ? 1.0f / l : 0.0f;
    }

    // Pass 2: P tiles, summed over each row's G query heads.
    const int cb = (lane & 3) * 2;
    for (int t = 0; t < ntiles; ++t) {
        const int w0 = t * QP_BN;
        load_tile(w0);
        __syncthreads();
        float s[8][4];
        tile_logits(w0, s);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            float* pr = Ps + (warp * 16 + (lane >> 2) + 8 * k) * QP_PS + cb;
#pragma unroll
            for (int c = 0; c < 8; ++c) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float v = s[c][2 * k + e];
                    pr[8 * c + e] = v != -INFINITY ? expf(v - mr[k]) * il[k] : 0.0f;
                }
            }
        }
        __syncthreads();
        for (int x = tid; x < nr * QP_BN; x += QP_THREADS) {
            const int i = x / QP_BN, col = x - i * QP_BN;
            const int w = w0 + col;
            if (w < qp_mc[i]) {
                const float* pc = Ps + i * G * QP_PS + col;
                float acc = 0.0f;
                for (int g = 0; g < G; ++g) acc += pc[g * QP_PS];
                s_out[((u64)(b0 + i) * hkv + h) * w_stride + w] = acc;
            }
        }
        // No barrier here: every warp read the part tiles before the barrier above, so the
        // next tile may overwrite them, and the P tile is rewritten only after the next
        // tile's first barrier, which every warp reaches after this sum.
    }
}

extern "C" __global__ __launch_bounds__(QP_THREADS, 2) void qa_prefill_scores_d64(
    const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens,
    float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) {
    qa_prefill_scores_impl<64, 3>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride, stride, ksize, scale);
}

extern "C" __global__ __launch_bounds__(QP_THREADS, 2) void qa_prefill_scores_d80(
    const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens,
    float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) {
    qa_prefill_scores_impl<80, 3>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride, stride, ksize, scale);
}

extern "C" __global__ __launch_bounds__(QP_THREADS, 2) void qa_prefill_scores_d128(
    const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens,
    float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) {
    qa_prefill_scores_impl<128, 3>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride, stride, ksize, scale);
}

extern "C" __global__ __launch_bounds__(QP_THREADS, 2) void qa_prefill_scores_bf16x2_d64(
    const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens,
    float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) {
    qa_prefill_scores_impl<64, 2>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride, stride, ksize, scale);
}

extern "C" __global__ __launch_bounds__(QP_THREADS, 2) void qa_prefill_scores_bf16x2_d80(
    const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens,
    float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) {
    qa_prefill_scores_impl<80, 2>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride, stride, ksize, scale);
}

extern "C" __global__ __launch_bounds__(QP_THREADS, 2) void qa_prefill_scores_bf16x2_d128(
    const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens,
    float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) {
    qa_prefill_scores_impl<128, 2>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride, stride, ksize, scale);
}

// ---------------------------------------------------------------------------------------------
// qa_prefill_scores_m32_g<G>_d*: the same scores for G of 4, 8 and 16, with 32 M-rows per
// warp. Warp w holds two A tiles of Q (block M-rows 32*(w%4) .. +15 and +16 .. +31) and takes
// half of every 64-window tile (windows 32*(w/4) .. +31 of it): it multiplies both A tiles by every B
// fragment it reads from a Kc part tile, so the shared-memory bytes ldmatrix reads per product
// are half those of the kernel above (where each of 8 warps reads all NP part tiles of every
// tile: 384 KB per tile of a block at D = 128, about what the SM's shared memory delivers in the
// time of its mma.sync products). The block stays at 128 M-rows and 8 warps, so the Kc bytes
// read from L2 and split per M-row, and the warps per SM, are unchanged. Pass 1 keeps each
// warp's running maximum and sum of exp over its half of the windows; the two warps of a pair
// merge them through shared memory before pass 2. A row's G query heads lie in one A tile (G
// divides 16: M-rows m = i*G + g, 16 | 32*(w%4) + 16a), in fragment rows lane/4 + 8k with the
// same (lane/4 + 8k) / G: pass 2 sums them by shuffles, with no shared P tile, and one lane
// writes each (row, window) sum (with QP_TREE_SUM at G = 16 and 8, every lane one or two). Tiles
// and parts are the kernel above's, the masking too except on fully visible tiles (QP_FULL_TILES);
// the exponent in base 2 (QP_FAST_EXP below); the sums of exp and over heads add in other orders.
//
// Grid (ceil(rows / (128 / G)), hkv); block QP_M32_THREADS threads; dynamic shared memory
// qa_prefill_m32_smem_bytes(D, parts, split) (src/cuda/ops/prefill_scores.rs: NP*64*(D+8)*2 bytes,
// the part tiles, twice for the m32s entry points; the pairs' statistics reuse them between the
// passes).

// QP_FAST_EXP (1 unless set to 0 through SPARDA_NVRTC_OPTIONS=-DQP_FAST_EXP=0): the m32 kernels'
// softmax in base 2, the logits scaled by log2(e)/sqrt(D) and exp as ex2.approx.ftz (one SFU
// instruction; expf adds a range reduction of several instructions), the same P up to the
// rounding of the two. 5.7 % faster sparse prefill at 127K than expf with two Kc parts (README,
// prefill section); the select group and gpu-check-e2e pass with either.
#ifndef QP_FAST_EXP
#define QP_FAST_EXP 1
#endif
#if QP_FAST_EXP
#define qp_exp(x) ex2_ftz(x)
#define QP_LOGIT_SCALE(scale) ((scale) * 1.4426950408889634f)
#else
#define qp_exp(x) expf(x)
#define QP_LOGIT_SCALE(scale) (scale)
#endif

// QP_FULL_TILES (1 unless set to 0 through SPARDA_NVRTC_OPTIONS=-DQP_FULL_TILES=0): the m32
// kernels skip the per-window masking of a tile every row of the block sees whole (w0 + 64 <=
// the least Mc of the block's rows: all but the last tile or two of a prefill chunk), and in pass
// 2 the test of each logit against -inf there. Either way the logits stay unscaled until the
// exponent, taken as qp_exp(fma(s, lscale, -M * lscale)) (one rounding, not two).
#ifndef QP_FULL_TILES
#define QP_FULL_TILES 1
#endif

// QP_TREE_SUM (1 unless set to 0 through SPARDA_NVRTC_OPTIONS=-DQP_TREE_SUM=0): at G = 16 and 8,
// pass 2 sums each A tile's eight (window) columns over the eight lane groups by a transposing tree
// (at G = 8 one tree per fragment row, each a block row of its own):
// at each of the three shuffle steps a lane keeps half its columns and sends the other half to
// its partner, so 4 + 2 + 1 shuffles (and adds) give every lane the total of one column, where
// the sum of every column over all eight groups takes 3 x 8; then each lane writes its column
// (one or two stores a lane instead of eight, sixteen at G = 8, from one lane in eight). The same
// sums in another order; sparse prefill at 127K 0.7 to 0.8 % faster than with 0 on an H100
// (README, prefill section).
#ifndef QP_TREE_SUM
#define QP_TREE_SUM 1
#endif

// Pass 1's online softmax statistics of fragment row k (lane/4 + 8k) over one tile's unscaled
// logits s[c][2k + e] (NC chunks of 8 windows, this lane's 2 of each): the row's maximum over
// its four lanes (kept equal over them) raised to the tile's, and this lane's share of the sum
// of qp_exp((x - max) * lscale) rescaled to it; a row with only -inf so far stays (-inf, 0).
// Shared by the m32 kernels (per A tile, NC 4) and the wgmma kernel (NC 8).
template <int NC>
__device__ __forceinline__ void qp_online_row(const float (&s)[NC][4], int k, float& mr, float& lr,
                                              float lscale) {
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < NC; ++c) mx = fmaxf(mx, fmaxf(s[c][2 * k], s[c][2 * k + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
    const float mn = fmaxf(mr, mx);
    if (mn != -INFINITY) {
        const float nm = -mn * lscale;
        float l = mr != -INFINITY ? lr * qp_exp(fmaf(mr, lscale, nm)) : 0.0f;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            l += qp_exp(fmaf(s[c][2 * k], lscale, nm));
            l += qp_exp(fmaf(s[c][2 * k + 1], lscale, nm));
        }
        lr = l;
        mr = mn;
    }
}

#define QP_M32_WARPS 8
#define QP_M32_THREADS (32 * QP_M32_WARPS)

// s[a] += Q.Kc^T for the warp's two A tiles qa[a] against 32 rows of Kc part rows in shared
// memory (`ks` this lane's ldmatrix address of the first of them: as mma_qk_tile64 on half a
// tile, each B fragment used by both A tiles); s[a][c] holds Kc rows 8c .. 8c+7.
template <int NK, int RS>
__device__ __forceinline__ void mma_qk_tile32_m32(float (&s)[2][4][4], const u32 (&qa)[2][NK][4], u32 ks) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
            u32 b[4];
            ldsm_x4_at(b, ks + (nb * 16 * RS + kk * 16) * 2);
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                mma_bf16(s[a][2 * nb], qa[a][kk], b[0], b[1]);
                mma_bf16(s[a][2 * nb + 1], qa[a][kk], b[2], b[3]);
            }
        }
    }
}

// SPLIT: the Kc part tiles come from `parts` (qa_split_kc's bf16 parts, [hkv][3][p_stride][D])
// by cp.async, two tiles in flight (the next tile's copies run during this tile's products),
// instead of being read as f32 through registers and split by the block (kc, not read then).
// NP: the Kc parts summed, 3 (exact) or 2 (hi and mid only: each Kc value within 2^-16 of
// itself, as the bf16x2 kernels above; a third fewer products).
template <int D, int G, bool SPLIT, int NP>
__device__ __forceinline__ void qa_prefill_scores_m32_impl(const bf16_t* __restrict__ q, int q_stride,
                                                           const float* __restrict__ kc, const int* __restrict__ lens,
                                                           float* __restrict__ s_out, int rows, int H, int hkv,
                                                           int w_stride, int stride, int ksize, float scale,
                                                           const bf16_t* __restrict__ parts, int p_stride) {
    static_assert(NP == 2 || NP == 3, "two or three Kc parts");
    constexpr int RS = D + QP_PAD;
    constexpr int NK = D / 16;
    constexpr int PART = QP_BN * RS;
    extern __shared__ __align__(16) unsigned char qp_sh[];
    __shared__ int qp_mc[QP_BM];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wr = warp & 3, hf = warp >> 2;  // M-rows 32*wr .. 32*wr+31, windows 32*hf .. of a tile
    static_assert(G >= 1 && 16 % G == 0, "a row's heads in one A tile");
    const int h = blockIdx.y;  // H = G * hkv (the launcher's contract)
    const int R = QP_BM / G;
    const int b0 = blockIdx.x * R;
    const int nr = min(R, rows - b0);
    if (nr <= 0) return;  // uniform over the block
    int mc_max, mc_min;
    qp_block_mc<QP_M32_THREADS>(qp_mc, lens, b0, nr, stride, ksize, mc_max, mc_min);
    if (mc_max == 0) return;  // uniform: no row has a window yet
    // Tiles t < full_tiles every row sees whole (past-the-rows M-rows have Q = 0: finite logits,
    // never written).
    const int full_tiles = QP_FULL_TILES ? mc_min / QP_BN : 0;

    // Fragment row lane/4 + 8k of A tile a: block M-row 32*wr + 16a + lane/4 + 8k, block row
    // (M-row) / G, and that row's Mc (0 past the block's rows).
    int mcr[2][2];
    u32 qa[2][NK][4];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const bf16_t* qr[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int m = wr * 32 + a * 16 + (lane >> 2) + 8 * k;
            const int i = m / G;
            if (i < nr) {
                mcr[a][k] = qp_mc[i];
                qr[k] = q + (u64)(b0 + i) * q_stride + (u64)(h * G + (m - i * G)) * D;
            } else {
                mcr[a][k] = 0;
                qr[k] = nullptr;
            }
        }
        qp_q_frags<NK>(qa[a], qr[0], qr[1], lane);
    }

    bf16_t* Ks = (bf16_t*)qp_sh;  // [SPLIT ? 2 : 1][NP][QP_BN][RS]: hi, mid (, lo)
    const u32 ks_lane = smem_addr(Ks + ldsm_k_lane(lane, RS) + hf * 32 * RS);
    const u64 kc_row = (u64)hkv * D;
    const float* Kh = kc + (u64)h * D;
    const int ntiles = (mc_max + QP_BN - 1) / QP_BN;
    // SPLIT: the NP part tiles of windows w0 .. w0+63 into buffer buf by cp.async (16-byte
    // chunks, thread tid takes chunks tid + i*THREADS; windows >= mc_max zero-filled), one group.
    const bf16_t* Ph = parts + (u64)h * 3 * p_stride * D;  // qa_split_kc's three parts per head
    const u32 ks_base = smem_addr(Ks);
    auto issue_tile = [&](int w0, int buf) {
        constexpr int CH = D / 8;  // 16-byte chunks per row
        if constexpr (QP_M32_THREADS % CH == 0) {
            // thread tid: column chunk tid % CH of rows tid / CH + j * RSTEP of each part
            constexpr int RSTEP = QP_M32_THREADS / CH;
            const int c = tid % CH, row0 = tid / CH;
            const bf16_t* src0 = Ph + (u64)(w0 + row0) * D + c * 8;
            const u32 dst0 = ks_base + ((buf * NP) * PART + row0 * RS + c * 8) * 2;
#pragma unroll
            for (int p = 0; p < NP; ++p)
#pragma unroll
                for (int j = 0; j < QP_BN / RSTEP; ++j) {
                    const bool ok = w0 + row0 + j * RSTEP < mc_max;
                    cp_async16_at(dst0 + (p * PART + j * RSTEP * RS) * 2,
                                  ok ? src0 + (u64)p * p_stride * D + j * RSTEP * D : Ph, ok);
                }
        } else {
            constexpr int TOTAL = NP * QP_BN * CH;  // chunks per tile
#pragma unroll 1
            for (int x = tid; x < TOTAL; x += QP_M32_THREADS) {
                const int p = x / (QP_BN * CH), r = x - p * (QP_BN * CH);
                const int row = r / CH, c = r - row * CH;
                const bool ok = w0 + row < mc_max;
                const bf16_t* src = Ph + ((u64)p * p_stride + (ok ? w0 + row : 0)) * D + c * 8;
                cp_async16_at(ks_base + ((buf * NP + p) * PART + row * RS + c * 8) * 2, src, ok);
            }
        }
        cp_async_commit();
    };
    // Tile t's part tiles in shared memory, in buffer t & 1 under SPLIT (the next tile's copies
    // issued first), in the one buffer otherwise; returns the buffer.
    auto stage_tile = [&](int t) -> int {
        if (SPLIT) {
            if (t + 1 < ntiles) issue_tile((t + 1) * QP_BN, (t + 1) & 1);
            else cp_async_commit();  // an empty group: wait_one below then waits for tile t
            cp_async_wait_one();
            return t & 1;
        }
        qp_load_tile<D, NP, QP_M32_THREADS>(Ks, Kh, kc_row, t * QP_BN, mc_max, tid);
        return 0;
    };
    const int cb = (lane & 3) * 2 + 32 * hf;
    const float lscale = QP_LOGIT_SCALE(scale);  // logits in the units of qp_exp

    // S of both A tiles over this warp's half of the tile at w0: s[a][c][2k + e] is fragment
    // row lane/4 + 8k of tile a, window w0 + 32*hf + 8c + 2*(lane%4) + e; unscaled, -inf at
    // windows w >= the row's Mc unless `full` (every row sees the whole tile).
    auto half_logits = [&](int w0, int buf, bool full, float (&s)[2][4][4]) {
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[a][c][0] = s[a][c][1] = s[a][c][2] = s[a][c][3] = 0.0f;
#pragma unroll
        for (int p = 0; p < NP; ++p) mma_qk_tile32_m32<NK, RS>(s, qa, ks_lane + (buf * NP + p) * PART * 2);
        if (full) return;
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int w = w0 + cb + 8 * c + e;
#pragma unroll
                    for (int k = 0; k < 2; ++k)
                        if (w >= mcr[a][k]) s[a][c][2 * k + e] = -INFINITY;
                }
    };

    // Pass 1: running maximum (of the unscaled logits) and this lane's share of the sum of exp
    // per fragment row, over this warp's halves of the tiles.
    float mr[2][2], lr[2][2];
#pragma unroll
    for (int a = 0; a < 2; ++a) mr[a][0] = mr[a][1] = -INFINITY, lr[a][0] = lr[a][1] = 0.0f;
    if (SPLIT) issue_tile(0, 0);
    for (int t = 0; t < ntiles; ++t) {
        const int w0 = t * QP_BN;
        const int buf = stage_tile(t);
        __syncthreads();
        if (w0 + 32 * hf < mc_max) {  // warp-uniform: the last tile's second half may be empty
            float s[2][4][4];
            half_logits(w0, buf, t < full_tiles, s);
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int k = 0; k < 2; ++k) qp_online_row<4>(s[a], k, mr[a][k], lr[a][k], lscale);
        }
        __syncthreads();  // the part tiles are rewritten by the next tile (or the statistics)
    }
    // The row's sum over its four lanes, then the pair's merge: each warp writes its (max, sum)
    // per fragment row into the (now unused) part tiles, reads its partner's, and keeps
    // M = max(m0, m1) (unscaled logits), L = l0 e(m0 - M) + l1 e(m1 - M) with e(x) = qp_exp(x *
    // lscale); 1/L (0 for a row without windows).
    float* st = (float*)qp_sh;  // [2 halves][4 pairs][32 lanes][2 a][2 k][2: max, sum]
    float il[2][2];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            float l = lr[a][k];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            float* o = st + ((((hf * 4 + wr) * 32 + lane) * 2 + a) * 2 + k) * 2;
            o[0] = mr[a][k];
            o[1] = l;
            lr[a][k] = l;
        }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float* o = st + (((((1 - hf) * 4 + wr) * 32 + lane) * 2 + a) * 2 + k) * 2;
            const float m1 = o[0], l1 = o[1], m0 = mr[a][k], l0 = lr[a][k];
            const float mn = fmaxf(m0, m1);
            float l = 0.0f;
            if (mn != -INFINITY) {
                l = (m0 != -INFINITY ? l0 * qp_exp((m0 - mn) * lscale) : 0.0f) +
                    (m1 != -INFINITY ? l1 * qp_exp((m1 - mn) * lscale) : 0.0f);
            }
            mr[a][k] = -mn * lscale;  // pass 2's exponent offset (+inf for a row without windows: only masked logits)
            il[a][k] = l > 0.0f ? 1.0f / l : 0.0f;
        }
    __syncthreads();  // the statistics are read before the first tile of pass 2 overwrites them

    // Pass 2: P in registers, summed over each row's G heads: the heads of fragment row group
    // lane/4 are the lanes that differ in the low log2(min(G, 8)) bits of lane/4, and at G = 16
    // also the two fragment rows k of a lane. In the shuffle sums (G = 4, or QP_TREE_SUM=0) a lane
    // with those bits 0 writes the sum; the tree (G = 16, 8) spreads the stores over every lane.
    constexpr int gl = G < 8 ? G : 8;
    const bool writer = ((lane >> 2) & (gl - 1)) == 0;
    // P of logit x in fragment row k of A tile a (a full tile has no -inf logit and every row's
    // offset is finite, so it skips the test).
    auto p_of = [&](float x, int a, int k, bool full) {
        return full || x != -INFINITY ? qp_exp(fmaf(x, lscale, mr[a][k])) * il[a][k] : 0.0f;
    };
    if (SPLIT) issue_tile(0, 0);
    for (int t = 0; t < ntiles; ++t) {
        const int w0 = t * QP_BN;
        const int buf = stage_tile(t);
        __syncthreads();
        if (w0 + 32 * hf < mc_max) {  // warp-uniform
            const bool full = t < full_tiles;
            float s[2][4][4];
            half_logits(w0, buf, full, s);
            if constexpr ((G == 16 || G == 8) && QP_TREE_SUM) {
                // NS sums a lane ends with: G 16, one (its A tile's row: both fragment rows k);
                // G 8, two (fragment row k is block row 2*(2*wr + a) + k). v[n][2c + e]: sum n's
                // heads of window w0 + cb + 8c + e held by this lane.
                constexpr int NS = G == 16 ? 1 : 2;
                const bool l4 = lane & 16, l3 = lane & 8, l2 = lane & 4;  // lane bits 4, 3, 2
                const int qcol = (lane >> 2) & 7;  // the column this lane ends with
#pragma unroll
                for (int a = 0; a < 2; ++a) {
                    float v[NS][8];
#pragma unroll
                    for (int c = 0; c < 4; ++c)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p0 = p_of(s[a][c][e], a, 0, full), p1 = p_of(s[a][c][2 + e], a, 1, full);
                            if constexpr (NS == 1) {
                                v[0][2 * c + e] = p0 + p1;
                            } else {
                                v[0][2 * c + e] = p0;
                                v[NS - 1][2 * c + e] = p1;
                            }
                        }
#pragma unroll
                    for (int n = 0; n < NS; ++n) {
                        float u[4], x2[2];
#pragma unroll
                        for (int j = 0; j < 4; ++j) {  // keep columns j + 4*l4
                            const float keep = l4 ? v[n][j + 4] : v[n][j], send = l4 ? v[n][j] : v[n][j + 4];
                            u[j] = keep + __shfl_xor_sync(FULL_MASK, send, 16);
                        }
#pragma unroll
                        for (int j = 0; j < 2; ++j) {  // keep columns j + 2*l3 + 4*l4
                            const float keep = l3 ? u[j + 2] : u[j], send = l3 ? u[j] : u[j + 2];
                            x2[j] = keep + __shfl_xor_sync(FULL_MASK, send, 8);
                        }
                        const float keep = l2 ? x2[1] : x2[0], send = l2 ? x2[0] : x2[1];
                        const float tot = keep + __shfl_xor_sync(FULL_MASK, send, 4);  // column qcol
                        const int w = w0 + cb + 8 * (qcol >> 1) + (qcol & 1);
                        const int i = (wr * 32 + a * 16 + 8 * n) / G;  // the sum's block row
                        if (w < mcr[a][n]) s_out[((u64)(b0 + i) * hkv + h) * w_stride + w] = tot;  // (Mc 0 past the rows)
                    }
                }
            } else
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float p0 = p_of(s[a][c][e], a, 0, full), p1 = p_of(s[a][c][2 + e], a, 1, full);
                        if (G == 16) {
                            p0 += p1;
#pragma unroll
                            for (int off = 4; off < 32; off <<= 1) p0 += __shfl_xor_sync(FULL_MASK, p0, off);
                        } else {
#pragma unroll
                            for (int off = 4; off < 4 * gl; off <<= 1) {
                                p0 += __shfl_xor_sync(FULL_MASK, p0, off);
                                p1 += __shfl_xor_sync(FULL_MASK, p1, off);
                            }
                        }
                        const int w = w0 + cb + 8 * c + e;
                        if (writer) {
#pragma unroll
                            for (int k = 0; k < 2; ++k) {
                                const int i = (wr * 32 + a * 16 + (lane >> 2) + 8 * k) / G;
                                if ((k == 0 || G < 16) && w < mcr[a][k])  // (Mc 0 past the rows)
                                    s_out[((u64)(b0 + i) * hkv + h) * w_stride + w] = k == 0 ? p0 : p1;
                            }
                        }
                    }
        }
        __syncthreads();  // every warp has read the part tiles: the next tile may overwrite them
    }
}

// Kc f32 [mc, hkv, D] as the three exact bf16 parts of qp_split2, [hkv][3][p_stride][D] (p_stride
// >= mc): what the SPLIT scoring kernels read, once per chunk instead of once per block and pass.
// One thread per float4; grid-stride loop.
extern "C" __global__ void qa_split_kc(const float* __restrict__ kc, bf16_t* __restrict__ parts, int mc, int hkv,
                                       int D, int p_stride) {
    const int f4 = D / 4;
    const long long total = (long long)mc * hkv * f4;
    for (long long x = (long long)blockIdx.x * blockDim.x + threadIdx.x; x < total;
         x += (long long)gridDim.x * blockDim.x) {
        const int c4 = (int)(x % f4);
        const long long wh = x / f4;
        const int hh = (int)(wh % hkv);
        const long long w = wh / hkv;
        const float4 v = ((const float4*)kc)[x];
        u32 a0, b0, c0, a1, b1, c1;
        qp_split2(v.x, v.y, a0, b0, c0);
        qp_split2(v.z, v.w, a1, b1, c1);
        const u64 o = (((u64)hh * 3) * p_stride + w) * D + c4 * 4;
        const u64 ps = (u64)p_stride * D;
        *(uint2*)(parts + o) = make_uint2(a0, a1);
        *(uint2*)(parts + o + ps) = make_uint2(b0, b1);
        *(uint2*)(parts + o + 2 * ps) = make_uint2(c0, c1);
    }
}

// Entry points qa_prefill_scores_m32{,s,s_bf16x2}_g<G>_d<D>: G a compile-time constant (the row
// of a fragment row, the shuffles and the writing lanes fold into constants; a runtime G spills
// at D = 128 under the 128 registers of 2 blocks per SM), for G 4, 8 and 16; m32s the SPLIT
// kernel (parts from qa_split_kc, two tile buffers in dynamic shared memory), m32s_bf16x2 the
// same on the first two parts.
#define QP_M32_ENTRY(NAME, G, D)                                                                               \
    extern "C" __global__ __launch_bounds__(QP_M32_THREADS, 2) void NAME(                                      \
        const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens, \
        float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale) { \
        qa_prefill_scores_m32_impl<D, G, false, 3>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride,       \
                                                   stride, ksize, scale, nullptr, 0);                          \
    }
#define QP_M32S_ENTRY(NAME, G, D, NP)                                                                          \
    extern "C" __global__ __launch_bounds__(QP_M32_THREADS, 2) void NAME(                                      \
        const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens, \
        float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale,  \
        const bf16_t* __restrict__ parts, int p_stride) {                                                      \
        qa_prefill_scores_m32_impl<D, G, true, NP>(q, q_stride, kc, lens, s_out, rows, H, hkv, w_stride,       \
                                                   stride, ksize, scale, parts, p_stride);                     \
    }
QP_M32_ENTRY(qa_prefill_scores_m32_g4_d64, 4, 64)
QP_M32_ENTRY(qa_prefill_scores_m32_g4_d80, 4, 80)
QP_M32_ENTRY(qa_prefill_scores_m32_g4_d128, 4, 128)
QP_M32_ENTRY(qa_prefill_scores_m32_g8_d64, 8, 64)
QP_M32_ENTRY(qa_prefill_scores_m32_g8_d80, 8, 80)
QP_M32_ENTRY(qa_prefill_scores_m32_g8_d128, 8, 128)
QP_M32_ENTRY(qa_prefill_scores_m32_g16_d64, 16, 64)
QP_M32_ENTRY(qa_prefill_scores_m32_g16_d80, 16, 80)
QP_M32_ENTRY(qa_prefill_scores_m32_g16_d128, 16, 128)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g4_d64, 4, 64, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g4_d80, 4, 80, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g4_d128, 4, 128, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g8_d64, 8, 64, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g8_d80, 8, 80, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g8_d128, 8, 128, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g16_d64, 16, 64, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g16_d80, 16, 80, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_g16_d128, 16, 128, 3)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g4_d64, 4, 64, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g4_d80, 4, 80, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g4_d128, 4, 128, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g8_d64, 8, 64, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g8_d80, 8, 80, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g8_d128, 8, 128, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g16_d64, 16, 64, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g16_d80, 16, 80, 2)
QP_M32S_ENTRY(qa_prefill_scores_m32s_bf16x2_g16_d128, 16, 128, 2)

// qa_prefill_scores_wg_g<G>_d<D> (sm_90a): the scores of the m32s_bf16x2 kernels (Kc's first
// two bf16 parts from qa_split_kc, base-2 softmax, two passes) with S = Q.Kc^T on wgmma. The
// block's 8 warps are two warpgroups of 64 M-rows (warp w: block M-rows 16w .. 16w+15, one A
// tile of Q in registers, as mma.sync A fragments); each warpgroup multiplies its 64 M-rows by
// whole 64-window tiles of Kc (m64n64k16, B from shared memory), so no warp reads B fragments
// through ldmatrix and no pair of warps merges statistics: a warp holds every window of its
// rows. Part tiles in shared memory in a K-major layout wgmma reads: the 128-byte swizzle
// (rows of 64 dims, their 16-byte chunks XORed with the row; with QW_SWIZZLE=0 core matrices
// of 8 windows x 8 dims without swizzle: 128 contiguous bytes, the next 8 dims 128 bytes on,
// the next 8 windows D*16 bytes on), filled by cp.async through QW_STAGES stages, the next
// tiles' copies in flight during this tile's products; fence.proxy.async orders the copies
// before wgmma reads them. Pass 2 sums each row's G heads (G | 16: within one warp's A tile)
// by a transposing shuffle tree over the lanes that hold them, so every lane writes a few
// (row, window) sums. Masking, full tiles and the exponent as the m32 kernels.
//
// Grid (ceil(rows / (128 / G)), hkv); block QW_THREADS threads; dynamic shared memory
// qa_prefill_wg_smem_bytes(D) (src/cuda/ops/prefill_scores.rs: 3 stages x 2 parts x 64 x D x 2
// bytes, QW_STAGES below, and 1,024 bytes of alignment). G 4, 8, 16; D 64 and 128 (whole
// 128-byte swizzle rows; D 80 takes the m32s_bf16x2 kernels). Compiled for another target than
// sm_90a, the entry points trap.
#define QW_THREADS 256
#define QW_NP 2  // Kc parts summed (hi and mid)
// QW_SWIZZLE (1 unless set through SPARDA_NVRTC_OPTIONS=-DQW_SWIZZLE=0): the part tiles in the
// 128-byte swizzle (wg_desc_sw128), so that 8 lanes copy one window's whole 128-byte row (a
// warp's copies touch 4 L2 lines). 0: core matrices without swizzle, 8 L2 lines per warp; Nsight
// Compute put that layout at 79 % of the L2's throughput (28 M requests for 29 M sectors,
// against 42 % for the mma.sync kernel), and it ran synthetic NOSA-8B sparse prefill at 127K at
// 16,585 tokens/s against 18,891 / 18,846 with the swizzle on an H100 (08fe5fa).
#ifndef QW_SWIZZLE
#define QW_SWIZZLE 1
#endif
// QW_STAGES (3 unless set through SPARDA_NVRTC_OPTIONS=-DQW_STAGES=2): shared-memory stages of
// the part tiles, one block barrier per tile; the copies of tile t + QW_STAGES - 1 are issued
// after the barrier of tile t, into the stage every warp finished at tile t - 1. The host
// sizes shared memory for 3 (qa_prefill_wg_smem_bytes); 2 uses two thirds of it.
#ifndef QW_STAGES
#define QW_STAGES 3
#endif
#if QW_STAGES != 2 && QW_STAGES != 3
#error "QW_STAGES takes 2 or 3"
#endif

// One step of the transposing sum over the lanes that differ in lane bit `m`: of this lane's
// first N values it keeps the half its bit selects (upper half when set), adds its partner's
// copy of that half and leaves the sums in v[0 .. N/2).
template <int N>
__device__ __forceinline__ void qw_tree_step(float (&v)[16], int lane, int m) {
    constexpr int HALF = N / 2;
    const bool up = lane & m;
#pragma unroll
    for (int j = 0; j < HALF; ++j) {
        const float keep = up ? v[j + HALF] : v[j], send = up ? v[j] : v[j + HALF];
        v[j] = keep + __shfl_xor_sync(FULL_MASK, send, m);
    }
}

template <int D, int G>
__device__ __forceinline__ void qa_prefill_scores_wg_impl(const bf16_t* __restrict__ q, int q_stride,
                                                          const int* __restrict__ lens, float* __restrict__ s_out,
                                                          int rows, int hkv, int w_stride, int stride, int ksize,
                                                          float scale, const bf16_t* __restrict__ parts,
                                                          int p_stride) {
    static_assert(G == 4 || G == 8 || G == 16, "a row's heads in one warp's A tile, trees below");
    static_assert(D == 64 || D == 128, "whole 128-byte swizzle rows; whole 8-window groups per copy pass");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int NK = D / 16;             // k-steps of S = Q.Kc^T
    constexpr int CH = D / 8;              // core matrices (16-byte chunks) per window row
    constexpr int SBO = CH * 128;          // bytes between 8-window core-matrix rows
    constexpr int PART_B = QP_BN * D * 2;  // bytes per part tile
    // QW_SWIZZLE: the 128-byte swizzle (K atoms of 8 windows x 64 dims, 1,024 bytes; chunk c of
    // window row r at 16 * (c ^ (r % 8)); the 8-window groups of one K atom 1,024 bytes apart,
    // the K atoms of a part tile KATOM_B apart); otherwise no swizzle.
    constexpr bool SW = QW_SWIZZLE;
    constexpr int KATOMS = D / 64;
    constexpr int KATOM_B = QP_BN * 128;
    extern __shared__ __align__(128) unsigned char qp_sh[];
    __shared__ int qp_mc[QP_BM];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y;
    const int R = QP_BM / G;
    const int b0 = blockIdx.x * R;
    const int nr = min(R, rows - b0);
    if (nr <= 0) return;  // uniform over the block
    int mc_max, mc_min;
    qp_block_mc<QW_THREADS>(qp_mc, lens, b0, nr, stride, ksize, mc_max, mc_min);
    if (mc_max == 0) return;  // uniform
    const int full_tiles = QP_FULL_TILES ? mc_min / QP_BN : 0;

    // Fragment row lane/4 + 8k: block M-row 16*warp + lane/4 + 8k, block row (M-row) / G and
    // its Mc (0 past the block's rows, whose Q is 0).
    int mcr[2];
    u32 qa[NK][4];
    {
        const bf16_t* qr[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int m = warp * 16 + (lane >> 2) + 8 * k;
            const int i = m / G;
            if (i < nr) {
                mcr[k] = qp_mc[i];
                qr[k] = q + (u64)(b0 + i) * q_stride + (u64)(h * G + (m - i * G)) * D;
            } else {
                mcr[k] = 0;
                qr[k] = nullptr;
            }
        }
        qp_q_frags<NK>(qa, qr[0], qr[1], lane);
    }

    // The stages from the first 1,024-byte boundary (the swizzle atoms' alignment; the host
    // adds 1,024 bytes for it).
    const u32 sh = (smem_addr(qp_sh) + 1023u) & ~1023u;
    const bf16_t* Ph = parts + (u64)h * 3 * p_stride * D;
    const int ntiles = (mc_max + QP_BN - 1) / QP_BN;
    // The two part tiles of windows w0 .. w0+63 into buffer buf (windows >= mc_max zero-filled),
    // one cp.async group.
    auto issue_tile = [&](int w0, int buf) {
        if constexpr (SW) {
            // 128-byte swizzle: 8 lanes copy the 8 chunks of one window's 128-byte
            // row of a K atom (one L2 line; the XOR puts them in 8 different bank groups), a warp
            // 4 windows; each thread keeps one (chunk, window) and steps by constant offsets.
            constexpr int RP = QW_THREADS / 8;  // windows per pass
            const int cc = tid & 7, wq = tid >> 3;
            const bf16_t* src = Ph + (u64)(w0 + wq) * D + cc * 8;
            const u32 dst = sh + buf * QW_NP * PART_B + (wq >> 3) * 1024 + (wq & 7) * 128 + ((cc ^ (wq & 7)) * 16);
#pragma unroll
            for (int p = 0; p < QW_NP; ++p)
#pragma unroll
                for (int ka = 0; ka < KATOMS; ++ka)
#pragma unroll
                    for (int j = 0; j < QP_BN / RP; ++j) {
                        const bool ok = w0 + wq + RP * j < mc_max;
                        cp_async16_at(dst + p * PART_B + ka * KATOM_B + j * (RP / 8) * 1024,
                                      ok ? src + (u64)p * p_stride * D + (u64)RP * j * D + ka * 64 : Ph, ok);
                    }
        } else {
            // without swizzle: lanes pair the two dims chunks of a core-matrix pair over 8
            // windows (16 lanes fill 256 contiguous shared bytes and read 32 bytes of each of 8
            // window rows); the threads cover whole 8-window groups, so each thread keeps one
            // (dims chunk, window) and steps by constant offsets
            constexpr int GP = QW_THREADS / (8 * CH);  // 8-window groups per pass
            const int y = tid % (8 * CH), g0 = tid / (8 * CH);
            const int c = (y & 1) + 2 * (y >> 4), w = ((y >> 1) & 7) + 8 * g0;
            const bf16_t* src = Ph + (u64)(w0 + w) * D + c * 8;
            const u32 dst = sh + buf * QW_NP * PART_B + g0 * SBO + c * 128 + (y >> 1 & 7) * 16;
#pragma unroll
            for (int p = 0; p < QW_NP; ++p)
#pragma unroll
                for (int j = 0; j < QP_BN / (8 * GP); ++j) {
                    const bool ok = w0 + w + 8 * GP * j < mc_max;
                    cp_async16_at(dst + p * PART_B + GP * j * SBO,
                                  ok ? src + (u64)p * p_stride * D + 8 * GP * j * D : Ph, ok);
                }
        }
        cp_async_commit();
    };
    // The first QW_STAGES - 1 tiles of a pass in flight, one copy group each (empty past the
    // last tile, so that "at most QW_STAGES - 2 pending" means the next tile has landed).
    auto prologue = [&]() {
#pragma unroll
        for (int t = 0; t < QW_STAGES - 1; ++t) {
            if (t < ntiles) issue_tile(t * QP_BN, t);
            else cp_async_commit();
        }
    };
    // Tile t (in stage `st` = t % QW_STAGES) resident and visible to wgmma for the whole
    // block, and tile t + QW_STAGES - 1's copies issued into the stage tile t - 1 used, which
    // every warp finished before this barrier.
    auto stage_tile = [&](int t, int st) {
        cp_async_wait_n<QW_STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        const int tn = t + QW_STAGES - 1;
        if (tn < ntiles) issue_tile(tn * QP_BN, st == 0 ? QW_STAGES - 1 : st - 1);
        else cp_async_commit();
    };
    const int cb = (lane & 3) * 2;
    const float lscale = QP_LOGIT_SCALE(scale);

    // S of this warp's 16 M-rows over the tile at w0 in buffer buf: s[c][2k + e] is fragment row
    // lane/4 + 8k, window w0 + 8c + cb + e; unscaled, -inf at windows >= the row's Mc unless
    // `full`.
    auto tile_logits = [&](int w0, int buf, bool full, float (&s)[8][4]) {
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int j = 0; j < 4; ++j) wg_pin(s[c][j]);
        wg_fence();
#pragma unroll
        for (int p = 0; p < QW_NP; ++p)
#pragma unroll
            for (int kk = 0; kk < NK; ++kk)
                wg_m64n64k16_rs(s, qa[kk],
                                SW ? wg_desc_sw128(sh + (buf * QW_NP + p) * PART_B + (kk >> 2) * KATOM_B +
                                                   (kk & 3) * 32)
                                   : wg_desc(sh + (buf * QW_NP + p) * PART_B + kk * 256, 128, SBO),
                                p + kk > 0);
        wg_commit();
        wg_wait<0>();
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int j = 0; j < 4; ++j) wg_pin(s[c][j]);
        if (full) return;
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int w = w0 + 8 * c + cb + e;
#pragma unroll
                for (int k = 0; k < 2; ++k)
                    if (w >= mcr[k]) s[c][2 * k + e] = -INFINITY;
            }
    };

    // Pass 1: running maximum (unscaled) and this lane's share of the sum of exp per fragment row.
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f};
    prologue();
    for (int t = 0, buf = 0; t < ntiles; ++t, buf = buf + 1 == QW_STAGES ? 0 : buf + 1) {
        const int w0 = t * QP_BN;
        stage_tile(t, buf);
        float s[8][4];
        tile_logits(w0, buf, t < full_tiles, s);
#pragma unroll
        for (int k = 0; k < 2; ++k) qp_online_row<8>(s, k, mr[k], lr[k], lscale);
    }
    cp_async_wait_n<0>();
    __syncthreads();  // every warp is done with pass 1's stages before pass 2's copies
    // The row's sum over its four lanes; pass 2's exponent offset and 1/L (0 without windows).
    float il[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        float l = lr[k];
        l += __shfl_xor_sync(FULL_MASK, l, 1);
        l += __shfl_xor_sync(FULL_MASK, l, 2);
        il[k] = l > 0.0f ? 1.0f / l : 0.0f;
        mr[k] = -mr[k] * lscale;
    }

    // Pass 2: P summed over each row's G heads. G 16: a row is the warp's 16 M-rows (both
    // fragment rows, lane bits 2-4); G 8: fragment row k is block row 2*warp + k (lane bits
    // 2-4); G 4: block row 4*warp + 2k + lane bit 4 (lane bits 2-3). After the tree a lane holds
    // NV consecutive columns j = 2c + e from `base` of its row's sum.
    constexpr int NT = G == 16 ? 1 : 2;  // trees per lane (rows it ends with)
    constexpr int NV = G == 4 ? 4 : 2;
    const int base = G == 4 ? 4 * ((lane >> 2) & 3) : 2 * ((lane >> 2) & 7);
    prologue();
    for (int t = 0, buf = 0; t < ntiles; ++t, buf = buf + 1 == QW_STAGES ? 0 : buf + 1) {
        const int w0 = t * QP_BN;
        stage_tile(t, buf);
        const bool full = t < full_tiles;
        float s[8][4];
        tile_logits(w0, buf, full, s);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float v[16];
#pragma unroll
            for (int c = 0; c < 8; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = 0.0f;
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        if (NT == 2 && k != n) continue;
                        const float y = s[c][2 * k + e];
                        x += full || y != -INFINITY ? qp_exp(fmaf(y, lscale, mr[k])) * il[k] : 0.0f;
                    }
                    v[2 * c + e] = x;
                }
            if constexpr (G == 4) {
                qw_tree_step<16>(v, lane, 8);
                qw_tree_step<8>(v, lane, 4);
            } else {
                qw_tree_step<16>(v, lane, 16);
                qw_tree_step<8>(v, lane, 8);
                qw_tree_step<4>(v, lane, 4);
            }
            const int i = G == 16 ? warp : G == 8 ? 2 * warp + n : 4 * warp + 2 * n + ((lane >> 4) & 1);
            const int mc = mcr[n];  // this lane's fragment row n lies in row i (G 16: both do)
            float* o = s_out + ((u64)(b0 + i) * hkv + h) * w_stride;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int jj = base + j;
                const int w = w0 + 8 * (jj >> 1) + cb + (jj & 1);
                if (w < mc) o[w] = v[j];  // (Mc 0 past the rows)
            }
        }
    }
#else
    __trap();
#endif
}

#define QW_ENTRY(NAME, G, D)                                                                                    \
    extern "C" __global__ __launch_bounds__(QW_THREADS, 2) void NAME(                                          \
        const bf16_t* __restrict__ q, int q_stride, const float* __restrict__ kc, const int* __restrict__ lens, \
        float* __restrict__ s_out, int rows, int H, int hkv, int w_stride, int stride, int ksize, float scale,  \
        const bf16_t* __restrict__ parts, int p_stride) {                                                      \
        qa_prefill_scores_wg_impl<D, G>(q, q_stride, lens, s_out, rows, hkv, w_stride, stride, ksize, scale,   \
                                        parts, p_stride);                                                      \
    }
QW_ENTRY(qa_prefill_scores_wg_g4_d64, 4, 64)
QW_ENTRY(qa_prefill_scores_wg_g4_d128, 4, 128)
QW_ENTRY(qa_prefill_scores_wg_g8_d64, 8, 64)
QW_ENTRY(qa_prefill_scores_wg_g8_d128, 8, 128)
QW_ENTRY(qa_prefill_scores_wg_g16_d64, 16, 64)
QW_ENTRY(qa_prefill_scores_wg_g16_d128, 16, 128)

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
// QP_THREADS threads; dynamic shared memory qa_prefill_smem_bytes(D, NP) (src/cuda/ops/select.rs:
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
    constexpr int F4 = D / 4;       // float4 per Kc row
    constexpr int PART = QP_BN * RS;  // bf16 elements per part tile
    extern __shared__ __align__(16) unsigned char qp_sh[];
    __shared__ int qp_mc[QP_BM];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y, G = H / hkv;
    const int R = QP_BM / G;  // block rows
    const int b0 = blockIdx.x * R;
    const int nr = min(R, rows - b0);
    if (nr <= 0) return;  // uniform over the block
    for (int i = tid; i < nr; i += QP_THREADS) qp_mc[i] = sel_windows(lens[b0 + i], stride, ksize);
    __syncthreads();
    int mc_max = 0;
    for (int i = 0; i < nr; ++i) mc_max = max(mc_max, qp_mc[i]);
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
        // Q fragments (A operand, row-major 16 x 16 per k-step): rows lane/4 (+8), columns
        // 2*(lane%4) (+1) and +8 of each k-step.
        const int qc = (lane & 3) * 2;
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
            const int c0 = kk * 16 + qc;
            qa[kk][0] = qr[0] != nullptr ? *(const u32*)(qr[0] + c0) : 0u;
            qa[kk][1] = qr[1] != nullptr ? *(const u32*)(qr[1] + c0) : 0u;
            qa[kk][2] = qr[0] != nullptr ? *(const u32*)(qr[0] + c0 + 8) : 0u;
            qa[kk][3] = qr[1] != nullptr ? *(const u32*)(qr[1] + c0 + 8) : 0u;
        }
    }

    bf16_t* Ks = (bf16_t*)qp_sh;           // [NP][QP_BN][RS]: hi, mid (, lo)
    float* Ps = (float*)(Ks + NP * PART);  // [QP_BM][QP_PS]
    const u32 ks_lane = smem_addr(Ks + ldsm_k_lane(lane, RS));
    const u64 kc_row = (u64)hkv * D;       // f32 elements per window of Kc
    const float* Kh = kc + (u64)h * D;
    const int ntiles = (mc_max + QP_BN - 1) / QP_BN;

    // Kc windows w0 .. w0+63 of head h into the three part tiles (windows >= mc_max as 0).
    // Thread tid takes float4 chunks tid + i*QP_THREADS (row x / F4, column chunk x % F4); the
    // loads of a batch are all issued before the first is used, so a tile costs about one
    // L2 latency per batch instead of one per chunk.
    constexpr int LD_ITERS = QP_BN * F4 / QP_THREADS;  // 4, 5, 8 for D = 64, 80, 128
    static_assert(QP_BN * F4 % QP_THREADS == 0, "whole load passes");
    constexpr int LD_BATCH = LD_ITERS >= 10 ? LD_ITERS / 2 : LD_ITERS;
    static_assert(LD_ITERS % LD_BATCH == 0, "whole load batches");
    auto load_tile = [&](int w0) {
#pragma unroll
        for (int i0 = 0; i0 < LD_ITERS; i0 += LD_BATCH) {
            float4 v[LD_BATCH];
#pragma unroll
            for (int j = 0; j < LD_BATCH; ++j) {
                const int x = tid + (i0 + j) * QP_THREADS;
                const int row = x / F4, c4 = x - row * F4;
                v[j] = w0 + row < mc_max ? *(const float4*)(Kh + (u64)(w0 + row) * kc_row + c4 * 4)
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int j = 0; j < LD_BATCH; ++j) {
                const int x = tid + (i0 + j) * QP_THREADS;
                const int row = x / F4, c4 = x - row * F4;
                u32 a0, b0_, c0, a1, b1, c1;
                qp_split2(v[j].x, v[j].y, a0, b0_, c0);
                qp_split2(v[j].z, v[j].w, a1, b1, c1);
                const int o = row * RS + c4 * 4;
                *(uint2*)(Ks + o) = make_uint2(a0, a1);
                *(uint2*)(Ks + PART + o) = make_uint2(b0_, b1);
                if (NP == 3) *(uint2*)(Ks + 2 * PART + o) = make_uint2(c0, c1);
            }
        }
    };
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

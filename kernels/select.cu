// Decode-time block selection (nosa-model.md §3-§4): query-aware window scores,
// block pooling, forced blocks, query-aware shortlist and top-S, one query token
// per sequence (position t = T-1), per (sequence, KV head).
//
// Shared conventions:
//   lens[b] = T (tokens of sequence b, the current one included);
//   Mc(T) = (T-ksize)/stride + 1 windows for T >= ksize, else 0 (common.cuh sel_windows);
//   kcptr[b] -> f32 Kc [cap, hkv, D]; pptr[b] -> f32 p [cap, hkv];
//   q: bf16, sequence b's H*D query values at b*q_stride, query head g of KV head h at
//      (h*G + g)*D (G = H/hkv);
//   window-score workspaces are per (b, h) rows of w_stride entries.

#define QA_TILE 64   // windows per thread block in the scoring kernels


// Step 1a: logits[b, h, g, w] = (q_g . Kc[w, h]) * scale for the windows w of tile
// blockIdx.x, plus the tile's softmax statistics per query head:
// stats[((b*hkv + h)*G + g)*ntiles + tile] = (max, sum exp(logit - max)), (-inf, 0) when empty.
// Grid (tiles, hkv, B), QA_THREADS (src/cuda/ops/select.rs: 256) threads, a multiple of QA_TILE;
// dynamic shared memory qa_logits_smem_bytes(G, D) (src/cuda/ops/select.rs: the same layout).
//
// Each Kc row of the tile is read from device memory once (16-byte loads, all issued before
// the first use) into shared memory and used there for all G query heads of its KV head:
// thread (wi, gq) computes window wi's logits for query heads gq*QA_HPT + j (+ k*QA_HPT*nq),
// QA_HPT heads at a time in registers, reading Kc and q as float4 from shared memory (q
// reads are warp broadcasts; Kc rows are padded by 4 floats so a quarter-warp's 16-byte
// reads hit distinct banks).
#define QA_HPT 4  // query heads per thread per pass
__device__ __forceinline__ int qa_dpad(int D) { return (D + 3) & ~3; }
extern "C" __global__ void qa_window_logits(const bf16_t* __restrict__ q, int q_stride,
                                            const u64* __restrict__ kcptr, const int* __restrict__ lens,
                                            float* __restrict__ logits, float* __restrict__ stats, int H, int hkv,
                                            int D, int w_stride, int ntiles, int stride, int ksize, float scale) {
    extern __shared__ __align__(16) float qa_sh[];
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int G = H / hkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int Dp = qa_dpad(D), KS = Dp + 4;
    float* sq = qa_sh;               // [G, Dp], zero past D
    float* sk = sq + G * Dp;         // [QA_TILE, KS], zero past D and past Mc
    float* slg = sk + QA_TILE * KS;  // [G, QA_TILE]
    const int Mc = sel_windows(lens[b], stride, ksize);
    const int w0 = tile * QA_TILE;
    const u64 row = (u64)b * hkv + h;
    // Tiles past this row's windows are never read (qa_window_scores reads the first
    // ceil(Mc/QA_TILE) tiles): the launch may size its grid by a capacity.
    if (w0 >= Mc) return;  // uniform over the block
    const int nwin = min(QA_TILE, Mc - w0);
    const int kvd = hkv * D;
    const float* Kc = (const float*)kcptr[b] + (u64)w0 * kvd + (u64)h * D;
    // Kc tile -> shared memory.
    if ((D & 3) == 0 && (((u64)Kc) & 15u) == 0 && ((kvd & 3) == 0)) {
        const int D4 = D >> 2, n4 = QA_TILE * D4;
        for (int base = tid; base < n4; base += 8 * blockDim.x) {
            float4 v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int i = base + k * blockDim.x;
                const int r = i / D4, c = i - r * D4;
                v[k] = (i < n4 && r < nwin) ? __ldg((const float4*)(Kc + (u64)r * kvd) + c)
                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int i = base + k * blockDim.x;
                const int r = i / D4, c = i - r * D4;
                if (i < n4) *(float4*)(sk + r * KS + 4 * c) = v[k];
            }
        }
    } else {
        for (int i = tid; i < QA_TILE * Dp; i += blockDim.x) {
            const int r = i / Dp, c = i - r * Dp;
            sk[r * KS + c] = (r < nwin && c < D) ? Kc[(u64)r * kvd + c] : 0.0f;
        }
    }
    {
        const bf16_t* qb = q + (u64)b * q_stride + (u64)h * G * D;
        for (int i = tid; i < G * Dp; i += blockDim.x) {
            const int g = i / Dp, c = i - g * Dp;
            sq[i] = c < D ? bf2f(qb[g * D + c]) : 0.0f;
        }
    }
    __syncthreads();
    const int nq = blockDim.x / QA_TILE;  // head groups (blockDim a multiple of QA_TILE)
    const int wi = tid % QA_TILE, gq = tid / QA_TILE;
    const int w = w0 + wi;
    const float* kr = sk + wi * KS;
    for (int g0 = gq * QA_HPT; g0 < G; g0 += nq * QA_HPT) {
        float acc[QA_HPT];
#pragma unroll
        for (int j = 0; j < QA_HPT; ++j) acc[j] = 0.0f;
        const float* qr = sq + g0 * Dp;
        if (g0 + QA_HPT <= G) {
#pragma unroll 4
            for (int d = 0; d < Dp; d += 4) {
                const float4 kv = *(const float4*)(kr + d);
#pragma unroll
                for (int j = 0; j < QA_HPT; ++j) {
                    const float4 qv = *(const float4*)(qr + j * Dp + d);
                    acc[j] = fmaf(kv.x, qv.x, acc[j]);
                    acc[j] = fmaf(kv.y, qv.y, acc[j]);
                    acc[j] = fmaf(kv.z, qv.z, acc[j]);
                    acc[j] = fmaf(kv.w, qv.w, acc[j]);
                }
            }
        } else {
            for (int d = 0; d < Dp; d += 4) {
                const float4 kv = *(const float4*)(kr + d);
#pragma unroll
                for (int j = 0; j < QA_HPT; ++j) {
                    if (g0 + j < G) {
                        const float4 qv = *(const float4*)(qr + j * Dp + d);
                        acc[j] = fmaf(kv.x, qv.x, acc[j]);
                        acc[j] = fmaf(kv.y, qv.y, acc[j]);
                        acc[j] = fmaf(kv.z, qv.z, acc[j]);
                        acc[j] = fmaf(kv.w, qv.w, acc[j]);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < QA_HPT; ++j) {
            const int g = g0 + j;
            if (g < G) {
                const float s = acc[j] * scale;
                if (wi < nwin) {
                    slg[g * QA_TILE + wi] = s;
                    logits[(row * G + g) * w_stride + w] = s;
                } else {
                    slg[g * QA_TILE + wi] = -INFINITY;
                }
            }
        }
    }
    __syncthreads();
    for (int g = warp; g < G; g += nw) {
        float m = -INFINITY;
        for (int i = lane; i < QA_TILE; i += 32) m = fmaxf(m, slg[g * QA_TILE + i]);
        m = warp_max(m);
        float l = 0.0f;
        if (m != -INFINITY)
            for (int i = lane; i < QA_TILE; i += 32) l += expf(slg[g * QA_TILE + i] - m);
        l = warp_sum(l);
        if (lane == 0) {
            const u64 o = ((row * G + g) * ntiles + tile) * 2;
            stats[o] = m;
            stats[o + 1] = l;
        }
    }
}

// Step 1a for the rows of one sequence (a prefill chunk: every row reads the same Kc). The
// logits come from cuBLAS: per KV head h, an SGEMM of the rows' f32 queries of its G query
// heads against Kc[:, h] (src/cuda/ops/select.rs qa_logits_shared_kc), written where
// qa_window_logits writes them (and past each row's Mc too: those entries are never read).
// qa_q_f32 widens the queries for it and qa_tile_stats computes the tile statistics from
// the logits, as qa_window_logits does (windows w >= Mc of the row count as -inf).
//
// qa_q_f32: qf[(b*H*D) + j] = q[b*q_stride + j] for j < H*D, rows b < n. Any 1-D grid
// (grid-stride loop).
extern "C" __global__ void qa_q_f32(const bf16_t* __restrict__ q, int q_stride, float* __restrict__ qf,
                                    int n, int HD) {
    const long long total = (long long)n * HD;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long b = i / HD;
        qf[i] = bf2f(q[b * q_stride + (i - b * HD)]);
    }
}

// qa_tile_stats: stats[((b*hkv + h)*G + g)*ntiles + tile] = (max, sum exp(logit - max)) over
// the windows w < Mc of the tile, from logits laid out as qa_window_logits writes them.
// Grid (tiles, hkv, B), a multiple of 32 threads (128 used); no shared memory.
extern "C" __global__ void qa_tile_stats(const float* __restrict__ logits, const int* __restrict__ lens,
                                         float* __restrict__ stats, int H, int hkv, int w_stride, int ntiles,
                                         int stride, int ksize) {
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int G = H / hkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int Mc = sel_windows(lens[b], stride, ksize);
    const int w0 = tile * QA_TILE;
    if (w0 >= Mc) return;  // uniform over the block
    const int nwin = min(QA_TILE, Mc - w0);
    const u64 row = (u64)b * hkv + h;
    for (int g = warp; g < G; g += nw) {
        const float* lg = logits + (row * G + g) * w_stride + w0;
        float m = -INFINITY;
        for (int i = lane; i < nwin; i += 32) m = fmaxf(m, lg[i]);
        m = warp_max(m);
        float l = 0.0f;
        if (m != -INFINITY)
            for (int i = lane; i < nwin; i += 32) l += expf(lg[i] - m);
        l = warp_sum(l);
        if (lane == 0) {
            const u64 o = ((row * G + g) * ntiles + tile) * 2;
            stats[o] = m;
            stats[o + 1] = l;
        }
    }
}

// Step 1b: s[b, h, w] = sum over g (ascending) of exp(logit[g, w] - M_g) / L_g, where
// (M_g, L_g) combine the tile statistics of query head g over all windows (the softmax
// over all existing windows, per query head, no mask). Grid (tiles, hkv, B), QA_TILE to
// 4*QA_TILE threads (a multiple of QA_TILE); dynamic shared memory: 2*G floats.
extern "C" __global__ void qa_window_scores(const float* __restrict__ logits, const float* __restrict__ stats,
                                            const int* __restrict__ lens, float* __restrict__ s_out, int H,
                                            int hkv, int w_stride, int ntiles, int stride, int ksize) {
    extern __shared__ float qs_sh[];
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int G = H / hkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int Mc = sel_windows(lens[b], stride, ksize);
    const int w0 = tile * QA_TILE;
    if (w0 >= Mc) return;  // uniform over the block
    const int used = (Mc + QA_TILE - 1) / QA_TILE;
    const u64 row = (u64)b * hkv + h;
    float* sM = qs_sh;
    float* sL = qs_sh + G;
    for (int g = warp; g < G; g += nw) {
        const float* st = stats + (row * G + g) * ntiles * 2;
        float m = -INFINITY;
        for (int t = lane; t < used; t += 32) m = fmaxf(m, st[2 * t]);
        m = warp_max(m);
        float l = 0.0f;
        for (int t = lane; t < used; t += 32) {
            const float mt = st[2 * t];
            if (mt != -INFINITY) l += st[2 * t + 1] * expf(mt - m);
        }
        l = warp_sum(l);
        if (lane == 0) {
            sM[g] = m;
            sL[g] = l;
        }
    }
    __syncthreads();
    // Thread (wi, part): window wi, query heads [part*gp, (part+1)*gp); the parts' sums are
    // added in ascending order (blockDim a multiple of QA_TILE, at most 4*QA_TILE).
    __shared__ float qs_part[4 * QA_TILE];
    const int nparts = blockDim.x / QA_TILE;
    const int wi = threadIdx.x % QA_TILE, part = threadIdx.x / QA_TILE;
    const int gp = (G + nparts - 1) / nparts;
    const int w = w0 + wi;
    float acc = 0.0f;
    if (w < Mc) {
        const int ga = part * gp, gb = min(G, ga + gp);
        const float* lg = logits + row * G * w_stride + w;
#pragma unroll 4
        for (int g = ga; g < gb; ++g) acc += expf(lg[(u64)g * w_stride] - sM[g]) / sL[g];
    }
    qs_part[part * QA_TILE + wi] = acc;
    __syncthreads();
    if (part == 0 && w < Mc) {
        float tot = qs_part[wi];
        for (int p = 1; p < nparts; ++p) tot += qs_part[p * QA_TILE + wi];
        s_out[row * w_stride + w] = tot;
    }
}

// ---- block selection -------------------------------------------------------------------------

// Order-preserving map of an f32 score to u32 (larger score -> larger key; -0 < +0 as in
// Rust's total_cmp); NaN ranks as -inf, as in model::select::top_k.
__device__ __forceinline__ u32 score_key(float x) {
    if (x != x) x = -INFINITY;
    const u32 u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
#define KEY_INF 0xff800000u  // score_key(+inf)

// The cut of a top-k over keys[0, n) (1 <= k <= n) under the order (key descending, index
// ascending): the k-th largest key `thr` (radix select, 8 bits per pass) and how many of
// the elements equal to thr belong to the top k (the lowest-index ones). Every thread of
// the block calls it and gets the result. hist: 256 u32 of shared memory; bc: 2 u32.
__device__ void radix_cut(const u32* keys, int n, u32 k, u32* hist, u32* bc, u32& thr, u32& take_eq) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 prefix = 0, mask = 0, kk = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u32 key = keys[i];
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l owns bins [8l, 8l+8); counts above a bin are those of higher bins.
            u32 c[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = hist[lane * 8 + j];
                tot += c[j];
            }
            u32 incl = tot;  // sum over lanes >= lane
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_down_sync(0xffffffffu, incl, o);
                if (lane + o < 32) incl += v;
            }
            const u32 above = incl - tot;
            if (above < kk && kk <= incl) {
                u32 acc = above;
                for (int j = 7; j >= 0; --j) {
                    if (acc + c[j] >= kk) {
                        bc[0] = (u32)(lane * 8 + j);
                        bc[1] = kk - acc;
                        break;
                    }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= bc[0] << shift;
        mask |= 0xffu << shift;
        kk = bc[1];
    }
    thr = prefix;
    take_eq = kk;
}

// Exclusive count of `flag` over the block's threads before this one (thread order) and the
// block total. Every thread of the block must call it. ws: 32 u32 of shared memory.
__device__ __forceinline__ u32 block_flag_scan(bool flag, u32* ws, u32& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    const u32 before = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) ws[warp] = __popc(ballot);
    __syncthreads();
    u32 off = 0, tot = 0;
    for (int w = 0; w < nw; ++w) {
        const u32 x = ws[w];
        if (w < warp) off += x;
        tot += x;
    }
    __syncthreads();
    total = tot;
    return off + before;
}

// SEL_WARP_SCAN (0 unless set through SPARDA_NVRTC_OPTIONS=-DSEL_WARP_SCAN=1): select_blocks'
// index-ordered passes over the keys (the shortlist's +inf marks, the output's compaction) by
// warp ranges instead of block-wide steps. Warp w owns a contiguous range of 32-key chunks; it
// counts its keys above the cut and equal to it by ballots, one exchange of the warps' counts
// (two barriers) gives each warp the counts before its range, and a second walk marks or writes
// its keys in index order. The same selection and output order as the block-wide steps, which
// pass two barriers per block-width step and scan (about 100 barriers a row at nb 2,032 and 128
// threads, against 4).
#ifndef SEL_WARP_SCAN
#define SEL_WARP_SCAN 0
#endif

// This warp's range of 32-key chunks of keys[0, n): [c0, c1), the chunks split evenly over the
// block's warps in warp order (empty for the last warps when there are fewer chunks than warps).
__device__ __forceinline__ void sel_warp_range(int n, int& c0, int& c1) {
    const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int chunks = (n + 31) >> 5, per = (chunks + nw - 1) / nw;
    c0 = min(warp * per, chunks);
    c1 = min(c0 + per, chunks);
}

// Of this warp's range of keys[0, n) (sel_warp_range): the keys above thr and equal to it.
__device__ __forceinline__ void sel_warp_counts(const u32* keys, int n, u32 thr, u32& gt, u32& eq) {
    const int lane = threadIdx.x & 31;
    int c0, c1;
    sel_warp_range(n, c0, c1);
    gt = 0;
    eq = 0;
    for (int c = c0; c < c1; ++c) {
        const int m = c * 32 + lane;
        const u32 key = m < n ? keys[m] : 0u;
        gt += __popc(__ballot_sync(0xffffffffu, m < n && key > thr));
        eq += __popc(__ballot_sync(0xffffffffu, m < n && key == thr));
    }
}

// Sums of a and b over the block's warps before this one (warp order); every thread of the block
// calls it with its warp's values (the same in every lane). wa, wb: 32 u32 of shared memory each.
__device__ __forceinline__ void sel_warps_before(u32 a, u32 b, u32* wa, u32* wb, u32& a_before, u32& b_before) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        wa[warp] = a;
        wb[warp] = b;
    }
    __syncthreads();
    a_before = 0;
    b_before = 0;
    for (int w = 0; w < warp; ++w) {
        a_before += wa[w];
        b_before += wb[w];
    }
    __syncthreads();
}

// After a radix cut (thr, take) of keys[0, n): f(m, pos) for every chosen key m (above thr, or
// among the first `take` equal to it in index order), pos its place among the chosen in index
// order. Each warp walks its own range (sel_warp_range) once the warps' counts are exchanged.
// Every thread of the block calls it; wa, wb as sel_warps_before's.
template <typename F>
__device__ __forceinline__ void sel_warp_chosen(const u32* keys, int n, u32 thr, u32 take, u32* wa, u32* wb, F f) {
    const int lane = threadIdx.x & 31;
    const u32 lt = (1u << lane) - 1u;
    u32 gt_w, eq_w, gt_before, eq_run;
    sel_warp_counts(keys, n, thr, gt_w, eq_w);
    sel_warps_before(gt_w, eq_w, wa, wb, gt_before, eq_run);
    // the chosen keys before this warp's range: those above the cut and the first `take` equal
    // to it, in index order
    u32 out_run = gt_before + min(eq_run, take);
    int c0, c1;
    sel_warp_range(n, c0, c1);
    for (int c = c0; c < c1; ++c) {
        const int m = c * 32 + lane;
        const u32 key = m < n ? keys[m] : 0u;
        const u32 eqb = __ballot_sync(0xffffffffu, m < n && key == thr);
        const u32 eq_rank = eq_run + __popc(eqb & lt);
        const bool chosen = m < n && (key > thr || (key == thr && eq_rank < take));
        const u32 chb = __ballot_sync(0xffffffffu, chosen);
        if (chosen) f(m, out_run + __popc(chb & lt));
        eq_run += __popc(eqb);
        out_run += __popc(chb);
    }
}

// Step 2-6 per (sequence b = blockIdx.y, KV head h = blockIdx.x):
//   q = (T-1) / block_size, blocks 0..q exist (nb = q+1);
//   r[m] = max of s over windows [wpb*m - ov, wpb*m + wpb) ∩ [0, Mc), -inf if empty
//          (wpb = block_size/stride, ov = ksize/stride - 1), e[m] the same over p;
//   forced (m < init_blocks or q-W <= m <= q) -> +inf in r and e;
//   nosa: QA = top-`shortlist` of r, e[QA] = +inf, selected = top-`attended` of e;
//   otherwise (InfLLM-V2): selected = top-`attended` of r;
//   nb <= attended: every block. Ties go to the lower block index.
// Output: sel[(b*hkv + h)*s_max + i] ascending block ids, padded with -1; nsel[b*hkv + h].
// pooled_r / pooled_e (nullable): the pooled scores before forcing, rows of nb_stride.
// pptr null: e = -inf (InfLLM-V2). Dynamic shared memory: 2*nb_cap u32 (nb <= nb_cap). Block: a
// multiple of 32 threads, at most 1,024 (ws[32]; radix_cut's scan is warp 0's).
// win_lens (nullable): the windows pooled are Mc(win_lens[b]) instead of Mc(T) (forecast
// mode, layers >= 1: the previous step's state, nosa-model.md §4).
// Guard: a row with more blocks than nb_cap (the launch's shared memory) gets an empty
// selection (all -1, nsel 0) and is reported to the device error record err (nullable;
// common.cuh): DEVERR_SELECT_BLOCKS, row b, `layer`, KV head h, value nb, limit nb_cap.
extern "C" __global__ void select_blocks(const float* __restrict__ s, int w_stride, const u64* __restrict__ pptr,
                                         const int* __restrict__ lens, int* __restrict__ sel,
                                         int* __restrict__ nsel, int s_max, float* __restrict__ pooled_r,
                                         float* __restrict__ pooled_e, int nb_stride, int nb_cap, int hkv,
                                         int block_size, int stride, int ksize, int init_blocks,
                                         int window_blocks, int attended, int shortlist, int nosa,
                                         const int* __restrict__ win_lens, int* __restrict__ err, int layer) {
    extern __shared__ u32 sel_keys[];
    __shared__ u32 hist[256];
    __shared__ u32 ws[32];
#if SEL_WARP_SCAN
    __shared__ u32 ws2[32];
#endif
    __shared__ u32 bc[2];
    const int h = blockIdx.x, b = blockIdx.y;
    const u64 row = (u64)b * hkv + h;
    int* out = sel + row * s_max;
    const int T = lens[b];
    const int nb = T > 0 ? (T - 1) / block_size + 1 : 0;
    if (nb == 0 || nb > nb_cap) {  // no query, or more blocks than the launch allowed for
        for (int i = threadIdx.x; i < s_max; i += blockDim.x) out[i] = -1;
        if (threadIdx.x == 0) {
            nsel[row] = 0;
            if (nb > nb_cap) raise_device_error(err, DEVERR_SELECT_BLOCKS, b, layer, h, nb, nb_cap);
        }
        return;
    }
    const int q = nb - 1;
    // Forecast mode scores the previous step's windows: Mc from win_lens when given.
    const int Mc = sel_windows(win_lens != nullptr ? win_lens[b] : T, stride, ksize);
    const int wpb = block_size / stride, ov = ksize / stride - 1;
    u32* rkey = sel_keys;
    u32* ekey = sel_keys + nb;
    const float* S = s + row * w_stride;
    const float* P = pptr != nullptr ? (const float*)pptr[b] : nullptr;
    for (int m = threadIdx.x; m < nb; m += blockDim.x) {
        const int lo = max(wpb * m - ov, 0), hi = min(wpb * m + wpb, Mc);
        float r = -INFINITY, e = -INFINITY;
        for (int w = lo; w < hi; ++w) {
            r = fmaxf(r, S[w]);
            if (P != nullptr) e = fmaxf(e, P[(u64)w * hkv + h]);
        }
        if (pooled_r != nullptr) pooled_r[row * nb_stride + m] = r;
        if (pooled_e != nullptr) pooled_e[row * nb_stride + m] = e;
        const bool forced = m < init_blocks || (m + window_blocks >= q && m <= q);
        rkey[m] = forced ? KEY_INF : score_key(r);
        ekey[m] = forced ? KEY_INF : score_key(e);
    }
    __syncthreads();
    if (nb <= attended) {
        for (int i = threadIdx.x; i < s_max; i += blockDim.x) out[i] = i < nb ? i : -1;
        if (threadIdx.x == 0) nsel[row] = nb;
        return;
    }
    u32 thr, take;
    if (nosa) {
        // Query-aware shortlist: its members get e = +inf.
        radix_cut(rkey, nb, (u32)shortlist, hist, bc, thr, take);
#if SEL_WARP_SCAN
        sel_warp_chosen(rkey, nb, thr, take, ws, ws2, [&](int m, u32) { ekey[m] = KEY_INF; });
#else
        u32 eq_base = 0;
        for (int base = 0; base < nb; base += blockDim.x) {
            const int m = base + threadIdx.x;
            const u32 key = m < nb ? rkey[m] : 0u;
            u32 eq_tot;
            const u32 eq_rank = eq_base + block_flag_scan(m < nb && key == thr, ws, eq_tot);
            if (m < nb && (key > thr || (key == thr && eq_rank < take))) ekey[m] = KEY_INF;
            eq_base += eq_tot;
        }
#endif
        __syncthreads();
    }
    const u32* fkey = nosa ? ekey : rkey;
    radix_cut(fkey, nb, (u32)attended, hist, bc, thr, take);
#if SEL_WARP_SCAN
    sel_warp_chosen(fkey, nb, thr, take, ws, ws2, [&](int m, u32 pos) {
        if (pos < (u32)s_max) out[pos] = m;
    });
#else
    u32 eq_base = 0, out_base = 0;
    for (int base = 0; base < nb; base += blockDim.x) {
        const int m = base + threadIdx.x;
        const u32 key = m < nb ? fkey[m] : 0u;
        u32 eq_tot, ch_tot;
        const u32 eq_rank = eq_base + block_flag_scan(m < nb && key == thr, ws, eq_tot);
        const bool chosen = m < nb && (key > thr || (key == thr && eq_rank < take));
        const u32 pos = out_base + block_flag_scan(chosen, ws, ch_tot);
        if (chosen && pos < (u32)s_max) out[pos] = m;
        eq_base += eq_tot;
        out_base += ch_tot;
    }
#endif
    for (int i = attended + threadIdx.x; i < s_max; i += blockDim.x) out[i] = -1;
    if (threadIdx.x == 0) nsel[row] = attended;
}

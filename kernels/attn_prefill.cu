// Dense causal prefill attention on the tensor cores (nosa-model.md §5 "Dense", §6), in the
// manner of FlashAttention-2: one pass over the keys with an online softmax, no split-K and
// no partials. No bias (dense attention has none).
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
// - 1 of that run for KV head blockIdx.y (src/cuda/ops/attention.rs `prefill_tiles` builds
// them, longest-context tiles first). Grid (ntiles, hkv); block PF_THREADS threads; dynamic
// shared memory prefill_smem_bytes(D) = 4*64*(D+8)*2 bytes (two stages of K and V tiles).
//
// Layouts (those of attn_partial): q bf16, row r's H*D post-RoPE query values at r*q_stride,
// head g at g*D; K/V of row r: bf16 [cap, hkv, D] at kptr[r] / vptr[r] (every row of a run
// has the same cache); out bf16, row r's H*D values at r*out_stride, head g at g*D.
//
// Method: warp w owns the 16 M-rows m0 + 16w .. +15 (Q as mma A fragments in registers, f32
// output accumulators). Keys in tiles of 64, double-buffered in shared memory with cp.async
// (keys past the block's last position zero-filled). Per tile: S = Q.K^T (mma m16n8k16 bf16,
// f32), logits S*scale, masked to -inf past each row's position, online softmax in f32
// (running max and sum per row), P rounded to bf16 (the sum adds the rounded P, as in
// attn_partial), O = O*e^(m_old - m_new) + P.V (mma). A warp skips the tiles wholly past its
// rows' positions. At the end O / L is written as bf16. Arithmetic as attn_partial's
// (bf16 operands, f32 accumulation and softmax), in another summation order.
//
// D is a template parameter: 64, 80 or 128, the three entry points attn_prefill_d64/_d80/_d128
// at the end (any multiple of 16 up to 128 would compile).

#define PF_BM 64            // M-rows (row, head) pairs per block
#define PF_BN 64            // keys per shared-memory tile
#define PF_WARPS 4          // PF_BM / 16
#define PF_THREADS (32 * PF_WARPS)
#define PF_PAD 8            // bf16 padding per shared row (bank-conflict-free ldmatrix)

template <int D>
__device__ __forceinline__ void attn_prefill_impl(const bf16_t* __restrict__ q, int q_stride,
                                                  const u64* __restrict__ kptr, const u64* __restrict__ vptr,
                                                  const int* __restrict__ lens, const int* __restrict__ tiles,
                                                  bf16_t* __restrict__ out, int out_stride, int H, int hkv,
                                                  float scale) {
    constexpr int RS = D + PF_PAD;  // shared row stride, bf16 elements
    constexpr int NK = D / 16;      // k-steps of S = Q.K^T
    constexpr int ND = D / 8;       // 8-column output tiles
    constexpr int CPR = D / 8;      // 16-byte chunks per K/V row
    constexpr int RPP = PF_THREADS / CPR;  // K/V rows one pass of the block loads
    extern __shared__ __align__(16) unsigned char pf_sh[];
    __shared__ int pf_kmax[PF_WARPS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.y;
    const int G = H / hkv;
    const int r0 = tiles[3 * blockIdx.x], nrows = tiles[3 * blockIdx.x + 1], m0 = tiles[3 * blockIdx.x + 2];
    const int mend = min(m0 + PF_BM, nrows * G);

    // This lane's two fragment rows (lane/4 and lane/4 + 8 of the warp's 16): query row,
    // query head, position (-1 for an M-row past the tile's end: it sees no key).
    int rr[2], hh[2], pp[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int m = m0 + warp * 16 + (lane >> 2) + 8 * k;
        if (m < mend) {
            const int i = m / G;
            rr[k] = r0 + i;
            hh[k] = h * G + (m - i * G);
            pp[k] = lens[rr[k]] - 1;
        } else {
            rr[k] = -1;
            hh[k] = 0;
            pp[k] = -1;
        }
    }
    // Warp range of positions: tiles past wmax are skipped; tiles up to wmin need no mask.
    int wmax = max(pp[0], pp[1]), wmin = min(pp[0], pp[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmax = max(wmax, __shfl_xor_sync(FULL_MASK, wmax, o));
        wmin = min(wmin, __shfl_xor_sync(FULL_MASK, wmin, o));
    }
    if (lane == 0) pf_kmax[warp] = wmax;

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
    const int nkt = kmax / PF_BN + 1;

    bf16_t* Ks = (bf16_t*)pf_sh;        // [2][PF_BN][RS]
    bf16_t* Vs = Ks + 2 * PF_BN * RS;   // [2][PF_BN][RS]
    const bf16_t* K = (const bf16_t*)kptr[r0];
    const bf16_t* V = (const bf16_t*)vptr[r0];
    const u64 tok_stride = (u64)hkv * D;
    const int my_row = threadIdx.x / CPR, my_part = threadIdx.x - my_row * CPR;
    const bool loader = my_row < RPP;
    const bf16_t* Kh = K + (u64)h * D + my_part * 8;
    const bf16_t* Vh = V + (u64)h * D + my_part * 8;

    // Issues the copies of key tile t into stage st (keys past kmax zero-filled).
    auto load_tile = [&](int t, int st) {
        if (!loader) return;
        for (int row = my_row; row < PF_BN; row += RPP) {
            const int j = t * PF_BN + row;
            const bool ok = j <= kmax;
            const u64 o = ok ? (u64)j * tok_stride : 0;
            const int srow = st * PF_BN + row;
            cp_async16(Ks + srow * RS + my_part * 8, Kh + o, ok);
            cp_async16(Vs + srow * RS + my_part * 8, Vh + o, ok);
        }
    };

    float o[ND][4];
#pragma unroll
    for (int j = 0; j < ND; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Running max (of logits in log2 units) and this lane's share of the sum, rows lane/4 and +8.
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f};
    const float sl2 = scale * 1.4426950408889634f;  // logits in log2 units: exp(x) = 2^(x log2 e)

    load_tile(0, 0);
    cp_async_commit();
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
        const int kt0 = t * PF_BN;
        if (kt0 <= wmax) {  // warp-uniform: some row of this warp sees a key of the tile
            const bf16_t* ks = Ks + st * PF_BN * RS;
            const bf16_t* vs = Vs + st * PF_BN * RS;
            // S = Q.K^T: s[c] holds keys kt0 + 8c .. +7 (c = 0 .. 7).
            float s[8][4];
#pragma unroll
            for (int c = 0; c < 8; ++c) s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.0f;
#pragma unroll
            for (int nb = 0; nb < 4; ++nb) {
#pragma unroll
                for (int kk = 0; kk < NK; ++kk) {
                    u32 b[4];
                    ldsm_x4(b, ks + (nb * 16 + (lane & 7) + (lane >> 4) * 8) * RS + kk * 16 + ((lane >> 3) & 1) * 8);
                    mma_bf16(s[2 * nb], qa[kk], b[0], b[1]);
                    mma_bf16(s[2 * nb + 1], qa[kk], b[2], b[3]);
                }
            }
            // Logits in log2 units; causal mask where some row of the warp ends inside the tile.
            const bool masked = kt0 + PF_BN - 1 > wmin;
            const int jb = kt0 + (lane & 3) * 2;
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int c = 0; c < 8; ++c) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = jb + 8 * c + e;
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        float v = s[c][2 * k + e] * sl2;
                        if (masked && j > pp[k]) v = -INFINITY;
                        s[c][2 * k + e] = v;
                        mx[k] = fmaxf(mx[k], v);
                    }
                }
            }
            float corr[2], u[2];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL_MASK, mx[k], 1));
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL_MASK, mx[k], 2));
                const float nm = fmaxf(mr[k], mx[k]);
                u[k] = nm == -INFINITY ? 0.0f : nm;  // a row that has seen no key yet stays at 0
                corr[k] = exp2f(mr[k] - u[k]);
                mr[k] = nm;
            }
            float ls[2] = {0.0f, 0.0f};
#pragma unroll
            for (int c = 0; c < 8; ++c) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = round_bf(exp2f(s[c][2 * k + e] - u[k]));
                        s[c][2 * k + e] = p;
                        ls[k] += p;
                    }
                }
            }
            lr[0] = lr[0] * corr[0] + ls[0];
            lr[1] = lr[1] * corr[1] + ls[1];
#pragma unroll
            for (int j = 0; j < ND; ++j) {
                o[j][0] *= corr[0];
                o[j][1] *= corr[0];
                o[j][2] *= corr[1];
                o[j][3] *= corr[1];
            }
            // O += P.V: P (16 x 64, A fragments from the S accumulators), V tile 64 x D.
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u32 pa[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]), pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                                   pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int j = 0; j < ND; j += 2) {
                    u32 b[4];
                    ldsm_x4_trans(b, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + j * 8 + (lane >> 4) * 8);
                    mma_bf16(o[j], pa, b[0], b[1]);
                    mma_bf16(o[j + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // stage st is reloaded by the next iteration's copies
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

// The entry points, one per supported head dim (arguments as attn_prefill_impl's).
extern "C" __global__ __launch_bounds__(PF_THREADS, 2) void attn_prefill_d64(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const int* __restrict__ lens, const int* __restrict__ tiles, bf16_t* __restrict__ out, int out_stride, int H,
    int hkv, float scale) {
    attn_prefill_impl<64>(q, q_stride, kptr, vptr, lens, tiles, out, out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, 2) void attn_prefill_d80(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const int* __restrict__ lens, const int* __restrict__ tiles, bf16_t* __restrict__ out, int out_stride, int H,
    int hkv, float scale) {
    attn_prefill_impl<80>(q, q_stride, kptr, vptr, lens, tiles, out, out_stride, H, hkv, scale);
}

extern "C" __global__ __launch_bounds__(PF_THREADS, 2) void attn_prefill_d128(
    const bf16_t* __restrict__ q, int q_stride, const u64* __restrict__ kptr, const u64* __restrict__ vptr,
    const int* __restrict__ lens, const int* __restrict__ tiles, bf16_t* __restrict__ out, int out_stride, int H,
    int hkv, float scale) {
    attn_prefill_impl<128>(q, q_stride, kptr, vptr, lens, tiles, out, out_stride, H, hkv, scale);
}

// Small-batch linear layer (the decode GEMMs at batch <= GEMV_MAX_N, e.g. B = 1), with the
// decode step's neighbours of a GEMM folded into it (src/cuda/ops/gemv.rs documents the modes):
//   y[i, o] = sum_k x[i, k] * W[o, k]   for i < n, o < out,
// W bf16 [out, in] (row-major, the Hugging Face [out_features, in_features] layout), f32
// accumulation (another summation order than cuBLAS gemm_ex). x is staged in shared memory,
// as bf16 [n, in] (a GX_BF16 input is read in place instead when compiled with
// GEMV_X_DIRECT 1), from one of:
//   GX_BF16     xsrc bf16 [n, in] as is;
//   GX_RMSNORM  xsrc the f32 residual stream [n, in]: x = bf16(bf16(r / sqrt(mean(r^2) + eps)) * g),
//               g = norm bf16 [in] (rmsnorm.cu's formula; each block reduces the rows itself).
// y is one of:
//   GY_BF16     bf16 [n, out], rounded to nearest even;
//   GY_F32      f32 [n, out];
//   GY_RESID    the f32 residual stream [n, out]: y += bf16(sum) * scale (rmsnorm.cu's residual add
//               of a bf16 GEMM output; each element has one writer);
//   GY_SWIGLU   W is the fused [gate; up] weight (out = 2 I rows): y bf16 [n, I] gets
//               bf16(silu(g) * u) of g = bf16(gate row o), u = bf16(up row o) (swiglu.cu's formula
//               on the rounded GEMM outputs).
// Kernels gemv1 ... gemv4: n = 1 ... 4 rows (GEMV_MAX_N), the same arguments.
// Memory-bound: every weight is read once with 16-byte streaming loads, several in flight per
// lane. The weights do not depend on the previous kernel, so under programmatic dependent launch
// each warp loads its first GEMV_PF chunks of both rows before pdl_wait() and the stream of
// weights starts while the previous kernel drains; with GX_RMSNORM each thread also loads its
// first GEMV_NORM_REGS groups of norm weights there, and keeps the residual values it reads
// for the sum of squares in registers for the normalisation (the same sums, bit for bit).
// Work: warp w of the grid (blockIdx.x * warps per block + w) computes row pairs w, w + W,
// w + 2W, ... (W = gridDim.x * warps per block in all); pair p is rows (2p, 2p + 1), or
// (p, p + I) for GY_SWIGLU; lane l reads 16-byte chunks l, l + 32, ... of both rows; the
// partial sums are reduced over the warp (warp_sum).
// Requires: in % 8 == 0, xsrc and W 16-byte aligned, norm 8-byte aligned, out even for
// GY_SWIGLU, dynamic shared memory n * in * 2 bytes (allocated under GEMV_X_DIRECT too),
// blockDim.x a multiple of 32, at most 32 * GEMV_WARPS (the launch bounds: 128 registers a
// thread, 16 warps an SM).

#define GEMV_MAX_N 4
#define GEMV_ROWS 2
#define GEMV_WARPS 8
// Tuning constants a compile may override (-D through $SPARDA_NVRTC_OPTIONS): GEMV_PF (>= 1)
// chunks per row loaded before pdl_wait(), GEMV_UNROLL chunks per row loaded together in the
// loop. The constants above are fixed (the host's launch follows them; warps per block are
// set at launch, $SPARDA_GEMV_WARPS).
#ifndef GEMV_PF
#define GEMV_PF 4
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 4
#endif
// GEMV_X_DIRECT 1: a GX_BF16 input is not staged in shared memory; each lane loads the x
// chunks it needs from global memory beside the weights (L1 keeps x for the SM's other warps),
// so the weight stream does not wait for the block's staging.
#ifndef GEMV_X_DIRECT
#define GEMV_X_DIRECT 0
#endif
// GEMV_NEXT_PF 1: a warp with a further row pair loads that pair's first GEMV_PF chunks per row
// before it reduces and stores the current pair, so its weight stream does not drain between
// pairs (0: only the first pair's chunks are loaded ahead, before pdl_wait()).
#ifndef GEMV_NEXT_PF
#define GEMV_NEXT_PF 0
#endif
#define GEMV_NORM_REGS 4

#define GX_BF16 0
#define GX_RMSNORM 1
#define GY_BF16 0
#define GY_F32 1
#define GY_RESID 2
#define GY_SWIGLU 3

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float dot8(const uint4 w, const uint4 x) {
    float s = bf_lo(w.x) * bf_lo(x.x);
    s = fmaf(bf_hi(w.x), bf_hi(x.x), s);
    s = fmaf(bf_lo(w.y), bf_lo(x.y), s);
    s = fmaf(bf_hi(w.y), bf_hi(x.y), s);
    s = fmaf(bf_lo(w.z), bf_lo(x.z), s);
    s = fmaf(bf_hi(w.z), bf_hi(x.z), s);
    s = fmaf(bf_lo(w.w), bf_lo(x.w), s);
    s = fmaf(bf_hi(w.w), bf_hi(x.w), s);
    return s;
}

// Four features of the RMSNorm input: bf16(bf16(v * inv) * g), g four bf16 norm weights.
__device__ __forceinline__ uint2 gemv_norm4(const float4 v, const uint2 g, float inv) {
    const u32 a = f2bf(round_bf(v.x * inv) * bf_lo(g.x));
    const u32 b = f2bf(round_bf(v.y * inv) * bf_hi(g.x));
    const u32 c = f2bf(round_bf(v.z * inv) * bf_lo(g.y));
    const u32 d = f2bf(round_bf(v.w * inv) * bf_hi(g.y));
    return make_uint2(a | (b << 16), c | (d << 16));
}

// A 16-byte weight load that bypasses L1 (each weight is read once per step).
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The dot products of one row pair (rows at w0, w1) with the n input rows, into a0, a1 (per
// lane: its chunks c = lane, lane + 32, ... in ascending order; `first`: chunks c < 32 *
// GEMV_PF were loaded into pa, pb before the wait); x chunk c of row i at xr[i * kch + c]. Each
// call site passes one memory space (the staged rows in shared memory, or xsrc in global
// memory), so the inlined loads are LDS or LDG, not generic ones.
template <int N>
__device__ __forceinline__ void gemv_pair_dots(const uint4* __restrict__ xr, const uint4* w0, const uint4* w1,
                                               int kch, int lane, bool first, const uint4* pa, const uint4* pb,
                                               float* a0, float* a1) {
#pragma unroll
    for (int i = 0; i < N; ++i) a0[i] = a1[i] = 0.0f;
    int c0 = lane;
    if (first) {
#pragma unroll
        for (int u = 0; u < GEMV_PF; ++u) {
            const int c = lane + 32 * u;
            if (c < kch) {
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    const uint4 xv = xr[i * kch + c];
                    a0[i] += dot8(pa[u], xv);
                    a1[i] += dot8(pb[u], xv);
                }
            }
        }
        c0 = lane + 32 * GEMV_PF;
    }
#pragma unroll GEMV_UNROLL
    for (int c = c0; c < kch; c += 32) {
        const uint4 wa = ld_weights(w0 + c);
        const uint4 wb = ld_weights(w1 + c);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const uint4 xv = xr[i * kch + c];
            a0[i] += dot8(wa, xv);
            a1[i] += dot8(wb, xv);
        }
    }
}

// The two weight rows of row pair `pair` (rows (2p, 2p + 1), the last row twice when out is odd;
// (p, p + half) for GY_SWIGLU), the first row's index in *row0, and whether the second is a row
// of its own.
__device__ __forceinline__ bool gemv_pair_rows(const bf16_t* __restrict__ W, int pair, int in, int out,
                                               bool glu, int half, int* row0_out, const uint4** w0,
                                               const uint4** w1) {
    const int row0 = glu ? pair : pair * GEMV_ROWS;
    const bool has1 = glu || row0 + 1 < out;
    *row0_out = row0;
    *w0 = (const uint4*)(W + (u64)row0 * in);
    *w1 = (const uint4*)(W + (u64)(glu ? pair + half : has1 ? row0 + 1 : row0) * in);
    return has1;
}

// Chunks c = lane + 32 u < kch, u < GEMV_PF, of both rows of a pair into pa, pb.
__device__ __forceinline__ void gemv_pair_prefetch(const uint4* w0, const uint4* w1, int kch, int lane,
                                                   uint4* pa, uint4* pb) {
#pragma unroll
    for (int u = 0; u < GEMV_PF; ++u) {
        const int c = lane + 32 * u;
        if (c < kch) {
            pa[u] = ld_weights(w0 + c);
            pb[u] = ld_weights(w1 + c);
        }
    }
}

// One instance per batch size N (gemv1 ... gemv4 below): the accumulators stay in registers.
template <int N>
__device__ __forceinline__ void gemv_rows(const void* __restrict__ xsrc, const bf16_t* __restrict__ norm,
                                          float eps, const bf16_t* __restrict__ W, void* __restrict__ y,
                                          float scale, int in, int out, int xmode, int ymode) {
    const int n = N;
    extern __shared__ __align__(16) unsigned char gemv_sh[];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kch = in >> 3;  // 16-byte chunks per row
    const int bwarps = blockDim.x >> 5;
    const int nwarps = gridDim.x * bwarps;
    const bool glu = ymode == GY_SWIGLU;
    const int half = out >> 1;
    const int pairs = glu ? half : (out + GEMV_ROWS - 1) / GEMV_ROWS;
    int pair = blockIdx.x * bwarps + warp;

    // The first row pair's first chunks, before the dependency on the previous kernel.
    uint4 pa[GEMV_PF], pb[GEMV_PF];
    if (pair < pairs) {
        const uint4 *w0, *w1;
        int row0;
        gemv_pair_rows(W, pair, in, out, glu, half, &row0, &w0, &w1);
        gemv_pair_prefetch(w0, w1, kch, lane, pa, pb);
    }
    // The norm weights do not depend on the previous kernel either: this thread's first
    // GEMV_NORM_REGS groups of four, into registers before the wait.
    const int nq = in >> 2;  // groups of four features per row
    const uint2* g4 = (const uint2*)norm;
    uint2 gq[GEMV_NORM_REGS];
#pragma unroll
    for (int k = 0; k < GEMV_NORM_REGS; ++k) {
        const int q = threadIdx.x + k * blockDim.x;
        gq[k] = xmode == GX_RMSNORM && q < nq ? g4[q] : make_uint2(0u, 0u);
    }
    pdl_wait();
    pdl_trigger();

    // Stage x: 16-byte (bf16) or float4 (f32) loads, several in flight per thread.
    uint4* xs = (uint4*)gemv_sh;  // [n, kch] chunks
    if (xmode == GX_RMSNORM) {
        // Per row: the sum of squares over this thread's groups q = t, t + blockDim.x, ... in
        // that order (the first GEMV_NORM_REGS kept in registers for the second pass), the
        // block's sum, then x.
        uint2* xq = (uint2*)gemv_sh;  // [n, nq] groups of 4 bf16
        const int q_rest = threadIdx.x + GEMV_NORM_REGS * blockDim.x;
        for (int i = 0; i < n; ++i) {
            const float4* r4 = (const float4*)((const float*)xsrc + (u64)i * in);
            float4 rv[GEMV_NORM_REGS];
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < GEMV_NORM_REGS; ++k) {
                const int q = threadIdx.x + k * blockDim.x;
                rv[k] = q < nq ? r4[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int k = 0; k < GEMV_NORM_REGS; ++k) {
                if (threadIdx.x + k * blockDim.x < nq) {
                    ss += rv[k].x * rv[k].x;
                    ss += rv[k].y * rv[k].y;
                    ss += rv[k].z * rv[k].z;
                    ss += rv[k].w * rv[k].w;
                }
            }
            for (int q = q_rest; q < nq; q += blockDim.x) {
                const float4 v = r4[q];
                ss += v.x * v.x;
                ss += v.y * v.y;
                ss += v.z * v.z;
                ss += v.w * v.w;
            }
            ss = block_sum(ss, red);
            const float inv = 1.0f / sqrtf(ss / (float)in + eps);
#pragma unroll
            for (int k = 0; k < GEMV_NORM_REGS; ++k) {
                const int q = threadIdx.x + k * blockDim.x;
                if (q < nq) xq[(u64)i * nq + q] = gemv_norm4(rv[k], gq[k], inv);
            }
            for (int q = q_rest; q < nq; q += blockDim.x) {
                xq[(u64)i * nq + q] = gemv_norm4(r4[q], g4[q], inv);
            }
        }
    } else {
        if (!GEMV_X_DIRECT) {
            const uint4* x4 = (const uint4*)xsrc;
#pragma unroll 4
            for (int c = threadIdx.x; c < n * kch; c += blockDim.x) xs[c] = x4[c];
        }
    }
    __syncthreads();
    // Where the loop reads x: the staged rows, or (GEMV_X_DIRECT, GX_BF16) xsrc itself.
    const bool xg = GEMV_X_DIRECT && xmode != GX_RMSNORM;

    bool first = true;
    for (; pair < pairs; pair += nwarps) {
        const uint4 *w0, *w1;
        int row0;
        const bool has1 = gemv_pair_rows(W, pair, in, out, glu, half, &row0, &w0, &w1);
        float a0[N], a1[N];
        if (xg) {
            gemv_pair_dots<N>((const uint4*)xsrc, w0, w1, kch, lane, first, pa, pb, a0, a1);
        } else {
            gemv_pair_dots<N>(xs, w0, w1, kch, lane, first, pa, pb, a0, a1);
        }
        first = false;
        if (GEMV_NEXT_PF && pair + nwarps < pairs) {
            const uint4 *n0, *n1;
            int nrow0;
            gemv_pair_rows(W, pair + nwarps, in, out, glu, half, &nrow0, &n0, &n1);
            gemv_pair_prefetch(n0, n1, kch, lane, pa, pb);
            first = true;
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const float s0 = warp_sum(a0[i]);
            const float s1 = warp_sum(a1[i]);
            if (lane == 0) {
                const u64 o = (u64)i * out + row0;
                if (glu) {
                    const float g = round_bf(s0), u = round_bf(s1);
                    ((bf16_t*)y)[(u64)i * half + pair] = f2bf(g / (1.0f + expf(-g)) * u);
                } else if (ymode == GY_F32) {
                    ((float*)y)[o] = s0;
                    if (has1) ((float*)y)[o + 1] = s1;
                } else if (ymode == GY_RESID) {
                    float* r = (float*)y;
                    r[o] = r[o] + round_bf(s0) * scale;
                    if (has1) r[o + 1] = r[o + 1] + round_bf(s1) * scale;
                } else {
                    ((bf16_t*)y)[o] = f2bf(s0);
                    if (has1) ((bf16_t*)y)[o + 1] = f2bf(s1);
                }
            }
        }
    }
}

#define GEMV_KERNEL(NAME, N)                                                                               \
    extern "C" __global__ __launch_bounds__(32 * GEMV_WARPS, 2) void NAME(                               \
        const void* __restrict__ xsrc, const bf16_t* __restrict__ norm, float eps,                       \
        const bf16_t* __restrict__ W, void* __restrict__ y, float scale, int in, int out, int xmode,     \
        int ymode) {                                                                                     \
        gemv_rows<N>(xsrc, norm, eps, W, y, scale, in, out, xmode, ymode);                               \
    }
GEMV_KERNEL(gemv1, 1)
GEMV_KERNEL(gemv2, 2)
GEMV_KERNEL(gemv3, 3)
GEMV_KERNEL(gemv4, 4)

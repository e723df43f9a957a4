// Small-batch linear layer (the decode GEMMs at batch <= GEMV_MAX_N, e.g. B = 1):
//   y[i, o] = sum_k x[i, k] * W[o, k]   for i < n, o < out,
// x bf16 [n, in] and W bf16 [out, in] (row-major, the Hugging Face [out_features,
// in_features] layout), f32 accumulation; y bf16 (rounded to nearest even) or, with
// y_f32 != 0, f32. What cuBLAS gemm_ex computes for these shapes, with another summation
// order. Memory-bound: every weight is read once with 16-byte loads, several in flight per
// lane.
// Block: GEMV_WARPS warps; warp w of block b computes rows (b*GEMV_WARPS + w)*GEMV_ROWS + 0,1;
// lane l reads 16-byte chunks l, l+32, ... of both rows; the partial sums are reduced over
// the warp (warp_sum). x is staged in shared memory first (n*in bf16 = dynamic smem bytes/2).
// Requires: in % 8 == 0, x and W 16-byte aligned, 1 <= n <= GEMV_MAX_N.
// Grid: ceil(out / (GEMV_WARPS*GEMV_ROWS)) blocks of 32*GEMV_WARPS threads.

#define GEMV_MAX_N 4
#define GEMV_ROWS 2
#define GEMV_WARPS 8

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

extern "C" __global__ __launch_bounds__(32 * GEMV_WARPS) void gemv_small(const bf16_t* __restrict__ x,
                                                                          const bf16_t* __restrict__ W,
                                                                          void* __restrict__ y, int n, int in,
                                                                          int out, int y_f32) {
    extern __shared__ __align__(16) unsigned char gemv_sh[];
    pdl_wait();
    pdl_trigger();
    uint4* xs = (uint4*)gemv_sh;  // [n, in/8] chunks
    const int kch = in >> 3;      // 16-byte chunks per row
    for (int c = threadIdx.x; c < n * kch; c += blockDim.x) xs[c] = ((const uint4*)x)[c];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (row0 >= out) return;
    const bool has1 = row0 + 1 < out;
    const uint4* w0 = (const uint4*)(W + (u64)row0 * in);
    const uint4* w1 = (const uint4*)(W + (u64)(has1 ? row0 + 1 : row0) * in);
    float a0[GEMV_MAX_N], a1[GEMV_MAX_N];
#pragma unroll
    for (int i = 0; i < GEMV_MAX_N; ++i) a0[i] = a1[i] = 0.0f;
#pragma unroll 4
    for (int c = lane; c < kch; c += 32) {
        const uint4 wa = w0[c];
        const uint4 wb = w1[c];
#pragma unroll
        for (int i = 0; i < GEMV_MAX_N; ++i) {
            if (i < n) {
                const uint4 xv = xs[i * kch + c];
                a0[i] += dot8(wa, xv);
                a1[i] += dot8(wb, xv);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < GEMV_MAX_N; ++i) {
        if (i < n) {
            const float s0 = warp_sum(a0[i]);
            const float s1 = warp_sum(a1[i]);
            if (lane == 0) {
                if (y_f32) {
                    ((float*)y)[(u64)i * out + row0] = s0;
                    if (has1) ((float*)y)[(u64)i * out + row0 + 1] = s1;
                } else {
                    ((bf16_t*)y)[(u64)i * out + row0] = f2bf(s0);
                    if (has1) ((bf16_t*)y)[(u64)i * out + row0 + 1] = f2bf(s1);
                }
            }
        }
    }
}

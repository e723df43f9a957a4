// SwiGLU on the fused gate|up GEMM output: gu is [n, 2I] (gate in columns
// [0, I), up in [I, 2I)); out[i, j] = bf16(silu(gate[i, j]) * up[i, j]) in f32,
// silu(x) = x / (1 + exp(-x)).
//
// swiglu: grid-stride over n*I elements, one element per step (any I).
// swiglu_v8: grid-stride over n*I/8 groups of 8 consecutive columns, 16-byte loads of gate and
// up and a 16-byte store, 32-bit row/column arithmetic; I a multiple of 8, gu and out 16-byte
// aligned, n*I/8 < 2^31 (src/cuda/ops/mod.rs: `swiglu_takes_v8` checks, `swiglu_with` picks).
// The same arithmetic per element as swiglu, so the same bits.

__device__ __forceinline__ bf16_t swiglu_one(bf16_t gate, bf16_t up) {
    const float g = bf2f(gate), u = bf2f(up);
    return f2bf(g / (1.0f + expf(-g)) * u);
}

extern "C" __global__ void swiglu(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out, int n, int inter) {
    pdl_wait();
    pdl_trigger();
    const u64 total = (u64)n * inter;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (u64)gridDim.x * blockDim.x) {
        const u64 row = idx / inter, col = idx % inter;
        out[idx] = swiglu_one(gu[row * 2 * inter + col], gu[row * 2 * inter + inter + col]);
    }
}

extern "C" __global__ void swiglu_v8(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out, int n, int inter) {
    pdl_wait();
    pdl_trigger();
    const unsigned per_row = (unsigned)inter / 8u;  // groups of 8 columns per row
    const unsigned total = (unsigned)n * per_row;
    for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < total; v += gridDim.x * blockDim.x) {
        const unsigned row = v / per_row, c8 = v - row * per_row;
        const bf16_t* gr = gu + (u64)row * 2 * inter + (u64)c8 * 8;
        const uint4 g4 = *reinterpret_cast<const uint4*>(gr);
        const uint4 u4 = *reinterpret_cast<const uint4*>(gr + inter);
        const bf16_t* g = reinterpret_cast<const bf16_t*>(&g4);
        const bf16_t* u = reinterpret_cast<const bf16_t*>(&u4);
        uint4 o4;
        bf16_t* o = reinterpret_cast<bf16_t*>(&o4);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = swiglu_one(g[k], u[k]);
        *reinterpret_cast<uint4*>(out + (u64)v * 8) = o4;
    }
}

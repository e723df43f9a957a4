// SwiGLU on the fused gate|up GEMM output: gu is [n, 2I] (gate in columns
// [0, I), up in [I, 2I)); out[i, j] = bf16(silu(gate[i, j]) * up[i, j]) in f32,
// silu(x) = x / (1 + exp(-x)). Grid-stride over n*I elements.

extern "C" __global__ void swiglu(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out, int n, int inter) {
    pdl_wait();
    pdl_trigger();
    const u64 total = (u64)n * inter;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (u64)gridDim.x * blockDim.x) {
        const u64 row = idx / inter, col = idx % inter;
        const float g = bf2f(gu[row * 2 * inter + col]);
        const float u = bf2f(gu[row * 2 * inter + inter + col]);
        out[idx] = f2bf(g / (1.0f + expf(-g)) * u);
    }
}

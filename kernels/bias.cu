// Bias add after a bias-free GEMM (attention_bias / mlp_bias checkpoints):
// y[i, j] = bf16(y[i, j] + b[j]) for the first `cols` columns of each of n rows
// (row i at y + i*ld), computed in f32. Grid-stride over n*cols elements.

extern "C" __global__ void bias_add(bf16_t* __restrict__ y, int ld, const float* __restrict__ b, int n, int cols) {
    pdl_wait();
    pdl_trigger();
    const u64 total = (u64)n * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (u64)gridDim.x * blockDim.x) {
        const u64 row = idx / cols, col = idx % cols;
        bf16_t* p = y + row * ld + col;
        *p = f2bf(bf2f(*p) + b[col]);
    }
}

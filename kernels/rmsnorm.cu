// RMSNorm with a fused residual add (nosa-model.md §7).
//   resid[i, :] += delta[i, :] * delta_scale          (f32 residual stream; skipped when delta is null)
//   out[i, j]    = bf16( bf16(resid[i, j] / sqrt(mean_j(resid[i, :]^2) + eps)) * w[j] )
// compute in f32, round to the activation dtype (bf16), multiply by the weight.
// Grid: one block per row; block size a multiple of 32 (<= 1024).

extern "C" __global__ void rmsnorm_residual(float* __restrict__ resid, const bf16_t* __restrict__ delta,
                                            float delta_scale, const bf16_t* __restrict__ w,
                                            bf16_t* __restrict__ out, int d, float eps) {
    __shared__ float shm[32];
    pdl_wait();
    pdl_trigger();
    const int row = blockIdx.x;
    float* r = resid + (u64)row * d;
    float ss = 0.0f;
    if (delta != nullptr) {
        const bf16_t* dl = delta + (u64)row * d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float x = r[j] + bf2f(dl[j]) * delta_scale;
            r[j] = x;
            ss += x * x;
        }
    } else {
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float x = r[j];
            ss += x * x;
        }
    }
    ss = block_sum(ss, shm);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    bf16_t* o = out + (u64)row * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = f2bf(round_bf(r[j] * inv) * bf2f(w[j]));
}

// RMSNorm with a fused residual add (nosa-model.md §7).
//   resid[i, :] += delta[i, :] * delta_scale          (f32 residual stream; skipped when delta is null)
//   out[i, j]    = bf16( bf16(resid[i, j] / sqrt(mean_j(resid[i, :]^2) + eps)) * w[j] )
// compute in f32, round to the activation dtype (bf16), multiply by the weight.
// Thread t takes elements t, t + blockDim.x, ...; when that is at most RMS_REGS of them
// (d <= RMS_REGS * blockDim.x), every load of the row and of the weight is issued before the
// reduction and the values stay in registers (one round trip to memory at batch 1, where the
// kernel is one block); wider rows read the stream again after the reduction. Same sums in
// the same order either way.
// Grid: one block per row; block size a multiple of 32 (<= 1024).

#define RMS_REGS 8

extern "C" __global__ void rmsnorm_residual(float* __restrict__ resid, const bf16_t* __restrict__ delta,
                                            float delta_scale, const bf16_t* __restrict__ w,
                                            bf16_t* __restrict__ out, int d, float eps) {
    __shared__ float shm[32];
    pdl_wait();
    pdl_trigger();
    const int row = blockIdx.x, bd = blockDim.x, t = threadIdx.x;
    float* r = resid + (u64)row * d;
    const bf16_t* dl = delta != nullptr ? delta + (u64)row * d : nullptr;
    bf16_t* o = out + (u64)row * d;
    float ss = 0.0f;
    if (d <= RMS_REGS * bd) {
        float xv[RMS_REGS], wv[RMS_REGS];
#pragma unroll
        for (int k = 0; k < RMS_REGS; ++k) {
            const int j = t + k * bd;
            xv[k] = 0.0f;
            wv[k] = 0.0f;
            if (j < d) {
                xv[k] = dl != nullptr ? r[j] + bf2f(dl[j]) * delta_scale : r[j];
                wv[k] = bf2f(w[j]);
            }
        }
#pragma unroll
        for (int k = 0; k < RMS_REGS; ++k) {
            const int j = t + k * bd;
            if (j < d) {
                if (dl != nullptr) r[j] = xv[k];
                ss += xv[k] * xv[k];
            }
        }
        ss = block_sum(ss, shm);
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
        for (int k = 0; k < RMS_REGS; ++k) {
            const int j = t + k * bd;
            if (j < d) o[j] = f2bf(round_bf(xv[k] * inv) * wv[k]);
        }
        return;
    }
    for (int j = t; j < d; j += bd) {
        const float x = dl != nullptr ? r[j] + bf2f(dl[j]) * delta_scale : r[j];
        if (dl != nullptr) r[j] = x;
        ss += x * x;
    }
    ss = block_sum(ss, shm);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = t; j < d; j += bd) o[j] = f2bf(round_bf(r[j] * inv) * bf2f(w[j]));
}

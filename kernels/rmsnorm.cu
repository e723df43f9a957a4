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

// rmsnorm_residual_v4: the same result with 4 consecutive columns a thread per step (a float4 of
// the residual, 8-byte loads of delta and w, an 8-byte store): d a multiple of 4, resid 16-byte
// and delta, w, out 8-byte aligned (src/cuda/ops/mod.rs `rmsnorm_takes_v4`). Each thread's share
// of the sum of squares is over other columns than rmsnorm_residual's, so the f32 sum (and a
// rounding of the output) may differ in the last bit.
extern "C" __global__ void rmsnorm_residual_v4(float* __restrict__ resid, const bf16_t* __restrict__ delta,
                                               float delta_scale, const bf16_t* __restrict__ w,
                                               bf16_t* __restrict__ out, int d, float eps) {
    __shared__ float shm[32];
    pdl_wait();
    pdl_trigger();
    const int row = blockIdx.x, d4 = d >> 2;
    float4* r = reinterpret_cast<float4*>(resid + (u64)row * d);
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d4; j += blockDim.x) {
        float4 x = r[j];
        if (delta != nullptr) {
            const uint2 dv = reinterpret_cast<const uint2*>(delta + (u64)row * d)[j];
            x.x += bf2f((bf16_t)(dv.x & 0xffffu)) * delta_scale;
            x.y += bf2f((bf16_t)(dv.x >> 16)) * delta_scale;
            x.z += bf2f((bf16_t)(dv.y & 0xffffu)) * delta_scale;
            x.w += bf2f((bf16_t)(dv.y >> 16)) * delta_scale;
            r[j] = x;
        }
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
    }
    ss = block_sum(ss, shm);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    uint2* o = reinterpret_cast<uint2*>(out + (u64)row * d);
    const uint2* wv = reinterpret_cast<const uint2*>(w);
    for (int j = threadIdx.x; j < d4; j += blockDim.x) {
        const float4 x = r[j];
        const uint2 ww = wv[j];
        const u32 a = f2bf(round_bf(x.x * inv) * bf2f((bf16_t)(ww.x & 0xffffu)));
        const u32 b = f2bf(round_bf(x.y * inv) * bf2f((bf16_t)(ww.x >> 16)));
        const u32 c = f2bf(round_bf(x.z * inv) * bf2f((bf16_t)(ww.y & 0xffffu)));
        const u32 e = f2bf(round_bf(x.w * inv) * bf2f((bf16_t)(ww.y >> 16)));
        o[j] = make_uint2(a | (b << 16), c | (e << 16));
    }
}

// Random fills for synthetic benchmark state (runtime.md §5 `--prefill synthetic`):
// x[i] = bf16(scale * z_i), z_i ~ N(0, 1) by Box-Muller from a counter-based hash of
// (seed, i), so the values depend only on the seed and the index, never on the launch.
// Grid-stride over n elements; any grid and block size.

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

extern "C" __global__ void fill_normal_bf16(bf16_t* __restrict__ x, u64 n, u64 seed, float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 hsh = mix64(seed + mix64(i + 0x9e3779b97f4a7c15ull));
        const float u1 = (float)((hsh >> 40) + 1u) * (1.0f / 16777216.0f);  // (0, 1]
        const float u2 = (float)((hsh >> 8) & 0xffffffu) * (1.0f / 16777216.0f);
        const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        x[i] = f2bf(z * scale);
    }
}

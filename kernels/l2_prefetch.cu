// Weight prefetch into L2 (runtime.md §4, "L2 prefetch of the O projection"): asks the L2
// to load bytes [0, bytes) at p from device memory, in bulk prefetches of `chunk` bytes
// (cp.async.bulk.prefetch.L2, sm_90): no data reaches the SM and nothing is written, so the
// kernel ends once its requests are issued. A hint only: the values read later are the
// same with or without it. p 16-byte aligned; chunk a multiple of 16; a tail of bytes not
// a multiple of 16 is left out. Grid-stride over the chunks (any grid).

extern "C" __global__ void l2_prefetch(const unsigned char* __restrict__ p, u64 bytes, u32 chunk) {
    const u64 n = (bytes + chunk - 1) / chunk;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 off = i * chunk;
        const u64 left = bytes - off;
        const u32 sz = (u32)(left < (u64)chunk ? left : (u64)chunk) & ~15u;
        if (sz != 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(sz) : "memory");
    }
}

// Warpgroup tensor-core helpers (sm_90a: wgmma.mma_async), prepended after mma.cuh by
// src/cuda/context.rs to the sources that list it as a prelude. A warpgroup is four
// consecutive warps (warps 4i .. 4i+3 of the block) that issue each wgmma together; its
// accumulator of a 64 x N tile is spread as mma.sync's m16n8 C fragments: warp w%4 of the
// group holds rows 16*(w%4) .. +15, and d[c][0..3] the columns 8c .. 8c+7 (row lane/4,
// columns 2*(lane%4) + {0,1}, then row lane/4 + 8). An A operand taken from registers has
// mma.sync's m16n8k16 A fragment layout per warp (its 16 rows). Only a kernel compiled for
// sm_90a may call these (the callers guard their bodies with __CUDA_ARCH_FEAT_SM90_ALL).

// Shared-memory matrix descriptor of a K-major bf16 operand without swizzle: the operand is
// made of core matrices of 8 rows x 16 bytes (8 bf16 of K), each 128 contiguous bytes; `lbo`
// bytes between core matrices adjacent in K, `sbo` bytes between core matrices adjacent in
// the M/N dimension; `saddr` the first core matrix's shared-window address (16-byte aligned).
__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
}

// Descriptor of a K-major bf16 operand in the 128-byte swizzle: rows of 128 bytes (64 bf16 of
// K), 8 rows an atom of 1,024 bytes (1,024-byte aligned) whose 16-byte chunk c of row r sits at
// 16 * (c ^ r); atoms of consecutive 8-row groups 1,024 bytes apart (SBO). `saddr` the atom's
// address plus the k-step's byte offset inside its 128-byte rows (32 per k16 step); LBO unused.
__device__ __forceinline__ u64 wg_desc_sw128(u32 saddr) {
    return (u64)((saddr >> 4) & 0x3FFF) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// Orders this thread's register accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the wgmma operations issued so far into a group.
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Makes this thread's shared-memory writes (st.shared, cp.async) visible to the async proxy
// that wgmma reads shared operands through; before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins a register across the asynchronous wgmma (no move of it between issue and wait).
__device__ __forceinline__ void wg_pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }

// d (+)= A.B for a 64 x 64 x 16 step: A bf16 from registers (a: this warp's m16n8k16 A
// fragment), B bf16 from shared memory (desc: K-major, wg_desc), f32 accumulate; `acc` 0
// overwrites d (d = A.B). Asynchronous: the result is in d after wg_commit + wg_wait.
__device__ __forceinline__ void wg_m64n64k16_rs(float (&d)[8][4], const u32 (&a)[4], u64 desc, int acc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
          "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
          "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc)
        : "memory");
}

// Shared prelude of every sparda-rt kernel source (prepended textually by
// src/cuda/context.rs before NVRTC compiles a kernels/*.cu file; it is not a
// compilation unit of its own). No CUDA headers are needed: bf16 values travel
// as their 16 raw bits (unsigned short) and are converted here, so the
// kernels compile with NVRTC alone.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// math.h is not included under NVRTC: define the f32 infinity here.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// bf16 bits -> f32 (exact).
__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// f32 -> bf16 bits, round to nearest even (as half::bf16::from_f32); NaN stays NaN.
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Rounds an f32 through bf16 and back.
__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }

// The bf16 bits of a quiet NaN, written where an input was invalid so the error shows.
#define BF16_NAN ((bf16_t)0x7fc0u)

// Mc(T): the compressed-key windows of T tokens, (T - ksize) / stride + 1 for T >= ksize,
// else 0 (nosa-model.md §3; compress.cu, select.cu, qa_prefill.cu).
__device__ __forceinline__ int sel_windows(int T, int stride, int ksize) {
    return T >= ksize ? (T - ksize) / stride + 1 : 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// NOSA eviction score of one (row, KV head) by one whole warp (nosa-model.md
// §3): A * softplus(delta_h . v + b), softplus linear above 20, in f32 from the
// row's bf16 v (kvd = Hkv*D values) and f32 delta_h [kvd]. Every lane gets it.
// qkv_rope_append and eviction_score both call this, so their c agree bit for bit.
__device__ __forceinline__ float eviction_c(const float* delta_h, const bf16_t* v, int kvd, float b, float A) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int i = lane; i < kvd; i += 32) acc += delta_h[i] * bf2f(v[i]);
    const float z = warp_sum(acc) + b;
    const float sp = z > 20.0f ? z : log1pf(expf(z));
    return A * sp;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024);
// every thread gets the result. `shm` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* shm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    float t = lane < nw ? shm[lane] : 0.0f;
    return warp_sum(t);
}

// ---- device error record (src/cuda/device_error.rs; both must agree) -----------------------
// A kernel whose guard fails (bad input it cannot process) skips the offending work and
// reports it here instead of failing silently. The record: i32 [8] in pinned, device-mapped
// host memory: [0] code (0 = none), [1] row of the launch, [2] layer, [3] the offending value,
// [4] the limit it broke, [5] KV head (-1: a per-row guard), [6] a count (non-finite logits:
// the offending entries of the row; else 0), [7] 0. The first error wins (atomicCAS on the
// code); only the claiming thread writes the other words. A null record reports nothing. The
// host reads it after a synchronisation and clears it.
#define DEVERR_ROPE_POSITION 1  // qkv_rope_append: position outside the RoPE table
#define DEVERR_SELECT_BLOCKS 2  // select_blocks: more blocks than the launch's cap
#define DEVERR_SLOT_DIFF 3      // slot_diff: more missed blocks than free slots
// Non-finite logits (argmax_rows, argmax_advance, sample_rows; the rule of src/sample.rs
// `check_logits`): value = the lowest offending id (-1 for NO_FINITE), limit = V, count word.
#define DEVERR_LOGITS_NAN 4        // a NaN in the row
#define DEVERR_LOGITS_POSINF 5     // no NaN, a +inf in the row
#define DEVERR_LOGITS_NO_FINITE 6  // every entry -inf

__device__ __forceinline__ void raise_device_error_n(int* rec, int code, int row, int layer, int head,
                                                     int value, int limit, int count) {
    if (rec == nullptr) return;
    if (*(volatile int*)rec != 0) return;  // an earlier error holds the record
    if (atomicCAS(rec, 0, code) != 0) return;
    volatile int* w = rec;
    w[1] = row;
    w[2] = layer;
    w[3] = value;
    w[4] = limit;
    w[5] = head;
    w[6] = count;
    __threadfence_system();
}

__device__ __forceinline__ void raise_device_error(int* rec, int code, int row, int layer, int head,
                                                   int value, int limit) {
    raise_device_error_n(rec, code, row, layer, head, value, limit, 0);
}

// Per-CTA timeline (bench --cta-timeline; src/trace/cta.rs reads it): thread 0 of each CTA
// writes [start ns, end ns, SM id] of its CTA at log + 3 * cta, cta = the linear block id
// (x fastest), start and end from %globaltimer, the SM from %smid; the end waits for every
// thread of the CTA (cta_log_end is a barrier when log is set: call it where all threads
// arrive). Both points recompute the address from the kernel parameter, so no register is
// held across the kernel. A null log records nothing (the default: one uniform branch).
// %globaltimer may tick only every microsecond or so.
__device__ __forceinline__ u64* cta_log_slot(u64* log) {
    const u64 cta =
        blockIdx.x + (u64)gridDim.x * (blockIdx.y + (u64)gridDim.y * blockIdx.z);
    return log + 3ull * cta;
}
__device__ __forceinline__ void cta_log_start(u64* log) {
    if (log == nullptr || threadIdx.x != 0) return;
    u64 t;
    unsigned int sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    u64* p = cta_log_slot(log);
    p[0] = t;
    p[2] = sm;
}
__device__ __forceinline__ void cta_log_end(u64* log) {
    if (log == nullptr) return;
    __syncthreads();
    if (threadIdx.x != 0) return;
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
    cta_log_slot(log)[1] = t;
}

// Programmatic dependent launch (src/cuda/launch.rs). pdl_wait() waits until
// the kernel before this one on the stream has completed and its writes are
// visible; every kernel launched through KernelLaunch calls it before its first
// memory access (a no-op when launched without PDL). pdl_trigger() lets the
// next kernel's blocks be scheduled (they wait in their own pdl_wait()).
// sm_90 and later only; below, both are empty and launches never use PDL.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Tensor-core helpers shared by the attention kernels (attn_decode.cu, attn_prefill.cu):
// prepended after common.cuh by src/cuda/context.rs (listed as a prelude of each source that
// uses them), not a compilation unit of its own. Warp-level mma.sync m16n8k16 bf16 -> f32,
// ldmatrix and cp.async through inline PTX, so no CUDA header is needed (sm_80 and later).

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte asynchronous copy global -> shared; zero-fills the destination when !ok. `dst`
// is an address in the shared window (smem_addr; see ldsm_x4_at for why).
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

// 4-byte asynchronous copy global -> shared; zero-fills the destination when !ok.
__device__ __forceinline__ void cp_async4_at(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}

// cp_async16_at / cp_async4_at to a generic pointer into shared memory.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) { cp_async16_at(smem_addr(dst), src, ok); }
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) { cp_async4_at(smem_addr(dst), src, ok); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait_n() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8x8 bf16 matrices from shared memory (row addresses from lanes 8i .. 8i+7 for
// matrix i); r[i] holds matrix i in the mma fragment layout (row lane/4, cols 2*(lane%4)+{0,1}).
// `a` is the lane's row address in the shared window (smem_addr): a loop that keeps one
// such base and adds constant byte offsets lets ptxas fold them into the instruction,
// where a generic pointer costs a 64-bit add and a conversion per load.
__device__ __forceinline__ void ldsm_x4_at(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// As ldsm_x4_at, transposed: r[i] holds rows 2*(lane%4)+{0,1}, column lane/4 of matrix i.
__device__ __forceinline__ void ldsm_x4_trans_at(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// Element offsets, in a shared tile of bf16 rows RS apart, of this lane's ldmatrix row for
// a 16-row x 16-column x4 load: K as the B operand of Q.K^T (tile row lane%8 + 8*(lane/16),
// column half (lane/8)%2) and V transposed for P.V (tile row lane%8 + 8*((lane/8)%2),
// column block lane/16).
__device__ __forceinline__ int ldsm_k_lane(int lane, int RS) { return ((lane & 7) + (lane >> 4) * 8) * RS + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int ldsm_v_lane(int lane, int RS) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8; }

// c += A (16x16 bf16, row-major fragment) * B (16x8 bf16, column fragment), f32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// s += Q.K^T for one warp's 16 M-rows against a tile of 64 K rows in shared memory (bf16 rows
// RS elements apart; `ks` this lane's ldmatrix address of the tile, smem_addr of the tile plus
// ldsm_k_lane): s[c] holds K rows 8c .. 8c+7 in the mma C layout, qa the NK k-steps of Q as A
// fragments. The S tile of attn_prefill.cu and qa_prefill.cu.
template <int NK, int RS>
__device__ __forceinline__ void mma_qk_tile64(float (&s)[8][4], const u32 (&qa)[NK][4], u32 ks) {
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) {
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
            u32 b[4];
            ldsm_x4_at(b, ks + (nb * 16 * RS + kk * 16) * 2);
            mma_bf16(s[2 * nb], qa[kk], b[0], b[1]);
            mma_bf16(s[2 * nb + 1], qa[kk], b[2], b[3]);
        }
    }
}

// Two f32 values rounded to bf16 (nearest even) in one bf16x2 register, lo in the low half:
// one conversion instruction, the same bits as f2bf for every finite value.
__device__ __forceinline__ u32 pack_bf2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x by the SFU alone (ex2.approx.ftz: a result below 2^-126 flushes to 0; 2^-inf = 0):
// exp2f adds a range test and two multiplies per call to keep subnormal results, which a
// softmax weight rounded to bf16 next to a maximum of 1 does not need.
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The low and high bf16 halves of a bf16x2 register as f32.
__device__ __forceinline__ float bf2_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf2_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// Two f32 values (exactly representable in bf16) as a bf16x2 register, lo in the low half.
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) { return pack_bf2_rn(lo, hi); }

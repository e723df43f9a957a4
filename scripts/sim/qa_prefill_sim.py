#!/usr/bin/env python3
"""Lane-level simulation of kernels/qa_prefill.cu (qa_prefill_scores_d{64,80,128}), to check
the kernel without a GPU. It re-implements the kernel step by step: change it with the kernel.
Run: python3 scripts/sim/qa_prefill_sim.py [--parts 2|3] (numpy; about 35 s, 25 s with --parts 2): the three-part
entry points (qa_prefill_scores_d*) by default, --parts 2 the bf16x2 ones. Exit 1 on any error
or a relative L2 above 1e-5 (three parts) / 1e-4 (two).

Blocks of QP_BM = 128 (row, query head) M-rows, QP_WARPS = 8 warps, QP_THREADS = 256 threads
(the kernel's #defines, copied below). Every block of the grid (ceil(rows / (QP_BM/G)), hkv) is
simulated with its QP_THREADS threads held as numpy vectors indexed by tid (lane = tid & 31,
warp = tid >> 5); warp-collective instructions (ldmatrix.x4, mma.sync.m16n8k16, shfl.xor) are
simulated per warp from the per-lane registers with the PTX ISA fragment layouts. Shared memory
is a byte array with the kernel's exact layout (NP bf16 part tiles of 64 rows of RS = D + 8,
then the f32 P tile [QP_BM][65] = [128][65]); the static qp_mc[QP_BM] = qp_mc[128] is a
separate 512-byte array. Every shared access is checked for bounds, alignment,
reads of never-written bytes and cross-thread races inside one barrier epoch; every global
access for bounds/alignment and for the block's limits (Kc windows < the block's max Mc, q rows
< n); every output write for (row < n, w < Mc(row), right head, exactly once). Barriers check
that all QP_THREADS threads arrive.

--kernel m32 (about 15 s; M32_SHAPES: G = 4, 8, 16 at D = 64, 80, 128) simulates the current
qa_prefill_scores_m32_impl<D, G> (entry points qa_prefill_scores_m32_g{4,8,16}_d{64,80,128}) instead,
with the same helpers and checks: QP_M32_THREADS = 256 threads, 8 warps; warp w has wr = w & 3 (block
M-rows 32wr .. 32wr+31 as two A tiles, 32wr + 16a ..) and hf = w >> 2 (windows 32hf .. 32hf+31 of every
64-window tile, by mma_qk_tile32_m32 from part-tile row 32hf; the half skipped by the whole warp where
w0 + 32hf >= mc_max, checked warp-uniform, as are its ldmatrix and shuffles); three parts; the dynamic smem
only the three part tiles (qa_prefill_m32_smem_bytes(D) = 3*64*(D+8)*2). Between the passes the pair
(wr, 0)/(wr, 1) merges its softmax statistics through st = the first 8 KB of the part tiles
([2 hf][4 wr][32 lanes][2 a][2 k][max, sum] f32, two barriers around the reads): the part tiles are
marked never-written at that point, so a read of st that no thread wrote is reported, and the races of
the st stores/loads with the part-tile loads are checked like any other; the merged (max, 1/L) are
checked equal over a row's four lanes and over the pair. Pass 2: P in registers, head sums by shfl.xor
written by the writer lanes. Each written sum also carries the set of block M-rows added into it, which
must be exactly the G M-rows of the row written (the right heads, each once). Shapes: partial last
blocks, blocks of rows all Mc = 0 (the early return) and mixed with Mc = 0 / 1 rows, rows with Mc < 32
and < 64, several tiles, max Mc a multiple of 64 (128, 192), of 32 only (96), and last tiles whose second
half is empty (e.g. 65, 70, 129, 193). Exit 1 on any error or a relative L2 above 1e-5.

--kernel m32s [--parts 2|3] (about 10 s; 15 s with three parts) simulates the SPLIT entry points
the GPU runs by default (qa_prefill_scores_m32s{,_bf16x2}_g*_d*): the part tiles come from
qa_split_kc's layout ([hkv][3][p_stride][D], p_stride not a multiple of 64, rows past Mc NaN) by
cp.async 16-byte copies with both of the kernel's thread mappings (D 64/128 and D 80), each copy
landing only when its group is waited for (ptx_model.SharedMem); two parts by default, two
buffers. Reads of bytes whose copy has not landed, copies issued into bytes another warp still
reads, and copies pending when the block exits are reported. Relative L2 limit 1e-4 with two
parts. At G = 16 and 8 pass 2's head sums go by the transposing tree (QP_TREE_SUM, the kernels'
default), each written total checked to hold the row's G heads once and one window; --no-tree-sum
(with --kernel m32 or m32s) simulates -DQP_TREE_SUM=0, the shuffle sums.
"""
import sys
import numpy as np

from ptx_model import (A_COL, A_ROW, B_COL, B_ROW, C_COL, C_ROW, LOG, SharedMem as Shared, bf2_hi, bf2_lo, bf_bits_to_f32,
                       bytes_to_u32, check, f2bf_bits, ldsm_k_lane, mma_bf16_x, pack_bf2_rn)

F32 = np.float32
NEG_INF = F32(-np.inf)

# kernels/qa_prefill.cu #defines
QP_BM, QP_BN, QP_WARPS, QP_PAD = 128, 64, 8, 8
QP_THREADS = 32 * QP_WARPS
QP_PS = QP_BN + 1
assert QP_BM == 16 * QP_WARPS  # warp w owns M-rows 16w .. 16w+15


# ---------------------------------------------------------------- bf16 splits (conversions: ptx_model.py)
def qp_split2(x0, x1):
    x0 = np.asarray(x0, F32)
    x1 = np.asarray(x1, F32)
    a = pack_bf2_rn(x0, x1)
    r0 = (x0 - bf2_lo(a)).astype(F32)
    r1 = (x1 - bf2_hi(a)).astype(F32)
    b = pack_bf2_rn(r0, r1)
    c = pack_bf2_rn((r0 - bf2_lo(b)).astype(F32), (r1 - bf2_hi(b)).astype(F32))
    return a, b, c


def u32_lo_hi_f(x):
    """bf16x2 register -> (low-half value, high-half value) as float64."""
    x = np.asarray(x, np.uint32)
    return bf2_lo(x).astype(np.float64), bf2_hi(x).astype(np.float64)



def as_bytes_u32(v):  # (N,) u32 -> (N,4) bytes, little endian
    return np.ascontiguousarray(np.asarray(v, '<u4')).view(np.uint8).reshape(-1, 4)


def as_bytes_u32x2(a, b):  # uint2 {x=a, y=b}
    return np.ascontiguousarray(np.stack([np.asarray(a, '<u4'), np.asarray(b, '<u4')], 1)).view(np.uint8).reshape(-1, 8)


# ---------------------------------------------------------------- warp collectives
def ldmatrix_x4(sh, tids_all, addr):
    """ldmatrix.sync.aligned.m8n8.x4.shared.b16 for every warp of the block.
    addr: (QP_THREADS,) byte address supplied by each lane. Lanes 8i..8i+7 give rows 0..7 of matrix i;
    result register i of lane L = word L%4 (columns 2*(L%4), +1) of row L/4 of matrix i."""
    nthr = addr.shape[0]
    rows = sh.read(tids_all, addr, 16, 16, "ldmatrix row")  # (QP_THREADS, 16) bytes
    words = bytes_to_u32(rows)  # (QP_THREADS, 4): word j of the row that thread tid addressed
    return words[LDSM_SRC[:nthr], LDSM_WORD[:nthr]]


# ldmatrix.x4 result map: register i of thread (warp wp, lane L) = word L%4 of the row addressed
# by lane 8i + L/4 of the same warp.
LDSM_SRC = np.zeros((QP_THREADS, 4), int)
LDSM_WORD = np.zeros((QP_THREADS, 4), int)
for _wp in range(QP_WARPS):
    for _Ln in range(32):
        for _i in range(4):
            LDSM_SRC[_wp * 32 + _Ln, _i] = _wp * 32 + 8 * _i + (_Ln >> 2)
            LDSM_WORD[_wp * 32 + _Ln, _i] = _Ln & 3


def mma_bf16(c, a, b0, b1):
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for every warp.
    c: (QP_THREADS,4) f32, a: (QP_THREADS,4) u32, b0,b1: (QP_THREADS,) u32. Returns new c (products exact, sum in f64,
    rounded to f32 once)."""
    nw = c.shape[0] // 32
    out = np.empty_like(c)
    for wp in range(nw):
        sl = slice(wp * 32, wp * 32 + 32)
        A = np.zeros((16, 16))
        alo, ahi = u32_lo_hi_f(a[sl])  # (32,4)
        A[A_ROW[:, :, 0], A_COL[:, :, 0]] = alo
        A[A_ROW[:, :, 1], A_COL[:, :, 1]] = ahi
        B = np.zeros((16, 8))
        bb = np.stack([b0[sl], b1[sl]], 1)
        blo, bhi = u32_lo_hi_f(bb)
        B[B_ROW[:, :, 0], B_COL[:, :, 0]] = blo
        B[B_ROW[:, :, 1], B_COL[:, :, 1]] = bhi
        Cm = np.zeros((16, 8))
        Cm[C_ROW, C_COL] = c[sl].astype(np.float64)
        Dm = Cm + A @ B
        out[sl] = Dm[C_ROW, C_COL].astype(F32)
    return out


def shfl_xor(v, m, active=None):
    """__shfl_xor_sync(FULL_MASK, v, m) over full warps (all lanes active). active: (threads,) bool, the
    threads executing the shuffle, if given: checked to be whole warps (FULL_MASK with an inactive lane is
    undefined behaviour); v may have trailing dimensions."""
    tid = np.arange(v.shape[0])
    if active is not None:
        aw = active.reshape(-1, 32)
        check((aw.all(1) | ~aw.any(1)).all(), f"__shfl_xor_sync(FULL_MASK, ., {m}) with part of a warp active")
    return v[(tid & ~31) | ((tid & 31) ^ m)]


# ---------------------------------------------------------------- the kernel
NP = 3  # Kc parts summed (kernel template parameter NP; --parts)
KERNEL = "qa"  # "qa": qa_prefill_scores_impl (default); "m32": qa_prefill_scores_m32_impl (--kernel m32)


def smem_bytes(D):  # src/cuda/ops/prefill_scores.rs qa_prefill_smem_bytes(D, NP)
    return NP * 64 * (D + 8) * 2 + QP_BM * 65 * 4  # NP part tiles [64][D+8] bf16 + P [QP_BM][65] f32


def sel_windows(T, stride, ksize):
    T = np.asarray(T, np.int64)
    return np.where(T >= ksize, (T - ksize) // stride + 1, 0)


class Globals:
    def __init__(self, q, q_stride, kc, lens, s_out, rows, hkv, w_stride, D, stride, ksize):
        self.q, self.q_stride, self.kc, self.lens, self.s = q, q_stride, kc, lens, s_out
        self.rows, self.hkv, self.w_stride, self.D = rows, hkv, w_stride, D
        self.mc_rows = sel_windows(lens, stride, ksize)
        self.written = np.zeros(s_out.shape, np.int64)
        self.max_q_row = -1
        self.max_kc_w = -1


def block_mc(bx, gl, G, stride, ksize, tid, mcs, syncthreads):
    """The block's prologue, common to both kernels: R = QP_BM / G rows from b0 = bx*R, nr of them;
    qp_mc[i] = sel_windows(lens[b0 + i]) by the block's threads, __syncthreads, each thread's mc_max.
    Returns None where the kernel returns at once (nr <= 0), else (b0, nr, blk_mc, mc_max, done):
    blk_mc the block's true max Mc (for the global-read checks), mc_max per thread, done where every
    thread takes the early return (mc_max == 0)."""
    nthr = tid.size
    R = QP_BM // G
    b0 = bx * R
    nr = min(R, gl.rows - b0)
    if nr <= 0:
        return None  # uniform
    # block's true limits (for the global-read checks)
    blk_rows = np.arange(b0, b0 + nr)
    blk_mc = int(gl.mc_rows[blk_rows].max())

    # for (i = tid; i < nr; i += THREADS) qp_mc[i] = sel_windows(lens[b0 + i], ...)
    for it in range((QP_BM + nthr - 1) // nthr + 1):
        x = tid + it * nthr
        act = x < nr
        if not act.any():
            break
        li = b0 + x[act]
        check(((li >= 0) & (li < gl.lens.size)).all(), "lens read out of bounds")
        mc = sel_windows(gl.lens[li], stride, ksize).astype('<i4')
        mcs.write(tid[act], 4 * x[act], np.ascontiguousarray(mc).view(np.uint8).reshape(-1, 4), 4, "qp_mc store")
    syncthreads(np.ones(nthr, bool))
    # int mc_max = 0; for (i < nr) mc_max = max(mc_max, qp_mc[i]);  (per thread)
    mc_max = np.zeros(nthr, np.int64)
    for i in range(nr):
        v = bytes_to_u32(mcs.read(tid, np.full(nthr, 4 * i), 4, 4, "qp_mc load")).view('<i4')[:, 0]
        mc_max = np.maximum(mc_max, v)
    check((mc_max == mc_max[0]).all(), "mc_max not uniform over the block")
    if (mc_max == 0).all():
        return b0, nr, blk_mc, mc_max, True
    check(not (mc_max == 0).any(), "early return taken by part of the block (divergent barrier)")
    check(mc_max[0] == blk_mc, f"mc_max {mc_max[0]} != block max Mc {blk_mc}")
    return b0, nr, blk_mc, mc_max, False


def load_q_u32(gl, base, off):
    """*(const u32*)(qr + off) where base (element offset of qr into q) >= 0, else 0 (qr == nullptr)."""
    ok = base >= 0
    e = base[ok] + off[ok]
    out = np.zeros(base.shape[0], np.uint32)
    check(((2 * e) % 4 == 0).all(), "q u32 load misaligned")
    check(((e >= 0) & (e + 1 < gl.q.size)).all(), "q load out of bounds")
    rowi = e // gl.q_stride
    check((rowi < gl.rows).all(), "q load past row n-1")
    gl.max_q_row = max(gl.max_q_row, int(rowi.max()) if rowi.size else -1)
    out[ok] = gl.q[e].astype(np.uint32) | (gl.q[e + 1].astype(np.uint32) << 16)
    return out


def q_fragments(m0, lane, tid, nr, G, b0, h, gl, mcs):
    """One A tile of Q: fragment rows lane/4 + 8k (k = 0, 1) are the block M-rows m0 + lane/4 + 8k
    (m0 per thread: the tile's first M-row). Returns ti (block row, -1 past nr), mcr (that row's Mc
    from qp_mc, 0 past nr), both (threads, 2), qa (threads, NK, 4) u32 A fragments and the M-rows m (threads, 2)."""
    nthr = tid.size
    D = gl.D
    NK = D // 16
    ti = np.zeros((nthr, 2), np.int64)
    mcr = np.zeros((nthr, 2), np.int64)
    qr = np.full((nthr, 2), -1, np.int64)  # element offset into q, -1 = nullptr
    mrow = np.zeros((nthr, 2), np.int64)
    for k in range(2):
        m = m0 + (lane >> 2) + 8 * k
        mrow[:, k] = m
        i = m // G
        ok = i < nr
        ti[:, k] = np.where(ok, i, -1)
        v = bytes_to_u32(mcs.read(tid[ok], 4 * i[ok], 4, 4, "qp_mc load (mcr)")).view('<i4')[:, 0]
        mcr[ok, k] = v
        qr[ok, k] = (b0 + i[ok]) * gl.q_stride + (h * G + (m[ok] - i[ok] * G)) * D
    qc = (lane & 3) * 2
    qa = np.zeros((nthr, NK, 4), np.uint32)
    for kk in range(NK):
        c0 = kk * 16 + qc
        qa[:, kk, 0] = load_q_u32(gl, qr[:, 0], c0)
        qa[:, kk, 1] = load_q_u32(gl, qr[:, 1], c0)
        qa[:, kk, 2] = load_q_u32(gl, qr[:, 0], c0 + 8)
        qa[:, kk, 3] = load_q_u32(gl, qr[:, 1], c0 + 8)
    return ti, mcr, qa, mrow


def qp_load_tile(dyn, gl, tid, h, w0, mc_max, blk_mc, nparts, KS=0):
    """qp_load_tile<D, NP = nparts, THREADS = tid.size>: Kc windows w0 .. w0+63 of KV head h, split,
    into the nparts bf16 part tiles at byte KS of dyn (the loads of a batch come before its stores in the
    kernel; per thread the same values, so the batches are not modelled)."""
    nthr = tid.size
    D = gl.D
    RS = D + QP_PAD
    F4 = D // 4
    PART = QP_BN * RS
    check(QP_BN * F4 % nthr == 0, f"qp_load_tile: {QP_BN * F4} float4 chunks not whole passes of {nthr} threads")
    Kh = h * D
    kc_row = gl.hkv * D
    for it in range((QP_BN * F4 + nthr - 1) // nthr):
        x = tid + it * nthr
        act = x < QP_BN * F4
        xa, ta = x[act], tid[act]
        row = xa // F4
        c4 = xa - row * F4
        w = w0 + row
        v = np.zeros((xa.size, 4), F32)
        ld = w < mc_max[ta]
        if ld.any():
            e = Kh + w[ld] * kc_row + c4[ld] * 4
            check((e % 4 == 0).all(), "Kc float4 load misaligned")
            check(((e >= 0) & (e + 3 < gl.kc.size)).all(), "Kc load out of allocation")
            check((w[ld] < blk_mc).all(), "Kc read past the block's max Mc")
            gl.max_kc_w = max(gl.max_kc_w, int(w[ld].max()))
            v[ld] = gl.kc[e[:, None] + np.arange(4)[None, :]]
        a0, b0_, c0 = qp_split2(v[:, 0], v[:, 1])
        a1, b1, c1 = qp_split2(v[:, 2], v[:, 3])
        o = row * RS + c4 * 4  # bf16 elements
        dyn.write(ta, KS + 2 * o, as_bytes_u32x2(a0, a1), 8, "uint2 store hi")
        dyn.write(ta, KS + 2 * (PART + o), as_bytes_u32x2(b0_, b1), 8, "uint2 store mid")
        if nparts == 3:
            dyn.write(ta, KS + 2 * (2 * PART + o), as_bytes_u32x2(c0, c1), 8, "uint2 store lo")


def mask_logits(s, w0, cb, mcr, scale):
    """In place: s[:, c, 2k + e] (window w0 + cb + 8c + e, fragment row k) scaled, -inf at w >= mcr[:, k]."""
    s[:] = (s * F32(scale)).astype(F32)
    mask_raw(s, w0, cb, mcr)


def running_max(s, k, mr, active=None):
    """The new running maximum of fragment row k of s (threads, C, 4): the row maximum over the lane's 2C
    values and the row's four lanes (shfl.xor 1, 2), then with the running maximum mr."""
    mx = np.full(s.shape[0], NEG_INF, F32)
    for c in range(s.shape[1]):
        mx = np.fmax(mx, np.fmax(s[:, c, 2 * k], s[:, c, 2 * k + 1]))
    mx = np.fmax(mx, shfl_xor(mx, 1, active))
    mx = np.fmax(mx, shfl_xor(mx, 2, active))
    return np.fmax(mr, mx)


def online_update(s, k, mr, lr, active=None):
    """Pass 1 on fragment row k of s (threads, C, 4): running_max, then the running maximum mr and sum of
    exp lr. Returns (mr, lr)."""
    mn = running_max(s, k, mr, active)
    upd = mn != NEG_INF
    l = np.where(mr != NEG_INF, lr * np.exp((mr - mn).astype(F32)), F32(0)).astype(F32)
    for c in range(s.shape[1]):
        l = (l + np.exp((s[:, c, 2 * k] - mn).astype(F32))).astype(F32)
        l = (l + np.exp((s[:, c, 2 * k + 1] - mn).astype(F32))).astype(F32)
    return np.where(upd, mn, mr), np.where(upd, l, lr)


def inv_row_sum(lr, mr, active=None):
    """1/L of the row (the sum of lr over the row's four lanes; 0 for L = 0), after checking that the
    four lanes hold the same maximum mr."""
    check((mr == shfl_xor(mr, 1, active)).all() and (mr == shfl_xor(mr, 2, active)).all(),
          "row maximum differs over the row's four lanes")
    l = lr.copy()
    l = (l + shfl_xor(l, 1, active)).astype(F32)
    l = (l + shfl_xor(l, 2, active)).astype(F32)
    return np.where(l > 0, (F32(1) / l).astype(F32), F32(0))


def p_value(v, mr, il):
    """v != -inf ? expf(v - mr) * il : 0."""
    return np.where(v != NEG_INF, (np.exp((v - mr).astype(F32)) * il).astype(F32), F32(0)).astype(F32)


def fma32(x, y, z):
    """fmaf(x, y, z) in f32 (the f32 product is exact in f64; one f64 rounding of the sum, then f32)."""
    return (np.asarray(x, np.float64) * np.float64(y) + np.asarray(z, np.float64)).astype(F32)


def mask_raw(s, w0, cb, mcr):
    """The m32 kernels' masking, in place: s[:, c, 2k + e] (window w0 + cb + 8c + e, fragment row k)
    unscaled, -inf at w >= mcr[:, k]."""
    for c in range(s.shape[1]):
        for e in range(2):
            w = w0 + cb + 8 * c + e
            for k in range(2):
                s[:, c, 2 * k + e] = np.where(w < mcr[:, k], s[:, c, 2 * k + e], NEG_INF)


def online_update_m32(s, k, mr, lr, lscale, active=None):
    """online_update for the m32 kernels: the running maximum of the unscaled logits, each exponent
    qp_exp(fmaf(x, lscale, -mn * lscale))."""
    mn = running_max(s, k, mr, active)
    upd = mn != NEG_INF
    nm = (-mn * F32(lscale)).astype(F32)
    l = np.where(mr != NEG_INF, lr * np.exp(fma32(mr, lscale, nm)), F32(0)).astype(F32)
    for c in range(s.shape[1]):
        l = (l + np.exp(fma32(s[:, c, 2 * k], lscale, nm))).astype(F32)
        l = (l + np.exp(fma32(s[:, c, 2 * k + 1], lscale, nm))).astype(F32)
    return np.where(upd, mn, mr), np.where(upd, l, lr)


def p_value_m32(v, off, il, lscale, full):
    """full || v != -inf ? qp_exp(fmaf(v, lscale, off)) * il : 0 (off = -M * lscale)."""
    p = (np.exp(fma32(v, lscale, off)) * il).astype(F32)
    if full:
        check(np.isfinite(v).all() and np.isfinite(off).all(), "-inf logit or offset in a full tile")
        return p
    return np.where(v != NEG_INF, p, F32(0)).astype(F32)


def store_out(gl, h, brow, wa, vals):
    """s_out[((b0 + i) * hkv + h) * w_stride + w] = vals (brow = b0 + i), with the output checks."""
    idx = (brow * gl.hkv + h) * gl.w_stride + wa
    ok = (idx >= 0) & (idx < gl.s.size)
    check(ok.all(), "s_out write out of allocation")
    check((brow < gl.rows).all(), "s_out write to row >= n")
    check((wa < gl.mc_rows[np.minimum(brow, gl.rows - 1)]).all(), "s_out write at w >= Mc(row)")
    check((wa < gl.w_stride).all(), "s_out write at w >= w_stride")
    gl.s[idx[ok]] = vals[ok]
    np.add.at(gl.written, idx[ok], 1)


def simulate_block(bx, h, gl, H, stride, ksize, scale, rng, stats):
    D = gl.D
    RS = D + QP_PAD
    PART = QP_BN * RS
    hkv = gl.hkv
    tid = np.arange(QP_THREADS)
    lane, warp = tid & 31, tid >> 5
    dyn = Shared(smem_bytes(D), "dynamic smem", rng, QP_THREADS)
    mcs = Shared(QP_BM * 4, f"qp_mc[{QP_BM}]", rng, QP_THREADS)
    shareds = (dyn, mcs)
    nbar = [0]

    def syncthreads(arriving):
        check(arriving.all(), f"block ({bx},{h}): __syncthreads reached by {arriving.sum()}/{QP_THREADS} threads")
        nbar[0] += 1
        for s in shareds:
            s.barrier()

    G = H // hkv
    pro = block_mc(bx, gl, G, stride, ksize, tid, mcs, syncthreads)
    if pro is None:
        return 0
    b0, nr, blk_mc, mc_max, done = pro
    if done:
        return nbar[0]

    # ---- Q fragments: warp w's M-rows 16w .. 16w+15
    ti, mcr, qa, _ = q_fragments(warp * 16, lane, tid, nr, G, b0, h, gl, mcs)
    NK = qa.shape[1]

    KS = 0  # byte offset of Ks in the dynamic window
    PS = KS + 2 * NP * PART  # Ps = (float*)(Ks + NP*PART)
    check(PS % 16 == 0, "Ps not 16-byte aligned")

    ks_lane = KS + 2 * ldsm_k_lane(lane, RS)
    ntiles = (int(mc_max[0]) + QP_BN - 1) // QP_BN

    def load_tile(w0):
        qp_load_tile(dyn, gl, tid, h, w0, mc_max, blk_mc, NP, KS)

    cb = (lane & 3) * 2

    def tile_logits(w0):
        s = np.zeros((QP_THREADS, 8, 4), F32)
        for p in range(NP):
            for nb in range(4):
                for kk in range(NK):
                    b = ldmatrix_x4(dyn, tid, ks_lane + (p * PART + nb * 16 * RS + kk * 16) * 2)
                    s[:, 2 * nb] = mma_bf16(s[:, 2 * nb], qa[:, kk], b[:, 0], b[:, 1])
                    s[:, 2 * nb + 1] = mma_bf16(s[:, 2 * nb + 1], qa[:, kk], b[:, 2], b[:, 3])
        mask_logits(s, w0, cb, mcr, scale)
        return s

    # ---- pass 1
    mr = np.full((QP_THREADS, 2), NEG_INF, F32)
    lr = np.zeros((QP_THREADS, 2), F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(ntiles):
            w0 = t * QP_BN
            load_tile(w0)
            syncthreads(np.ones(QP_THREADS, bool))
            s = tile_logits(w0)
            for k in range(2):
                mr[:, k], lr[:, k] = online_update(s, k, mr[:, k], lr[:, k])
            syncthreads(np.ones(QP_THREADS, bool))
        il = np.zeros((QP_THREADS, 2), F32)
        for k in range(2):
            il[:, k] = inv_row_sum(lr[:, k], mr[:, k])

        # ---- pass 2
        for t in range(ntiles):
            w0 = t * QP_BN
            load_tile(w0)
            syncthreads(np.ones(QP_THREADS, bool))
            s = tile_logits(w0)
            for k in range(2):
                prow = warp * 16 + (lane >> 2) + 8 * k
                for c in range(8):
                    for e in range(2):
                        pv = p_value(s[:, c, 2 * k + e], mr[:, k], il[:, k])
                        addr = PS + 4 * (prow * QP_PS + cb + 8 * c + e)
                        dyn.write(tid, addr, as_bytes_u32(pv.view(np.uint32)), 4, "P store")
            syncthreads(np.ones(QP_THREADS, bool))
            for it in range((QP_BM * QP_BN + QP_THREADS - 1) // QP_THREADS):
                x = tid + it * QP_THREADS
                act = x < nr * QP_BN
                if not act.any():
                    continue
                xa, ta = x[act], tid[act]
                i = xa // QP_BN
                col = xa - i * QP_BN
                w = w0 + col
                mci = bytes_to_u32(mcs.read(ta, 4 * i, 4, 4, "qp_mc load (sum)")).view('<i4')[:, 0]
                wr = w < mci
                if not wr.any():
                    continue
                ia, ca, wa, tw = i[wr], col[wr], w[wr], ta[wr]
                acc = np.zeros(ia.size, F32)
                for g in range(G):
                    addr = PS + 4 * (ia * G * QP_PS + ca + g * QP_PS)
                    pv = bytes_to_u32(dyn.read(tw, addr, 4, 4, "P load")).view(F32)[:, 0]
                    acc = (acc + pv).astype(F32)
                store_out(gl, h, b0 + ia, wa, acc)
            # (no barrier at the end of a pass-2 tile: the kernel has none)
    stats['ps_max_byte'] = max(stats.get('ps_max_byte', -1), dyn.max_byte)
    return nbar[0]


# ---------------------------------------------------------------- the m32 kernel (--kernel m32)
# qa_prefill_scores_m32_impl<D, G> (entry points qa_prefill_scores_m32_g{4,8,16}_d{64,80,128}):
# QP_M32_WARPS = 8 warps; warp w: wr = w & 3 (block M-rows 32wr .. 32wr+31 as two A tiles, 32wr + 16a ..),
# hf = w >> 2 (windows 32hf .. 32hf+31 of every 64-window tile); NP = 3 always; the pair (wr, 0)/(wr, 1)
# merges its pass-1 statistics through shared memory (st, over the part tiles); heads summed by shfl.xor
# and written by "writer" lanes, no P tile.
QP_M32_WARPS = 8
QP_M32_THREADS = 32 * QP_M32_WARPS
QP_M32_NP = 3
QP_FULL_TILES = 1  # kernels/qa_prefill.cu's default; --no-full-tiles simulates -DQP_FULL_TILES=0
QP_TREE_SUM = 1  # kernels/qa_prefill.cu's default (G = 16, 8); --no-tree-sum simulates -DQP_TREE_SUM=0


def scatter_act(v, act):
    """The values v of the threads act as a (T,) vector, 0 at the other threads."""
    out = np.zeros(act.shape[0], F32)
    out[act] = v
    return out
QP_M32_GS = (4, 8, 16)  # the G of the entry points


# --kernel m32s: the SPLIT kernels (qa_prefill_scores_m32s{,_bf16x2}_g*_d*, the GPU's default path):
# Kc's bf16 parts come from qa_split_kc's [hkv][3][p_stride][D] by cp.async, M32S_NP of them (--parts),
# in 2 part-tile buffers.
M32_SPLIT = False
M32S_NP = 2


def m32_buffers():  # prefill_scores.rs qa_prefill_m32_smem_bytes: the part-tile buffers
    return 2 if M32_SPLIT else 1


def smem_bytes_m32(D):  # src/cuda/ops/prefill_scores.rs qa_prefill_m32_smem_bytes(D, parts, split)
    return (M32S_NP if M32_SPLIT else QP_M32_NP) * 64 * (D + 8) * 2 * m32_buffers()


def split_kc_parts(kc, mc, hkv, D, p_stride):
    """qa_split_kc: Kc f32 [mc, hkv, D] as bf16 bits [hkv][3][p_stride][D] (hi, mid, lo; rows >= mc
    never written: NaN bits, so a read of them is visible)."""
    parts = np.full((hkv, 3, p_stride, D), 0x7fc1, np.uint16)
    if mc:
        x = kc.reshape(mc, hkv, D).transpose(1, 0, 2).reshape(-1)
        a, b, c = qp_split2(x, np.zeros_like(x))
        for i, v in enumerate((a, b, c)):
            parts[:, i, :mc, :] = (np.asarray(v, np.uint32) & 0xFFFF).astype(np.uint16).reshape(hkv, mc, D)
    return parts.reshape(-1)


def issue_tile_m32s(dyn, gl, tid, h, w0, buf, mc_max, blk_mc, NPs):
    """issue_tile(w0, buf): the NPs part tiles of windows w0 .. w0+63 into buffer buf by cp.async,
    16-byte chunks (zero-filled at windows >= mc_max), both of the kernel's thread mappings; one group."""
    T = tid.size
    D = gl.D
    RS = D + QP_PAD
    PART = QP_BN * RS
    CH = D // 8
    if T % CH == 0:  # thread tid: column chunk tid % CH of rows tid / CH + j * RSTEP of each part
        RSTEP = T // CH
        c, row0 = tid % CH, tid // CH
        items = [(np.full(T, p), row0 + j * RSTEP, c, tid) for p in range(NPs) for j in range(QP_BN // RSTEP)]
    else:
        TOTAL = NPs * QP_BN * CH
        items = []
        for it in range(-(-TOTAL // T)):
            x = tid + it * T
            act = x < TOTAL
            xa = x[act]
            p, r = xa // (QP_BN * CH), xa % (QP_BN * CH)
            items.append((p, r // CH, r % CH, tid[act]))
    for p, row, c, ta in items:
        ok = w0 + row < mc_max[ta]
        data = np.zeros((ta.size, 16), np.uint8)
        if ok.any():
            src = ((h * 3 + p[ok]) * gl.p_stride + w0 + row[ok]) * D + c[ok] * 8  # bf16 elements
            check(((src >= 0) & (src + 8 <= gl.parts.size)).all(), "Kc part cp.async source out of the allocation")
            check((w0 + row[ok] < blk_mc).all(), "Kc part read past the block's max Mc")
            check((w0 + row[ok] < gl.p_stride).all(), "Kc part read past p_stride")
            gl.max_kc_w = max(gl.max_kc_w, int((w0 + row[ok]).max()))
            data[ok] = np.ascontiguousarray(gl.parts[src[:, None] + np.arange(8)[None, :]]).view(np.uint8).reshape(-1, 16)
        dyn.cp_async(ta, ((buf * NPs + p) * PART + row * RS + c * 8) * 2, data, "Kc part cp.async")
    dyn.commit(tid)


def ldmatrix_x4_act(sh, tid, addr, act):
    """ldmatrix_x4 executed by the threads act only (a warp-uniform branch): checked to be whole warps
    (.sync.aligned), shared reads only for them; the other threads' registers are returned as 0."""
    aw = act.reshape(-1, 32)
    check((aw.all(1) | ~aw.any(1)).all(), "ldmatrix.sync.aligned with part of a warp active")
    words = np.zeros((tid.size, 4), np.uint32)
    words[act] = bytes_to_u32(sh.read(tid[act], addr[act], 16, 16, "ldmatrix row"))
    return words[LDSM_SRC[:tid.size], LDSM_WORD[:tid.size]]


def simulate_block_m32(bx, h, gl, H, stride, ksize, scale, rng, stats):
    T = QP_M32_THREADS
    NPm = M32S_NP if M32_SPLIT else QP_M32_NP
    D = gl.D
    RS = D + QP_PAD
    PART = QP_BN * RS
    NK = D // 16
    hkv = gl.hkv
    tid = np.arange(T)
    lane, warp = tid & 31, tid >> 5
    wr, hf = warp & 3, warp >> 2  # M-rows 32*wr .. 32*wr+31, windows 32*hf .. of a tile
    dyn = Shared(smem_bytes_m32(D), "dynamic smem", rng, T)
    mcs = Shared(QP_BM * 4, f"qp_mc[{QP_BM}]", rng, T)
    shareds = (dyn, mcs)
    nbar = [0]
    live = np.ones(T, bool)  # every barrier is outside the kernel's branches: all threads must reach it

    def syncthreads(arriving):
        check(arriving.all(), f"block ({bx},{h}): __syncthreads reached by {arriving.sum()}/{T} threads")
        nbar[0] += 1
        for s in shareds:
            s.barrier()

    G = H // hkv
    check(G in QP_M32_GS, f"m32 kernel launched with G = {G} (entry points for G = 4, 8, 16 only)")
    check(G >= 1 and 16 % G == 0, f"m32 kernel launched with G = {G} (static_assert: 16 % G == 0)")
    pro = block_mc(bx, gl, G, stride, ksize, tid, mcs, syncthreads)
    if pro is None:
        return 0
    b0, nr, blk_mc, mc_max, done = pro
    if done:
        return nbar[0]
    # QP_FULL_TILES: tiles every row of the block sees whole (the least Mc of its rows, qp_mc[0 .. nr))
    full_tiles = int(gl.mc_rows[b0:b0 + nr].min()) // QP_BN if QP_FULL_TILES else 0
    lscale = scale  # QP_LOGIT_SCALE with -DQP_FAST_EXP=0: the simulation's exp is expf

    # ---- Q: fragment row lane/4 + 8k of A tile a is block M-row 32*wr + 16a + lane/4 + 8k
    mcr = np.zeros((T, 2, 2), np.int64)
    qa = np.zeros((T, 2, NK, 4), np.uint32)
    mrow = np.zeros((T, 2, 2), np.int64)
    for a in range(2):
        _, mcr[:, a], qa[:, a], mrow[:, a] = q_fragments(wr * 32 + a * 16, lane, tid, nr, G, b0, h, gl, mcs)

    ks_lane = 2 * (ldsm_k_lane(lane, RS) + hf * 32 * RS)  # smem_addr(Ks + ldsm_k_lane + hf*32*RS)
    ntiles = (int(mc_max[0]) + QP_BN - 1) // QP_BN
    cb = (lane & 3) * 2 + 32 * hf

    def half_logits(w0, act, full, buf):
        """s (T, 2, 4, 4): s[:, a, c, 2k + e] = fragment row lane/4 + 8k of tile a, window w0 + cb + 8c + e
        (cb includes 32*hf), unscaled, computed by the threads act (0 elsewhere); masked unless full."""
        s = np.zeros((T, 2, 4, 4), F32)
        for p in range(NPm):
            ks = ks_lane + (buf * NPm + p) * PART * 2  # mma_qk_tile32_m32<NK, RS>(s, qa, ks_lane + (buf*NP + p)*PART*2)
            for nb in range(2):
                for kk in range(NK):
                    b = ldmatrix_x4_act(dyn, tid, ks + (nb * 16 * RS + kk * 16) * 2, act)
                    # [a][0]: s[a][2nb] += qa[a][kk] . (b0, b1); [a][1]: s[a][2nb+1] += qa[a][kk] . (b2, b3)
                    cc = s[:, :, 2 * nb:2 * nb + 2].reshape(T, 4, 4)
                    aa = np.repeat(qa[:, :, kk], 2, axis=1)  # (T, 4, 4): a = 0, 0, 1, 1
                    bb0 = np.tile(b[:, [0, 2]], 2)  # (T, 4): b0, b2, b0, b2
                    bb1 = np.tile(b[:, [1, 3]], 2)
                    s[:, :, 2 * nb:2 * nb + 2] = mma_bf16_x(cc, aa, bb0, bb1).reshape(T, 2, 2, 4)
        if not full:
            for a in range(2):
                mask_raw(s[:, a], w0, cb, mcr[:, a])  # s[:, a] is a view: masked in place
        return s

    def half_active(w0):
        """if (w0 + 32 * hf < mc_max): the warps computing the tile's half (checked warp-uniform)."""
        act = w0 + 32 * hf < mc_max
        aw = act.reshape(-1, 32)
        check((aw.all(1) | ~aw.any(1)).all(), "half-tile branch not warp-uniform")
        return act

    # "Right head" bookkeeping: alongside each p value, the count of every block M-row (0..127) in it
    # (a lane's own: the M-row whose Q it loaded); a written sum must hold each M-row of its block row
    # i (i*G .. i*G + G-1) exactly once, nothing else.
    ones_m = np.zeros((T, 2, 2, QP_BM), np.int64)  # [thread, a, k, M-row]
    for a in range(2):
        for k in range(2):
            check(((mrow[:, a, k] >= 0) & (mrow[:, a, k] < QP_BM)).all(), "M-row out of the block's 128")
            ones_m[tid, a, k, np.clip(mrow[:, a, k], 0, QP_BM - 1)] = 1

    def issue(w0, buf):
        issue_tile_m32s(dyn, gl, tid, h, w0, buf, mc_max, blk_mc, NPm)

    def stage_tile(t):
        """Tile t's part tiles in shared memory (or in flight to land at the caller's barrier); its buffer."""
        if M32_SPLIT:
            if t + 1 < ntiles:
                issue((t + 1) * QP_BN, (t + 1) & 1)
            else:
                dyn.commit(tid)
            dyn.wait_group(tid, 1, f"tile {t}")
            return t & 1
        qp_load_tile(dyn, gl, tid, h, t * QP_BN, mc_max, blk_mc, NPm)
        return 0

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # ---- pass 1: per warp, over its halves of the tiles
        mr = np.full((T, 2, 2), NEG_INF, F32)
        lr = np.zeros((T, 2, 2), F32)
        if M32_SPLIT:
            issue(0, 0)
        for t in range(ntiles):
            w0 = t * QP_BN
            buf = stage_tile(t)
            syncthreads(live)
            act = half_active(w0)
            if act.any():
                s = half_logits(w0, act, t < full_tiles, buf)
                for a in range(2):
                    for k in range(2):
                        m_, l_ = online_update_m32(s[:, a], k, mr[:, a, k], lr[:, a, k], lscale, act)
                        mr[:, a, k] = np.where(act, m_, mr[:, a, k])
                        lr[:, a, k] = np.where(act, l_, lr[:, a, k])
            syncthreads(live)

        # ---- the pair's merge through st = (float*)qp_sh: [2 hf][4 wr][32 lanes][2 a][2 k][2: max, sum].
        # The part tiles are dead from here (pass 2 reloads its first tile): their bytes are marked
        # unwritten, so a read of st that no thread wrote since is reported as a read of never-written bytes.
        dyn.init[:] = False
        for a in range(2):
            for k in range(2):
                l = lr[:, a, k].copy()
                l = (l + shfl_xor(l, 1, live)).astype(F32)
                l = (l + shfl_xor(l, 2, live)).astype(F32)
                o = 4 * ((((hf * 4 + wr) * 32 + lane) * 2 + a) * 2 + k) * 2  # byte address of o[0]
                dyn.write(tid, o, as_bytes_u32(mr[:, a, k].view(np.uint32)), 4, "st max store")
                dyn.write(tid, o + 4, as_bytes_u32(l.view(np.uint32)), 4, "st sum store")
                lr[:, a, k] = l
        syncthreads(live)
        il = np.zeros((T, 2, 2), F32)
        for a in range(2):
            for k in range(2):
                o = 4 * (((((1 - hf) * 4 + wr) * 32 + lane) * 2 + a) * 2 + k) * 2
                m1 = bytes_to_u32(dyn.read(tid, o, 4, 4, "st max load")).view(F32)[:, 0]
                l1 = bytes_to_u32(dyn.read(tid, o + 4, 4, 4, "st sum load")).view(F32)[:, 0]
                m0, l0 = mr[:, a, k], lr[:, a, k]
                mn = np.fmax(m0, m1)
                e0 = np.where(m0 != NEG_INF, (l0 * np.exp(((m0 - mn).astype(F32) * F32(lscale)).astype(F32))).astype(F32), F32(0))
                e1 = np.where(m1 != NEG_INF, (l1 * np.exp(((m1 - mn).astype(F32) * F32(lscale)).astype(F32))).astype(F32), F32(0))
                l = np.where(mn != NEG_INF, (e0 + e1).astype(F32), F32(0)).astype(F32)
                mr[:, a, k] = (-mn * F32(lscale)).astype(F32)  # pass 2's exponent offset
                il[:, a, k] = np.where(l > 0, (F32(1) / l).astype(F32), F32(0))
                # the pair and the row's four lanes agree on the row's statistics
                check((mn == shfl_xor(mn, 1)).all() and (mn == shfl_xor(mn, 2)).all(),
                      "merged row maximum differs over the row's four lanes")
        pair = (np.arange(T) + 128) % T  # the partner thread: warp (wr, 1 - hf), same lane
        check((mr == mr[pair]).all() and (il == il[pair]).all(),
              "the pair's merged statistics differ")
        syncthreads(live)

        # ---- pass 2
        gl_ = G if G < 8 else 8
        writer = ((lane >> 2) & (gl_ - 1)) == 0
        if M32_SPLIT:
            issue(0, 0)
        for t in range(ntiles):
            w0 = t * QP_BN
            buf = stage_tile(t)
            syncthreads(live)
            act = half_active(w0)
            if act.any() and G in (8, 16) and QP_TREE_SUM:
                full = t < full_tiles
                s = half_logits(w0, act, full, buf)
                tree_sum(s, act, full, w0, a_rows=(mr, il, mcr, ones_m), lane=lane, wr=wr, cb=cb,
                         lscale=lscale, b0=b0, nr=nr, gl=gl, h=h, G=G, where=f"block ({bx},{h}) tile {t}")
            elif act.any():
                full = t < full_tiles
                s = half_logits(w0, act, full, buf)
                for a in range(2):
                    for c in range(4):
                        for e in range(2):
                            s0, s1 = s[:, a, c, e], s[:, a, c, 2 + e]
                            p0 = p_value_m32(s0[act], mr[act, a, 0], il[act, a, 0], lscale, full)
                            p1 = p_value_m32(s1[act], mr[act, a, 1], il[act, a, 1], lscale, full)
                            p0, p1 = scatter_act(p0, act), scatter_act(p1, act)
                            t0, t1 = ones_m[:, a, 0].copy(), ones_m[:, a, 1].copy()
                            if G == 16:
                                p0 = (p0 + p1).astype(F32)
                                t0 = t0 + t1
                                off = 4
                                while off < 32:
                                    p0 = (p0 + shfl_xor(p0, off, act)).astype(F32)
                                    t0 = t0 + shfl_xor(t0, off, act)
                                    off <<= 1
                            else:
                                off = 4
                                while off < 4 * gl_:
                                    p0 = (p0 + shfl_xor(p0, off, act)).astype(F32)
                                    p1 = (p1 + shfl_xor(p1, off, act)).astype(F32)
                                    t0 = t0 + shfl_xor(t0, off, act)
                                    t1 = t1 + shfl_xor(t1, off, act)
                                    off <<= 1
                            w = w0 + cb + 8 * c + e
                            for k in range(2):
                                i = (wr * 32 + a * 16 + (lane >> 2) + 8 * k) // G
                                wrt = act & writer & (k == 0 or G < 16) & (w < mcr[:, a, k])
                                if not wrt.any():
                                    continue
                                iw = i[wrt]
                                check((iw < nr).all(), "s_out write for a block row past nr")
                                tags = (t0 if k == 0 else t1)[wrt]
                                want = ((np.arange(QP_BM)[None, :] // G) == iw[:, None]).astype(np.int64)
                                bad = (tags != want).any(1)
                                check(not bad.any(), f"block ({bx},{h}) tile {t}: s_out sum of row(s) "
                                      f"{iw[bad][:4].tolist()} (G = {G}) holds M-rows "
                                      f"{[np.nonzero(x)[0].tolist() for x in tags[bad][:2]]}")
                                store_out(gl, h, b0 + iw, w[wrt], (p0 if k == 0 else p1)[wrt])
            syncthreads(live)
    dyn.finish(f"block ({bx},{h})")
    stats['ps_max_byte'] = max(stats.get('ps_max_byte', -1), dyn.max_byte)
    return nbar[0]


def tree_sum(s, act, full, w0, a_rows, lane, wr, cb, lscale, b0, nr, gl, h, G, where):
    """Pass 2 of a tile at G = 16 or 8 with QP_TREE_SUM: per A tile a and sum n (G 16: one, v[2c + e] =
    p0 + p1, the lane's two heads of window w0 + cb + 8c + e; G 8: two, fragment row n's head alone),
    the transposing tree over lane bits 4, 3, 2 (keep half, send half, add), each lane writing the
    total of column q = lane/4 & 7 for block row (32 wr + 16 a + 8 n) / G. Each value carries its
    M-row tags (each of the row's G heads exactly once) and the sum and sum of squares of the windows
    added into it (all of them the window written)."""
    mr, il, mcr, ones_m = a_rows
    T = lane.size
    NS = 1 if G == 16 else 2
    bits = [((lane & 16) != 0, 4, 16), ((lane & 8) != 0, 2, 8), ((lane & 4) != 0, 1, 4)]
    q = (lane >> 2) & 7
    for a in range(2):
        for n in range(NS):
            v = np.zeros((T, 8), F32)
            tg = np.zeros((T, 8, QP_BM), np.int64)
            w1 = np.zeros((T, 8), np.int64)
            w2 = np.zeros((T, 8), np.int64)
            for c in range(4):
                for e in range(2):
                    s0, s1 = s[:, a, c, e], s[:, a, c, 2 + e]
                    p0 = scatter_act(p_value_m32(s0[act], mr[act, a, 0], il[act, a, 0], lscale, full), act)
                    p1 = scatter_act(p_value_m32(s1[act], mr[act, a, 1], il[act, a, 1], lscale, full), act)
                    j = 2 * c + e
                    if NS == 1:
                        v[:, j] = (p0 + p1).astype(F32)
                        tg[:, j] = ones_m[:, a, 0] + ones_m[:, a, 1]
                    else:
                        v[:, j] = p0 if n == 0 else p1
                        tg[:, j] = ones_m[:, a, n]
                    wc = (w0 + cb + 8 * c + e).astype(np.int64)
                    w1[:, j], w2[:, j] = (3 - NS) * wc, (3 - NS) * wc * wc  # heads in v[:, j]: 2 or 1
            for bit, half, off in bits:
                def fold(x):
                    b = bit.reshape((T,) + (1,) * (x.ndim - 1))
                    keep = np.where(b, x[:, half:2 * half], x[:, :half])
                    send = np.where(b, x[:, :half], x[:, half:2 * half])
                    return keep, shfl_xor(send, off, act)
                k_, r_ = fold(v)
                v = (k_ + r_).astype(F32)
                tg = sum(fold(tg))
                w1 = sum(fold(w1))
                w2 = sum(fold(w2))
            tot, ttag, t1, t2 = v[:, 0], tg[:, 0], w1[:, 0], w2[:, 0]
            w = w0 + cb + 8 * (q >> 1) + (q & 1)
            i = (wr * 32 + a * 16 + 8 * n) // G
            wrt = act & (w < mcr[:, a, n])
            if not wrt.any():
                continue
            iw, ww = i[wrt], w[wrt].astype(np.int64)
            check((iw < nr).all(), "s_out write for a block row past nr")
            want = ((np.arange(QP_BM)[None, :] // G) == iw[:, None]).astype(np.int64)
            bad = (ttag[wrt] != want).any(1)
            check(not bad.any(), f"{where}: tree sum of row(s) {iw[bad][:4].tolist()} holds M-rows "
                  f"{[np.nonzero(x)[0].tolist() for x in ttag[wrt][bad][:2]]}")
            badw = (t1[wrt] != G * ww) | (t2[wrt] != G * ww * ww)
            check(not badw.any(), f"{where}: tree sum written at window(s) {ww[badw][:4].tolist()} adds other windows")
            store_out(gl, h, b0 + iw, w[wrt], tot[wrt])


def run_kernel(q, H, kc, lens, hkv, D, w_stride, stride, ksize, rng):
    rows = lens.size
    G = H // hkv
    s_out = np.full(rows * hkv * w_stride, np.nan, F32)
    gl = Globals(q, H * D, kc, lens, s_out, rows, hkv, w_stride, D, stride, ksize)
    if KERNEL == "m32" and M32_SPLIT:
        mc = int(gl.mc_rows.max())
        gl.p_stride = mc + 5  # >= every row's Mc; not a multiple of 64, so a stride slip shows
        gl.parts = split_kc_parts(kc, mc, hkv, D, gl.p_stride)
    scale = F32(1.0) / F32(np.sqrt(F32(D)))  # Rust: 1.0 / (head_dim as f32).sqrt()
    gx = -(-rows // (QP_BM // G))
    stats = {}
    for h in range(hkv):
        for bx in range(gx):
            (simulate_block_m32 if KERNEL == "m32" else simulate_block)(bx, h, gl, H, stride, ksize, scale, rng, stats)
    return gl, stats


def reference(q_bits, H, kc, lens, hkv, D, stride, ksize):
    rows = lens.size
    G = H // hkv
    qf = bf_bits_to_f32(q_bits).astype(np.float64).reshape(rows, H, D)
    mc = sel_windows(lens, stride, ksize)
    M = int(mc.max())
    K = kc.astype(np.float64).reshape(-1, hkv, D)
    out = {}
    for b in range(rows):
        if mc[b] == 0:
            continue
        for h in range(hkv):
            acc = np.zeros(mc[b])
            for g in range(G):
                lg = K[:mc[b], h, :] @ qf[b, h * G + g] / np.sqrt(D)
                lg = np.exp(lg - lg.max())
                acc += lg / lg.sum()
            out[(b, h)] = acc
    return out, mc, M


def split_exactness_test(rng, n=2_000_000):
    mag = 10.0 ** rng.uniform(-3, 3, n)
    x = (mag * rng.choice([-1.0, 1.0], n)).astype(F32)
    x0, x1 = x[0::2], x[1::2]
    a, b, c = qp_split2(x0, x1)
    s0 = (bf2_lo(a) + bf2_lo(b) + bf2_lo(c)).astype(F32)  # f32 sums
    s1 = (bf2_hi(a) + bf2_hi(b) + bf2_hi(c)).astype(F32)
    ex0 = bf2_lo(a).astype(np.float64) + bf2_lo(b) + bf2_lo(c)  # exact sums in f64
    ex1 = bf2_hi(a).astype(np.float64) + bf2_hi(b) + bf2_hi(c)
    # also check RNE against an independent rounding (float64 -> nearest bf16 with ties even)
    hi_ref = f2bf_bits(x0)
    ok_f32 = (s0 == x0).all() and (s1 == x1).all()
    ok_exact = (ex0 == x0.astype(np.float64)).all() and (ex1 == x1.astype(np.float64)).all()
    ok_pack = ((a & 0xFFFF) == hi_ref).all() and ((a >> 16) == f2bf_bits(x1)).all()
    # tie check: 0x3F808000 (1.00390625) is a tie between 1.0 and 1.0078125 -> even: 1.0
    tie = f2bf_bits(np.array([np.uint32(0x3F808000)]).view(F32))[0] == 0x3F80
    tie2 = f2bf_bits(np.array([np.uint32(0x3F818000)]).view(F32))[0] == 0x3F82
    return ok_f32, ok_exact, ok_pack, tie and tie2


def run_shape(G, hkv, D, t0, n, seed, stride=16, ksize=32, label=None, lens=None):
    """Rows b = 0 .. n-1 with lens t0 + b + 1, or the given lens (then t0 is unused and n = lens.size)."""
    rng = np.random.default_rng(seed)
    H = G * hkv
    if lens is None:
        lens = (t0 + np.arange(n) + 1).astype(np.int32)
    n = lens.size
    mc = sel_windows(lens, stride, ksize)
    M = int(mc.max())
    w_stride = max(64, -(-M // 64) * 64)
    q = f2bf_bits(rng.normal(0, 1.5, n * H * D).astype(F32)).astype(np.uint16)
    kc = rng.normal(0, 1, max(M, 0) * hkv * D).astype(F32)  # exactly max Mc windows: OOB reads would fault
    LOG.errors.clear()
    gl, stats = run_kernel(q, H, kc, lens, hkv, D, w_stride, stride, ksize, rng)
    ref, mcr, _ = reference(q, H, kc, lens, hkv, D, stride, ksize)
    s = gl.s.reshape(n, hkv, w_stride)
    num = den = 0.0
    maxrel = 0.0
    for (b, h), r in ref.items():
        got = s[b, h, :mcr[b]].astype(np.float64)
        num += ((got - r) ** 2).sum()
        den += (r ** 2).sum()
        maxrel = max(maxrel, float(np.max(np.abs(got - r) / np.maximum(np.abs(r), 1e-30))))
    rel_l2 = np.sqrt(num / den) if den > 0 else 0.0
    # every (b, h, w < Mc(b)) written exactly once, nothing else
    want = np.zeros((n, hkv, w_stride), np.int64)
    for b in range(n):
        want[b, :, :mcr[b]] = 1
    wr = gl.written.reshape(n, hkv, w_stride)
    cover_ok = (wr == want).all()
    if not cover_ok:
        LOG.err(f"written-once map mismatch: {(wr != want).sum()} entries")
    # P tile region bound
    dyn_bytes = smem_bytes_m32(D) if KERNEL == "m32" else smem_bytes(D)
    name = label or f"G={G} hkv={hkv} D={D} t0={t0} n={n}"
    print(f"{name:42s} maxMc={M:4d} windows={int(mcr.sum())*hkv:7d} relL2={rel_l2:.3e} "
          f"max elem rel={maxrel:.3e} coverage={'ok' if cover_ok else 'BAD'} "
          f"q rows<= {gl.max_q_row} kc w<= {gl.max_kc_w} smem max byte {stats.get('ps_max_byte', -1)}/{dyn_bytes - 1} "
          f"errors={len(LOG.errors)}")
    for e in LOG.errors[:10]:
        print("   ERROR:", e)
    return rel_l2, list(LOG.errors)


def lens_mc(mcs, rng):
    """Row lengths with the given Mc (stride 16, ksize 32): Mc 0 -> lens 0..31, Mc m -> 32 + 16(m-1) + 0..15."""
    mcs = np.asarray(mcs, np.int64)
    return np.where(mcs > 0, 32 + 16 * (mcs - 1) + rng.integers(0, 16, mcs.size), rng.integers(0, 32, mcs.size)).astype(np.int32)


def consec(t0, n):  # a prefill chunk: row b sees t0 + b + 1 tokens
    return (t0 + np.arange(n) + 1).astype(np.int32)


_r = np.random.default_rng(7)
# (G, hkv, D, lens, label): Mc = (lens - 32) // 16 + 1 (0 below 32); R = 128 / G rows per block.
M32_SHAPES = [
    (4, 2, 64, consec(1100, 40), "G4 D64 Mc 67..70; 32+8 rows"),  # 2 tiles, the last one's second half empty
    (4, 1, 80, consec(2040, 40), "G4 D80 Mc 126..129; 32+8 rows"),  # block 0 max Mc 128 = 2*64 exactly, block 1 129 (3 tiles, 1 window)
    (4, 2, 128, np.concatenate([lens_mc([0] * 32, _r),  # block 0: every row Mc 0 (early return)
                                lens_mc([0, 1, 2, 31, 32, 33, 62, 5] * 4, _r),  # max 62: one tile, second half partly masked
                                lens_mc([96, 0, 17, 95, 3, 64, 1, 90, 0, 33, 96, 40], _r)]),  # partial, max 96 = 3*32
     "G4 D128 mixed Mc 0..96; 32+32+12 rows"),
    (8, 2, 64, consec(1050, 20), "G8 D64 Mc 64..65; 16+4 rows"),  # Mc 64 -> 65 inside block 0
    (8, 1, 80, consec(0, 50), "G8 D80 Mc 0..2; 16*3+2 rows"),  # block 0 all Mc 0; rows shorter than a window
    (8, 1, 128, consec(2200, 40), "G8 D128 Mc 136..139; 16+16+8 rows"),  # 3 tiles, last second half empty
    (8, 2, 64, lens_mc([0, 1, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 5, 0, 17, 150, 0, 0, 3], _r),
     "G8 D64 mixed Mc 0..150; 16+3 rows"),  # a row of Mc 0 / 1 in a block of 3 tiles
    (16, 2, 64, consec(1000, 20), "G16 D64 Mc 61..62; 8+8+4 rows"),  # < 64: one tile, second half partial
    (16, 1, 80, consec(500, 13), "G16 D80 Mc 30..31; 8+5 rows"),  # < 32: every second half empty
    (16, 2, 128, consec(20, 20), "G16 D128 Mc 0..1; 8+8+4 rows"),  # block 0 Mc 0 (early return), block 1 mixed
    (16, 1, 128, consec(3080, 24), "G16 D128 Mc 191..193; 8+8+8 rows"),  # max Mc 192 = 3*64 (blocks 0, 1), 193
    (16, 2, 64, consec(3080, 20), "G16 D64 Mc 191..193; 8+8+4 rows"),  # full tiles in a last block of 4 rows
    (16, 1, 80, lens_mc([0, 200, 1, 64, 32, 0, 31, 100, 65, 0, 2], _r), "G16 D80 mixed Mc 0..200; 8+3 rows"),
    (4, 3, 128, consec(3990, 70), "G4 D128 hkv 3 Mc 248..252; 32+32+6 rows"),  # 4 tiles
    (4, 1, 64, lens_mc(_r.choice([0, 1, 31, 32, 33, 63, 64, 65, 96, 128], 45), _r), "G4 D64 random Mc 0..128; 32+13"),
    (8, 2, 80, lens_mc(_r.integers(0, 260, 40), _r), "G8 D80 random Mc 0..259; 16+16+8 rows"),
    (16, 3, 64, lens_mc(_r.integers(0, 130, 20), _r), "G16 D64 hkv 3 random Mc 0..129; 8+8+4"),
]


if __name__ == "__main__":
    if "--parts" in sys.argv:
        NP = int(sys.argv[sys.argv.index("--parts") + 1])
        assert NP in (2, 3), "--parts 2 or 3"
    if "--kernel" in sys.argv:
        KERNEL = sys.argv[sys.argv.index("--kernel") + 1]
        assert KERNEL in ("qa", "m32", "m32s"), "--kernel qa|m32|m32s"
        assert not (KERNEL == "m32" and "--parts" in sys.argv), "the m32 kernel has three parts only"
        if KERNEL == "m32s":
            KERNEL, M32_SPLIT, M32S_NP = "m32", True, NP if "--parts" in sys.argv else 2
    rng = np.random.default_rng(1)
    print("split hi+mid+lo == x  (f32 sum, exact sum, pack halves, RNE ties):", split_exactness_test(rng))
    if "--no-full-tiles" in sys.argv:
        QP_FULL_TILES = 0
    if "--no-tree-sum" in sys.argv:
        QP_TREE_SUM = 0
    if KERNEL == "m32":
        worst = 0.0
        allerr = []
        for i, (G, hkv, D, lens, label) in enumerate(M32_SHAPES):
            r, e = run_shape(G, hkv, D, None, lens.size, seed=200 + i, label=label, lens=lens)
            worst = max(worst, r)
            allerr += e
        what = f"m32s, {M32S_NP} parts, {m32_buffers()} buffers" if M32_SPLIT else "m32"
        print(f"{what}: worst relL2 {worst:.3e}; total errors {len(allerr)}")
        sys.exit(1 if allerr or worst > (1e-4 if M32_SPLIT and M32S_NP == 2 else 1e-5) else 0)
    shapes = [
        (3, 2, 64, 0, 20), (8, 2, 80, 17, 64), (16, 2, 128, 1000, 100), (4, 8, 128, 3990, 37),
        (4, 2, 128, 0, 200),
    ]
    extra = [
        (3, 2, 64, 20, 50),     # R = 42 (126 of 128 M-rows), block 0 mixing Mc = 0 and Mc > 0
        (5, 1, 80, 40, 30),     # R = 25, 125 M-rows; a last block of 5 rows (25 M-rows: warps 2-7 idle)
        (1, 2, 64, 1100, 140),  # G = 1, R = 128, two row blocks (128 + 12 rows), 2 tiles
        (64, 1, 128, 200, 3),   # G = 64, R = 2; last block 1 row (warps 4-7 without M-rows)
        (2, 3, 80, 1050, 10),   # Mc crosses a tile edge inside one block (64 -> 65)
        (7, 2, 128, 31, 20),    # R = 18 (126 M-rows); first row has Mc = 1
    ]
    worst = 0.0
    allerr = []
    for i, sh in enumerate(shapes + extra):
        r, e = run_shape(*sh, seed=100 + i)
        worst = max(worst, r)
        allerr += e
    print(f"worst relL2 {worst:.3e}; total errors {len(allerr)}")
    sys.exit(1 if allerr or worst > (1e-5 if NP == 3 else 1e-4) else 0)

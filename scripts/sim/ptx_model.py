"""What the prefill kernels' lane-level simulations (attn_prefill_sim.py, qa_prefill_sim.py) model
alike: exact bf16 conversions and bf16x2 registers, the lane index maps of mma.m16n8k16 .bf16
fragments (PTX ISA, warp-level matrix fragments; checked to be bijective on import), the batched
mma model (products exact, summed in f64 with C, rounded to f32 once) and the ldmatrix row address
of kernels/mma.cuh's K operand. Change it with the PTX the kernels use.
"""
import numpy as np

F32 = np.float32
F64 = np.float64


def f2bf_bits(x):
    """f32 -> bf16 bits, round to nearest even (f2bf / cvt.rn.bf16 for finite x); NaN stays NaN."""
    u = np.asarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = np.where(nan, ((u >> 16) | 0x40) & 0xFFFF, r)
    return r.astype(np.uint32)


def bf_bits_to_f32(b):
    return (np.asarray(b, dtype=np.uint32) << 16).astype(np.uint32).view(F32)


def pack_bf2_rn(lo, hi):
    """cvt.rn.bf16x2.f32 with a = hi, b = lo: {bf16(hi) upper, bf16(lo) lower}."""
    return ((f2bf_bits(hi) << 16) | f2bf_bits(lo)).astype(np.uint32)


def bf2_lo(x):
    return (np.asarray(x, np.uint32) << 16).astype(np.uint32).view(F32)


def bf2_hi(x):
    return (np.asarray(x, np.uint32) & np.uint32(0xFFFF0000)).astype(np.uint32).view(F32)


def bytes_to_u32(b):
    return np.ascontiguousarray(b).view('<u4').reshape(b.shape[0], b.shape[1] // 4)


_L = np.arange(32)
# Index maps of mma.m16n8k16 .bf16 fragments (PTX ISA, warp-level matrix fragments), over lanes.
_g, _t = _L >> 2, _L & 3
A_ROW = np.zeros((32, 4, 2), int)
A_COL = np.zeros((32, 4, 2), int)
for _r in range(4):
    for _e in range(2):
        _i = 2 * _r + _e
        A_ROW[:, _r, _e] = _g if (_i < 2 or 4 <= _i < 6) else _g + 8
        A_COL[:, _r, _e] = _t * 2 + (_i & 1) + (8 if _i >= 4 else 0)
B_ROW = np.zeros((32, 2, 2), int)
B_COL = np.zeros((32, 2, 2), int)
for _r in range(2):
    for _e in range(2):
        _i = 2 * _r + _e
        B_ROW[:, _r, _e] = _t * 2 + (_i & 1) + (8 if _i >= 2 else 0)
        B_COL[:, _r, _e] = _g
C_ROW = np.zeros((32, 4), int)
C_COL = np.zeros((32, 4), int)
for _i in range(4):
    C_ROW[:, _i] = _g if _i < 2 else _g + 8
    C_COL[:, _i] = _t * 2 + (_i & 1)


def _bijective():
    a = np.zeros((16, 16), int)
    np.add.at(a, (A_ROW.ravel(), A_COL.ravel()), 1)
    b = np.zeros((16, 8), int)
    np.add.at(b, (B_ROW.ravel(), B_COL.ravel()), 1)
    c = np.zeros((16, 8), int)
    np.add.at(c, (C_ROW.ravel(), C_COL.ravel()), 1)
    assert (a == 1).all() and (b == 1).all() and (c == 1).all()


_bijective()


def mma_bf16_x(c, a, b0, b1):
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for every warp and X independent products:
    c (T, X, 4) f32, a (T, X, 4) u32, b0, b1 (T, X) u32 -> new c (products exact, summed in f64 with c,
    rounded to f32 once)."""
    T, X = c.shape[0], c.shape[1]
    nw = T // 32

    def lanes(v):  # (T, X, ...) -> (nw, X, 32, ...)
        return np.swapaxes(v.reshape((nw, 32) + v.shape[1:]), 1, 2)

    alo = bf2_lo(a).astype(F64)
    ahi = bf2_hi(a).astype(F64)
    A = np.zeros((nw, X, 16, 16))
    A[:, :, A_ROW[:, :, 0], A_COL[:, :, 0]] = lanes(alo)
    A[:, :, A_ROW[:, :, 1], A_COL[:, :, 1]] = lanes(ahi)
    bb = np.stack([b0, b1], -1)
    B = np.zeros((nw, X, 16, 8))
    B[:, :, B_ROW[:, :, 0], B_COL[:, :, 0]] = lanes(bf2_lo(bb).astype(F64))
    B[:, :, B_ROW[:, :, 1], B_COL[:, :, 1]] = lanes(bf2_hi(bb).astype(F64))
    Cm = np.zeros((nw, X, 16, 8))
    Cm[:, :, C_ROW, C_COL] = lanes(c.astype(F64))
    Dm = Cm + A @ B
    return np.swapaxes(Dm[:, :, C_ROW, C_COL], 1, 2).reshape(T, X, 4).astype(F32)


def ldsm_k_lane(l, rs):  # kernels/mma.cuh
    return ((l & 7) + (l >> 4) * 8) * rs + ((l >> 3) & 1) * 8

"""What the prefill kernels' lane-level simulations (attn_prefill_sim.py, qa_prefill_sim.py) model
alike: exact bf16 conversions and bf16x2 registers, the lane index maps of mma.m16n8k16 .bf16
fragments (PTX ISA, warp-level matrix fragments; checked to be bijective on import), the batched
mma model (products exact, summed in f64 with C, rounded to f32 once) and the ldmatrix row address
of kernels/mma.cuh's K operand; and shared memory (SharedMem: bounds, alignment, never-written
bytes and races per barrier epoch, atomics, cp.async copies that land when their group is waited
for), reporting to one error log (LOG, check). Change it with the PTX the kernels use.
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


def bytes_to_u64(b):
    return np.ascontiguousarray(b).view('<u8').reshape(b.shape[0], b.shape[1] // 8)


def as_bytes(v, dt):
    v = np.ascontiguousarray(np.asarray(v).astype(dt))
    return v.view(np.uint8).reshape(v.shape[0], -1)


# ---------------------------------------------------------------- error log
class Log:
    """The simulation's errors: the first 200 messages kept, all of them counted."""

    def __init__(self):
        self.errors = []
        self.count = 0

    def err(self, msg):
        self.count += 1
        if len(self.errors) < 200:
            self.errors.append(msg)


LOG = Log()


def check(cond, msg):
    """Log msg unless cond holds; returns cond."""
    if not cond:
        LOG.err(msg)
    return cond


# ---------------------------------------------------------------- shared memory model
class SharedMem:
    """Byte-addressed shared memory with bounds / alignment / never-written / race checks per barrier
    epoch, atomics, and cp.async copies that land only when their group is waited for."""

    def __init__(self, nbytes, name, rng, threads):
        self.n = nbytes
        self.name = name
        self.threads = threads
        self.mem = rng.integers(0, 256, nbytes, dtype=np.uint8)  # garbage, as on a GPU
        self.init = np.zeros(nbytes, bool)
        self.nw = -(-threads // 64)  # u64 thread-bitmask words per byte
        self.wmask = np.zeros((nbytes, self.nw), np.uint64)  # writers in this barrier epoch
        self.rmask = np.zeros((nbytes, self.nw), np.uint64)  # readers in this barrier epoch
        self.amask = np.zeros((nbytes, self.nw), np.uint64)  # atomic accessors in this barrier epoch
        self.pend = np.zeros(nbytes, np.int32)  # cp.async copies issued into each byte, not landed
        self.pending = []  # [tids, addrs, data (n, w), group (n,)] per cp.async call, rows not landed
        self.ccount = np.zeros(threads, np.int64)  # committed cp.async groups per thread
        self.max_byte = -1
        self.copies = 0

    def barrier(self):
        self.wmask[:] = 0
        self.rmask[:] = 0
        self.amask[:] = 0

    def _idx(self, tids, addrs, width, align, what):
        addrs = np.asarray(addrs, np.int64).ravel()
        tids = np.asarray(tids, np.int64).ravel()
        if addrs.size == 0:
            return None
        bad = addrs % align != 0
        check(not bad.any(), f"{self.name}: misaligned {what} ({width} B, align {align}) at byte {addrs[bad][:4]}")
        oob = (addrs < 0) | (addrs + width > self.n)
        check(not oob.any(), f"{self.name}: out-of-bounds {what} at byte {addrs[oob][:4]} (size {self.n})")
        if oob.any():
            raise RuntimeError(f"{self.name}: shared OOB ({what})")
        self.max_byte = max(self.max_byte, int((addrs + width - 1).max()))
        if not check(((tids >= 0) & (tids < self.threads)).all(), f"{self.name}: thread id out of range ({what})"):
            raise RuntimeError("thread id out of range")
        idx = addrs[:, None] + np.arange(width)[None, :]
        word = np.broadcast_to((tids >> 6)[:, None], idx.shape)
        bit = np.broadcast_to((np.uint64(1) << (tids & 63).astype(np.uint64))[:, None], idx.shape)
        return idx, word, bit

    def _others(self, mask, idx, word, bit):
        """Per byte: does any thread other than the accessing one hold a bit in mask?"""
        m = mask[idx]  # (..., nw)
        own = word[..., None] == np.arange(self.nw)
        m = np.where(own, m & ~bit[..., None], m)
        return (m != 0).any(-1)

    def _mark(self, mask, idx, word, bit):
        np.bitwise_or.at(mask, (idx.ravel(), word.ravel()), bit.ravel())

    def write(self, tids, addrs, data, align, what):
        r = self._idx(tids, addrs, data.shape[1], align, what)
        if r is None:
            return
        idx, word, bit = r
        self._mark(self.wmask, idx, word, bit)
        waw = self._others(self.wmask, idx, word, bit)
        war = self._others(self.rmask, idx, word, bit)
        ata = self._others(self.amask, idx, word, bit)
        pen = self.pend[idx] > 0
        check(not waw.any(), f"{self.name}: write-write race in one barrier epoch ({what}) at bytes {idx[waw][:4]}")
        check(not war.any(), f"{self.name}: read-then-write race in one barrier epoch ({what}) at bytes {idx[war][:4]}")
        check(not ata.any(), f"{self.name}: atomic/plain-write race in one barrier epoch ({what}) at bytes {idx[ata][:4]}")
        check(not pen.any(), f"{self.name}: {what} into bytes a pending cp.async still targets, at {idx[pen][:4]}")
        self.mem[idx] = data
        self.init[idx] = True

    def read(self, tids, addrs, width, align, what):
        r = self._idx(tids, addrs, width, align, what)
        if r is None:
            return np.zeros((0, width), np.uint8)
        idx, word, bit = r
        self._mark(self.rmask, idx, word, bit)
        raw = self._others(self.wmask, idx, word, bit)
        ata = self._others(self.amask, idx, word, bit)
        check(not raw.any(), f"{self.name}: write-then-read race in one barrier epoch ({what}) at bytes {idx[raw][:4]}")
        check(not ata.any(), f"{self.name}: atomic/plain-read race in one barrier epoch ({what}) at bytes {idx[ata][:4]}")
        pen = self.pend[idx] > 0
        check(not pen.any(), f"{self.name}: {what} of bytes whose cp.async has not been waited for, at {idx[pen][:4]}")
        un = ~self.init[idx]
        check(not un.any(), f"{self.name}: read of never-written bytes ({what}) at {idx[un][:4]}")
        return self.mem[idx].copy()

    def atomic_or_u64(self, tids, addrs, vals, what):
        r = self._idx(tids, addrs, 8, 8, what)
        if r is None:
            return
        idx, word, bit = r
        self._mark(self.amask, idx, word, bit)
        for mask, kind in ((self.wmask, "plain-write/atomic"), (self.rmask, "plain-read/atomic")):
            bad = self._others(mask, idx, word, bit)
            check(not bad.any(), f"{self.name}: {kind} race in one barrier epoch ({what}) at bytes {idx[bad][:4]}")
        pen = self.pend[idx] > 0
        check(not pen.any(), f"{self.name}: {what} on bytes a pending cp.async targets")
        un = ~self.init[idx]
        check(not un.any(), f"{self.name}: {what} reads never-written bytes at {idx[un][:4]}")
        addrs = np.asarray(addrs, np.int64).ravel()
        uniq, inv = np.unique(addrs, return_inverse=True)
        acc = np.zeros(uniq.size, np.uint64)
        np.bitwise_or.at(acc, inv, np.asarray(vals, np.uint64).ravel())
        ui = uniq[:, None] + np.arange(8)[None, :]
        old = bytes_to_u64(self.mem[ui])[:, 0]
        self.mem[ui] = as_bytes(old | acc, '<u8')

    def cp_async(self, tids, addrs, data, what):
        """cp.async of data (n, width) by thread tids[i] to addrs[i], in the thread's open group."""
        width = data.shape[1]
        tids = np.asarray(tids, np.int64).ravel()
        addrs = np.asarray(addrs, np.int64).ravel()
        r = self._idx(tids, addrs, width, width, what)
        if r is None:
            return
        idx, word, bit = r
        war = self._others(self.rmask, idx, word, bit)
        waw = self._others(self.wmask, idx, word, bit)
        ata = self._others(self.amask, idx, word, bit)
        check(not war.any(), f"{self.name}: {what} issued into bytes another thread read in this barrier epoch "
                             f"(it may land at once: race) at bytes {idx[war][:4]}")
        check(not waw.any(), f"{self.name}: {what} issued into bytes another thread wrote in this barrier epoch "
                             f"at bytes {idx[waw][:4]}")
        check(not ata.any(), f"{self.name}: {what} issued into bytes accessed atomically in this epoch")
        pen = self.pend[idx] > 0
        check(not pen.any(), f"{self.name}: {what} issued into bytes another pending cp.async targets, at {idx[pen][:4]}")
        u, c = np.unique(idx.ravel(), return_counts=True)
        check((c == 1).all(), f"{self.name}: two copies of one {what} call target the same bytes {u[c > 1][:4]}")
        np.add.at(self.pend, idx.ravel(), 1)
        self.pending.append([tids, addrs, np.ascontiguousarray(data), self.ccount[tids].copy()])
        self.copies += tids.size

    def commit(self, tids):
        self.ccount[tids] += 1

    def wait_group(self, tids, n, what):
        """cp.async.wait_group n by threads tids: their groups older than the n most recent land."""
        waiting = np.zeros(self.threads, bool)
        waiting[tids] = True
        keep = []
        for ent in self.pending:
            t, a, d, g = ent
            land = waiting[t] & (g < self.ccount[t] - n)
            if land.any():
                w = d.shape[1]
                li = a[land][:, None] + np.arange(w)[None, :]
                np.add.at(self.pend, li.ravel(), -1)
                self.write(t[land], a[land], d[land], w, f"landing of a cp.async ({what})")
            if (~land).any():
                keep.append([t[~land], a[~land], d[~land], g[~land]])
        self.pending = keep

    def finish(self, what):
        n = sum(e[0].size for e in self.pending)
        check(n == 0, f"{self.name}: {n} cp.async copies still pending when the block exits ({what})")

#!/usr/bin/env python3
"""Lane-level simulation of kernels/attn_prefill.cu, to check the kernel without a GPU: the tensor-core
prefill attention, dense (attn_prefill_d{64,80,128}) and block-sparse (attn_prefill_sparse_d{64,80,128}),
and prefill_sel_union, the kernel that builds the per-(tile, KV head) union lists the sparse kernel walks.
It re-implements the kernels step by step (and the host's prefill_tiles / prefill_union_capacity /
shared-memory sizes of src/cuda/ops/prefill_attention.rs): change it with the kernel or the host.

Run: .venv/bin/python scripts/sim/attn_prefill_sim.py [--stages 0|2|3] [--mode dense|sparse]
     [--d 64|80|128] [--seed N] [--selftest [--only MUTATION]]
(numpy; scripts/fixture.sh installs it in .venv). Without options every stage variant and both modes run
over the case lists below, each case at its own D: 39 lines, about 35 s (--d 128 longer); --stages
(repeatable) / --mode restrict the sweep, --d runs every case at that head dim. --selftest (about 2 s)
injects each deliberate kernel bug of MUTATIONS (a copy into the stage being computed, a wait one group
short, a copy issued before the barrier, the PF_STAGES=0 variant's second barrier dropped, shared memory
sized for 2 stages, no zero-fill, an off-by-one causal mask, a union keeping future blocks, the bias read
from the wrong stage) into a small case and fails unless every one is caught: run it after changing the
checks.
--stages 0 is the kernel compiled with -DPF_STAGES=0 (two stages, two __syncthreads per key tile); 2 (the
default, no option) or 3 is PF_STAGES=2|3 (one barrier per key tile, the next copy issued after it into the
stage every warp finished). One line per case with its relative L2; exit 1 on any error or a relative L2
above 1e-2 (all outputs of the case) or above 2e-2 for any one (row, query head).

Blocks of PF_THREADS = 128 threads (PF_WARPS = 4 warps, warp w owning the M-rows m0 + 16w .. +15 of
its tile; the kernel's #defines, copied below), every block of the grid (tiles, hkv) simulated with its
threads held as numpy vectors indexed by tid (lane = tid & 31, warp = tid >> 5); warp-collective
instructions (ldmatrix.x4 and .x4.trans, mma.sync.m16n8k16 bf16 -> f32, shfl.xor / shfl.up, any.sync)
simulated per warp from the per-lane registers with the PTX ISA fragment layouts, and checked to be
executed by whole warps (the kernel's warp-uniform branches). Shared memory is a byte array with the
kernel's exact layout: the dynamic window Ks [S][64][D+8] bf16, Vs [S][64][D+8], then (sparse) Bs [S][64]
f32, S = the stage count, sized by the host's formula (prefill_smem_bytes_at / prefill_sparse_smem_bytes_at,
so a kernel that outgrows what the host gives reads out of bounds here); the static pf_kmax[4] apart; the
union kernel's tab[2048] u64, rq[64], rn[64], wsum[8]. Every shared access is checked for bounds,
alignment, reads of never-written bytes and cross-thread races inside one barrier epoch (atomicOr on tab:
atomics do not race each other, but do race plain accesses). Barriers check that all threads arrive.

cp.async: cp.async.cg 16 B (K, V rows) and cp.async.ca 4 B (bias) copies carry their data from issue
(zero-fill when the source size is 0) but land in shared memory only when the issuing thread's
cp.async.wait_group N completes their group (groups complete in commit order: wait_group N completes all
but the N most recent committed groups of that thread; uncommitted copies are never waited for). Until
then the bytes are pending: any shared read of them (by any thread, the issuer included) is an error, as
is another copy or store into them. Issuing a copy into bytes another thread read or wrote in the same
barrier epoch is a race (the copy may land at once); a landed copy is a write of the issuing thread in
the epoch of its wait, so a read by another thread before the next barrier is a race too. A copy still
pending when the block exits is an error.

Global memory: q, K/V caches (bf16 [len, hkv, D] per sequence, exactly len tokens, so a read past the
sequence faults), bias c (f32 [len, hkv]), lens, tiles, sel/nsel, ublk/umask/un: every read checked for
bounds and alignment, K/V/c reads for keys <= the tile's kmax, ublk/umask reads for entries < un; every
output u32 store for alignment and a valid (row, query head of the block's KV head); every output element
written exactly once, the row padding never. prefill_sel_union's lists are compared with the union built
in Python (ids ascending, row masks), its count checked <= u_max (the host's capacity).

Checks against a float64 reference of the same attention (bf16 Q/K/V, f32 bias; row at position p, query
head g, KV head g / G: dense keys 0 .. p; sparse the tokens j <= p of the blocks the row's list selected
for its KV head, logit q.k*scale + c[j, h] with the bias): relative L2 over the case, and per (row, head).
Besides, the set of (row, head, key) whose P the kernel made non-zero must be exactly the reference's
(each key once): a key attended twice, or a masked key let through, fails even if the L2 would not show it.
Arithmetic modelled: mma products exact, summed in f64 with C and rounded to f32 once per mma (the tensor
core's internal order is not modelled); ex2.approx.ftz as exact 2^x rounded to f32, results below 2^-126
flushed; FMAs rounded once (via f64); f32 elsewhere.

Cases: GQA groups G in {3, 8, 16} (H = G * hkv, hkv 1 or 2); prompts shorter than a block (20, 30
tokens), just past a 16-token boundary (33, 65), chunks at T0 > 0 over several blocks, two sequences
(runs) in one call, a row split over two tiles (G = 3), a warp whose rows end before the tile's last key
tile (dense: it skips that tile), tiles whose last warps have empty M-rows; sparse: random per-row,
per-KV-head block lists (always the current block; some blocks popular, so whole warps select them and
the unmasked path runs), with and without bias (NOSA / InfLLM-V2), lists with -1 entries and a block
past the row's current one (skipped), s_max past every list's length, a (tile, KV head) whose rows
selected nothing (un = 0: no key tile, output 0), a 131,120-token context (block ids past
PF_UNION_CHUNK = 2048: two union passes), and block sizes 128 (two key tiles per block; the last block's
second tile past every row: no warp computes it), 32 (half a tile) and 256 (four key tiles a block; rows
whose warps end at different key tiles of the last block). Block sizes other than 64, -1 / future ids and
empty lists are the kernels' generic paths (the runtime selects 64-token blocks, always with the row's
current block).
"""
import argparse
import sys
import time

import numpy as np

from ptx_model import (LOG, SharedMem as Shared, as_bytes, bf2_hi, bf2_lo, bf_bits_to_f32, bytes_to_u32, bytes_to_u64, check,
                       f2bf_bits, ldsm_k_lane, mma_bf16_x, pack_bf2_rn)

F32 = np.float32
F64 = np.float64
NEG_INF = F32(-np.inf)

# kernels/attn_prefill.cu #defines
PF_BM, PF_BN, PF_WARPS, PF_PAD = 64, 64, 4, 8
PF_THREADS = 32 * PF_WARPS
PF_UNION_CHUNK, PF_UNION_THREADS = 2048, 256
LOG2E = F32(1.4426950408889634)
assert PF_BM == 16 * PF_WARPS

# --selftest: deliberate kernel bugs the checks must catch (MUT holds the one being injected)
MUTATIONS = {
    "stage_same": "PF_STAGES: the next tile's copy issued into the stage being computed (st, not st - 1)",
    "wait_late": "PF_STAGES: cp.async.wait_group PF_STAGES - 1 (tile t not waited for)",
    "issue_before_barrier": "PF_STAGES: the next tile's copy issued before the tile's __syncthreads",
    "no_second_barrier": "PF_STAGES=0: the trailing __syncthreads of a key tile dropped",
    "smem_2stages": "the host sizes shared memory for 2 stages whatever PF_STAGES",
    "no_zero_fill": "copies of keys past the tile's range skipped instead of zero-filled",
    "causal_off_by_one": "causal mask j >= pos instead of j > pos",
    "union_no_rq_skip": "prefill_sel_union keeps block ids past the row's current block",
    "bias_stage0": "sparse: the bias read from stage 0 whatever the stage",
}
MUT = set()


# ---------------------------------------------------------------- host formulas (prefill_attention.rs)
def prefill_smem_bytes_at(d, stages):
    return 2 * stages * PF_BN * (d + 8) * 2


def prefill_sparse_smem_bytes_at(d, stages):
    return prefill_smem_bytes_at(d, stages) + stages * PF_BN * 4


def prefill_tiles(rows, group):
    """rows: [(seq, pos)] in row order -> flat i32 list of (r0, nrows, m0) triples, longest context first."""
    assert rows and group > 0
    tiles = []
    r0 = 0
    while r0 < len(rows):
        seq, pos0 = rows[r0]
        n = 1
        while r0 + n < len(rows) and rows[r0 + n] == (seq, pos0 + n):
            n += 1
        entries = n * group
        for m0 in range(0, entries, PF_BM):
            last = min(m0 + PF_BM, entries) - 1
            tiles.append((pos0 + last // group, r0, n, m0))
        r0 += n
    tiles.sort(key=lambda t: -t[0])  # stable, as sort_by_key(Reverse)
    out = []
    for _, r0, n, m0 in tiles:
        out += [r0, n, m0]
    return np.array(out, np.int32)


def prefill_tile_rows(tile, group):
    r0, n, m0 = int(tile[0]), int(tile[1]), int(tile[2])
    mend = max(min(m0 + PF_BM, n * group), m0 + 1)
    return r0 + m0 // group, (mend - 1) // group - m0 // group + 1


def prefill_union_capacity(rows, tiles, group, s_max, block_size):
    cap = 1
    for t in tiles.reshape(-1, 3):
        first, count = prefill_tile_rows(t, group)
        last = rows[first + count - 1]
        blocks = last[1] // block_size + 1
        cap = max(cap, min(blocks, count * s_max))
    return cap


# ---------------------------------------------------------------- f32 arithmetic (bf16: ptx_model.py)
def ex2_ftz(x):
    """ex2.approx.ftz.f32: 2^x (modelled exact, rounded to f32), results below 2^-126 flushed to 0."""
    y = np.exp2(np.asarray(x, F32).astype(F64)).astype(F32)
    return np.where(np.abs(y) < F32(2.0 ** -126), F32(0), y).astype(F32)


def fma32(a, b, c):
    """fmaf: a*b exact in f64 (f32 operands), one f64 rounding of the sum, then f32."""
    return (np.asarray(a, F32).astype(F64) * np.asarray(b, F32).astype(F64) + np.asarray(c, F32).astype(F64)).astype(F32)


# ---------------------------------------------------------------- warp collectives
_L = np.arange(32)


def shfl_xor(v, m):
    tid = np.arange(v.shape[0])
    return v[(tid & ~31) | ((tid & 31) ^ m)]


def shfl_up(v, o):
    """__shfl_up_sync(FULL_MASK, v, o): lanes < o get their own value."""
    tid = np.arange(v.shape[0])
    lane = tid & 31
    return v[np.where(lane >= o, tid - o, tid)]


def any_sync(pred):
    """__any_sync(FULL_MASK, pred) per warp, broadcast to the warp's threads."""
    return np.repeat(pred.reshape(-1, 32).any(1), 32)


def warp_uniform(x, act, what):
    """x (threads,) must be equal over each active warp's threads (the kernel's warp-uniform branches)."""
    xw = np.asarray(x).reshape(-1, 32)
    aw = act.reshape(-1, 32)
    ok = ((xw == xw[:, :1]).all(1) | ~aw.any(1)).all()
    check(ok, f"{what}: not warp-uniform")
    return ok


def whole_warps(act, what):
    aw = act.reshape(-1, 32)
    check((aw.all(1) | ~aw.any(1)).all(), f"{what} executed by part of a warp (.sync.aligned / FULL_MASK)")


def ldmatrix_x4(sh, tid, addr, act, trans, what):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 by the active warps, X loads per thread:
    addr (T, X) byte addresses (lanes 8i .. 8i+7 give rows 0 .. 7 of matrix i). Returns (T, X, 4) u32:
    register i of lane L = non-trans: elements 2(L%4), +1 of row L/4 of matrix i; trans: element L/4 of
    rows 2(L%4) (low half) and 2(L%4)+1 (high half) of matrix i. Inactive threads get 0."""
    whole_warps(act, what)
    T, X = addr.shape
    rows = np.zeros((T, X, 16), np.uint8)
    if act.any():
        ta = np.repeat(tid[act], X)
        rows[act] = sh.read(ta, addr[act].ravel(), 16, 16, what).reshape(-1, X, 16)
    lane = tid & 31
    base = tid & ~31
    out = np.zeros((T, X, 4), np.uint32)
    if not trans:
        words = rows.view('<u4')  # (T, X, 4)
        for i in range(4):
            src = base + 8 * i + (lane >> 2)
            out[:, :, i] = words[src, :, lane & 3]
    else:
        halves = rows.view('<u2').astype(np.uint32)  # (T, X, 8)
        for i in range(4):
            src = base + 8 * i + 2 * (lane & 3)
            lo = halves[src, :, lane >> 2]
            hi = halves[src + 1, :, lane >> 2]
            out[:, :, i] = lo | (hi << 16)
    out[~act] = 0
    return out


def ldsm_v_lane(l, rs):
    return ((l & 7) + ((l >> 3) & 1) * 8) * rs + (l >> 4) * 8


# ---------------------------------------------------------------- global memory of one launch
class Launch:
    """The inputs of one case (host side) and the device buffers the kernels read and write."""

    def __init__(self, case, D, mode, rng):
        self.D = D
        self.sparse = mode == "sparse"
        self.G, self.hkv = case["G"], case["hkv"]
        self.H = self.G * self.hkv
        self.bs = case.get("bs", 64)
        self.bias = self.sparse and case.get("bias", True)
        hkv = self.hkv
        # sequences: (len, rows): rows at positions len - rows .. len - 1
        self.K, self.V, self.C = [], [], []
        self.rows = []  # (seq, pos)
        for s, (ln, n) in enumerate(case["seqs"]):
            assert 1 <= n <= ln
            self.K.append(f2bf_bits(rng.normal(0, 1, ln * hkv * D).astype(F32)).astype(np.uint16))
            self.V.append(f2bf_bits(rng.normal(0, 1, ln * hkv * D).astype(F32)).astype(np.uint16))
            self.C.append(rng.normal(0, 1, ln * hkv).astype(F32) if self.bias else None)
            self.rows += [(s, t) for t in range(ln - n, ln)]
        self.nrows = len(self.rows)
        self.lens = np.array([t + 1 for _, t in self.rows], np.int32)
        self.kseq = np.array([s for s, _ in self.rows], np.int64)  # kptr[r] / vptr[r] / cptr[r]: the row's cache
        self.q_stride = self.H * D + 16
        self.out_stride = self.H * D + 8
        self.q = np.zeros(self.nrows * self.q_stride, np.uint16)
        for r in range(self.nrows):
            self.q[r * self.q_stride:r * self.q_stride + self.H * D] = \
                f2bf_bits(rng.normal(0, case.get("qsd", 1.5), self.H * D).astype(F32))
        self.scale = F32(1.0) / F32(np.sqrt(F32(D)))  # Rust: 1.0 / (head_dim as f32).sqrt()
        self.out = np.full(self.nrows * self.out_stride, 0x7FC1, np.uint16)
        self.written = np.zeros(self.out.size, np.int64)
        self.tiles = prefill_tiles(self.rows, self.G)
        self.ntiles = self.tiles.size // 3
        self.lists = None
        if self.sparse:
            self._make_selection(case, rng)

    def _make_selection(self, case, rng):
        """Per row and KV head a random ascending list of its existing blocks with its current block;
        blocks popular per (sequence, head) are picked with probability 0.9, others with p_sel."""
        bs, hkv = self.bs, self.hkv
        p_sel = case.get("p_sel", 0.3)
        pop = {}
        lists = []
        for r, (s, t) in enumerate(self.rows):
            qb = t // bs
            per = []
            for h in range(hkv):
                if (s, h) not in pop:
                    nbs = case["seqs"][s][0] // bs + 1
                    pop[(s, h)] = rng.random(nbs) < 0.35
                if case.get("few"):  # long contexts: a handful of random blocks
                    cand = rng.choice(qb + 1, size=min(case["few"], qb + 1), replace=False)
                    ch = np.zeros(qb + 1, bool)
                    ch[cand] = True
                else:
                    pr = np.where(pop[(s, h)][:qb + 1], 0.9, p_sel)
                    ch = rng.random(qb + 1) < pr
                ch[qb] = True
                lst = [int(b) for b in np.nonzero(ch)[0]]
                if case.get("empty_seq") == s and h == 0:  # no block for KV head 0: an empty union (nkt = 0)
                    lst = []
                if case.get("junk") and rng.random() < 0.5:
                    lst.insert(int(rng.integers(0, len(lst) + 1)), -1)  # -1 entries are skipped
                    nb_seq = case["seqs"][s][0] // bs  # a block past the row's current one (skipped)
                    if qb + 1 <= nb_seq:
                        lst.append(qb + 1)
                per.append(lst)
            lists.append(per)
        self.lists = lists
        self.s_max = max(1, max(len(l) for per in lists for l in per)) + case.get("s_pad", 0)
        self.sel = np.full(self.nrows * hkv * self.s_max, -7, np.int32)  # garbage past nsel
        self.nsel = np.zeros(self.nrows * hkv, np.int32)
        for r in range(self.nrows):
            for h in range(hkv):
                l = lists[r][h]
                o = (r * hkv + h) * self.s_max
                self.sel[o:o + len(l)] = l
                self.nsel[r * hkv + h] = len(l)
        self.u_max = prefill_union_capacity(self.rows, self.tiles, self.G, self.s_max, bs)
        n = self.ntiles * hkv * self.u_max
        self.ublk = np.full(n, -123456, np.int32)
        self.umask = np.full(n, 0xDEADBEEFDEADBEEF, np.uint64)
        self.uw = np.zeros(n, np.int64)
        self.un = np.full(self.ntiles * hkv, -99, np.int32)

    def keys_of(self, r, h):
        """The reference's keys of row r, KV head h (ascending)."""
        t = self.rows[r][1]
        if not self.sparse:
            return np.arange(t + 1)
        qb = t // self.bs
        l = self.lists[r][h][:self.s_max]
        ks = [np.arange(b * self.bs, min((b + 1) * self.bs, t + 1)) for b in l if 0 <= b <= qb]
        return np.concatenate(ks) if ks else np.zeros(0, np.int64)


# ---------------------------------------------------------------- prefill_sel_union
def union_block(bx, h, L, rng, stats):
    T = PF_UNION_THREADS
    tid = np.arange(T)
    lane, warp = tid & 31, tid >> 5
    tab = Shared(PF_UNION_CHUNK * 8, "tab[2048]", rng, T)
    rqs = Shared(PF_BM * 4, "rq[64]", rng, T)
    rns = Shared(PF_BM * 4, "rn[64]", rng, T)
    wss = Shared((T // 32) * 4, "wsum[8]", rng, T)
    shareds = (tab, rqs, rns, wss)
    allt = np.ones(T, bool)

    def sync(arr):
        check(arr.all(), f"union ({bx},{h}): __syncthreads reached by {arr.sum()}/{T} threads")
        for s in shareds:
            s.barrier()

    G, hkv, bs, s_max, u_max = L.G, L.hkv, L.bs, L.s_max, L.u_max
    check(0 <= bx < L.ntiles, "tiles read out of bounds")
    r0, nrows, m0 = (int(x) for x in L.tiles[3 * bx:3 * bx + 3])
    mend = min(m0 + PF_BM, nrows * G)
    ilo = m0 // G
    R = (mend - 1) // G - ilo + 1
    check(1 <= R <= PF_BM, f"union ({bx},{h}): R = {R} tile rows")
    it = 0
    while True:
        i = tid + it * T
        a = i < R
        if not a.any():
            break
        r = r0 + ilo + i[a]
        check(((r >= 0) & (r < L.nrows)).all(), "union: lens / nsel read past the call's rows")
        rq = (L.lens[r] - 1) // bs
        rn = np.minimum(L.nsel[r * hkv + h], s_max)
        rqs.write(tid[a], 4 * i[a], as_bytes(rq, '<i4'), 4, "rq store")
        rns.write(tid[a], 4 * i[a], as_bytes(rn, '<i4'), 4, "rn store")
        it += 1
    sync(allt)
    nbv = bytes_to_u32(rqs.read(tid, np.full(T, 4 * (R - 1)), 4, 4, "rq[R-1] load")).view('<i4')[:, 0] + 1
    check((nbv == nbv[0]).all(), "union: nb not uniform")
    nb = int(nbv[0])
    obase = (bx * hkv + h) * u_max
    total = np.zeros(T, np.int64)
    got = {}
    for b0 in range(0, nb, PF_UNION_CHUNK):
        for it in range(PF_UNION_CHUNK // T):
            i = tid + it * T
            tab.write(tid, 8 * i, np.zeros((T, 8), np.uint8), 8, "tab clear")
        sync(allt)
        it = 0
        while True:
            x = tid + it * T
            a = x < R * s_max
            if not a.any():
                break
            xa, ta = x[a], tid[a]
            i = xa // s_max
            e = xa - i * s_max
            rn_i = bytes_to_u32(rns.read(ta, 4 * i, 4, 4, "rn load")).view('<i4')[:, 0]
            go = e < rn_i
            xi, ti_, ii, ee = xa[go], ta[go], i[go], e[go]
            gi = ((r0 + ilo + ii) * hkv + h) * s_max + ee
            check(((gi >= 0) & (gi < L.sel.size)).all(), "union: sel read out of bounds")
            blk = L.sel[gi].astype(np.int64)
            nn = blk >= 0  # `blk < 0 ||` short-circuits before rq[i] is read
            rq_i = np.full(blk.size, -1, np.int64)
            rq_i[nn] = bytes_to_u32(rqs.read(ti_[nn], 4 * ii[nn], 4, 4, "rq load")).view('<i4')[:, 0]
            ok = nn & ((blk <= rq_i) | ("union_no_rq_skip" in MUT)) & (blk >= b0) & (blk < b0 + PF_UNION_CHUNK)
            tab.atomic_or_u64(ti_[ok], 8 * (blk[ok] - b0), np.uint64(1) << ii[ok].astype(np.uint64), "atomicOr tab")
            it += 1
        sync(allt)
        first = 8 * tid
        ad = first[:, None] + np.arange(8)[None, :]
        tv = bytes_to_u64(tab.read(np.repeat(tid, 8), 8 * ad.ravel(), 8, 8, "tab load (count)")).reshape(T, 8)
        cnt = (tv != 0).sum(1).astype(np.int64)
        incl = cnt.copy()
        o = 1
        while o < 32:
            v = shfl_up(incl, o)
            incl = np.where(lane >= o, incl + v, incl)
            o <<= 1
        w31 = lane == 31
        wss.write(tid[w31], 4 * warp[w31], as_bytes(incl[w31], '<i4'), 4, "wsum store")
        sync(allt)
        ws = np.zeros((T, T // 32), np.int64)
        for w in range(T // 32):
            ws[:, w] = bytes_to_u32(wss.read(tid, np.full(T, 4 * w), 4, 4, "wsum load")).view('<i4')[:, 0]
        woff = np.where(np.arange(T // 32)[None, :] < warp[:, None], ws, 0).sum(1)
        pass_total = ws.sum(1)
        at = total + woff + incl - cnt
        tv = bytes_to_u64(tab.read(np.repeat(tid, 8), 8 * ad.ravel(), 8, 8, "tab load (write)")).reshape(T, 8)
        for k in range(8):
            m = tv[:, k]
            nz = m != 0
            wr = nz & (at < u_max)
            gi = obase + at[wr]
            check(((gi >= obase) & (gi < obase + u_max)).all(), "union: ublk write outside the (tile, head)'s lists")
            L.ublk[gi] = (b0 + first[wr] + k).astype(np.int32)
            L.umask[gi] = m[wr]
            np.add.at(L.uw, gi, 1)
            for b, mm in zip((b0 + first[nz] + k).tolist(), m[nz].tolist()):
                got[b] = mm
            at = at + nz
        total = total + pass_total
        sync(allt)
        stats["union_passes"] = stats.get("union_passes", 0) + 1
    check((total == total[0]).all(), "union: total not uniform over the block")
    L.un[bx * hkv + h] = min(int(total[0]), u_max)
    # the reference union
    want = {}
    for i in range(R):
        r = r0 + ilo + i
        qb = (int(L.lens[r]) - 1) // bs
        for b in L.lists[r][h][:min(int(L.nsel[r * hkv + h]), s_max)]:
            if 0 <= b <= qb:
                want[b] = want.get(b, 0) | (1 << i)
    check(int(total[0]) == len(want), f"union ({bx},{h}): {int(total[0])} entries, want {len(want)}")
    check(int(total[0]) <= u_max, f"union ({bx},{h}): {int(total[0])} entries overflow u_max = {u_max} "
                                  f"(the host capacity): entries dropped")
    wl = sorted(want.items())
    n = min(len(wl), u_max)
    gl = list(zip(L.ublk[obase:obase + n].tolist(), L.umask[obase:obase + n].tolist()))
    check(gl == [(b, m) for b, m in wl[:n]], f"union ({bx},{h}): lists differ from the reference "
                                             f"(got {gl[:4]}..., want {wl[:4]}...)")
    stats["union_entries"] = stats.get("union_entries", 0) + int(total[0])
    stats["union_max"] = max(stats.get("union_max", 0), int(total[0]))


# ---------------------------------------------------------------- attn_prefill_impl<D, SPARSE>
def attn_block(bx, h, L, stages, rng, stats, keyrec):
    """One thread block (tile bx, KV head h). stages: None (PF_STAGES=0) or 2 / 3."""
    T = PF_THREADS
    tid = np.arange(T)
    lane, warp = tid & 31, tid >> 5
    D, G, hkv, H = L.D, L.G, L.hkv, L.H
    SPARSE = L.sparse
    RS = D + PF_PAD
    NK, ND, CPR = D // 16, D // 8, D // 8
    RPP = T // CPR
    one_barrier = stages is not None
    S = stages if one_barrier else 2
    host_s = 2 if "smem_2stages" in MUT else S
    dyn_bytes = prefill_sparse_smem_bytes_at(D, host_s) if SPARSE else prefill_smem_bytes_at(D, host_s)
    dyn = Shared(dyn_bytes, "dynamic smem", rng, T)
    kms = Shared(PF_WARPS * 4, "pf_kmax[4]", rng, T)
    shareds = (dyn, kms)
    allt = np.ones(T, bool)
    nbar = [0]

    def sync(arr):
        check(arr.all(), f"block ({bx},{h}): __syncthreads reached by {arr.sum()}/{T} threads")
        nbar[0] += 1
        for s in shareds:
            s.barrier()

    check(0 <= bx < L.ntiles, "tiles read out of bounds")
    r0, nrows, m0 = (int(x) for x in L.tiles[3 * bx:3 * bx + 3])
    mend = min(m0 + PF_BM, nrows * G)
    ilo = m0 // G

    # ---- this lane's two fragment rows
    rr = np.full((T, 2), -1, np.int64)
    hh = np.zeros((T, 2), np.int64)
    pp = np.full((T, 2), -1, np.int64)
    ti = np.full((T, 2), -1, np.int64)
    for k in range(2):
        m = m0 + warp * 16 + (lane >> 2) + 8 * k
        v = m < mend
        i = m // G
        rr[v, k] = r0 + i[v]
        hh[v, k] = h * G + (m[v] - i[v] * G)
        check(((rr[v, k] >= 0) & (rr[v, k] < L.nrows)).all(), "lens read past the call's rows")
        pp[v, k] = L.lens[rr[v, k]] - 1
        ti[v, k] = i[v] - ilo
    check((ti < PF_BM).all(), "tile row >= 64")
    wmax = np.maximum(pp[:, 0], pp[:, 1])
    wmin = np.minimum(pp[:, 0], pp[:, 1])
    o = 16
    while o > 0:
        wmax = np.maximum(wmax, shfl_xor(wmax, o))
        wmin = np.minimum(wmin, shfl_xor(wmin, o))
        o >>= 1
    l0 = lane == 0
    kms.write(tid[l0], 4 * warp[l0], as_bytes(wmax[l0], '<i4'), 4, "pf_kmax store")
    wbits = np.zeros(T, np.uint64)
    if SPARSE:
        wb_lo = np.zeros(T, np.uint32)
        wb_hi = np.zeros(T, np.uint32)
        for k in range(2):
            v = ti[:, k] >= 0
            lo = v & (ti[:, k] < 32)
            hi = v & (ti[:, k] >= 32)
            wb_lo[lo] |= (np.uint32(1) << ti[lo, k].astype(np.uint32))
            wb_hi[hi] |= (np.uint32(1) << (ti[hi, k] - 32).astype(np.uint32))
        o = 16
        while o > 0:
            wb_lo = wb_lo | shfl_xor(wb_lo, o)
            wb_hi = wb_hi | shfl_xor(wb_hi, o)
            o >>= 1
        wbits = (wb_hi.astype(np.uint64) << np.uint64(32)) | wb_lo.astype(np.uint64)

    # ---- Q fragments
    qa = np.zeros((T, NK, 4), np.uint32)
    qc = (lane & 3) * 2

    def load_q(k, off):
        ok = rr[:, k] >= 0
        e = rr[ok, k] * L.q_stride + hh[ok, k] * D + off[ok]
        check(((2 * e) % 4 == 0).all(), "q u32 load misaligned")
        check(((e >= 0) & (e + 1 < L.q.size)).all(), "q load out of bounds")
        col = e - rr[ok, k] * L.q_stride
        check(((col >= 0) & (col + 1 < L.H * D)).all(), "q load outside the row's H*D values")
        out = np.zeros(T, np.uint32)
        out[ok] = L.q[e].astype(np.uint32) | (L.q[e + 1].astype(np.uint32) << 16)
        return out

    for kk in range(NK):
        c0 = kk * 16 + qc
        qa[:, kk, 0] = load_q(0, c0)
        qa[:, kk, 1] = load_q(1, c0)
        qa[:, kk, 2] = load_q(0, c0 + 8)
        qa[:, kk, 3] = load_q(1, c0 + 8)
    sync(allt)
    kmax = np.full(T, -1, np.int64)
    for w in range(PF_WARPS):
        kmax = np.maximum(kmax, bytes_to_u32(kms.read(tid, np.full(T, 4 * w), 4, 4, "pf_kmax load")).view('<i4')[:, 0])
    check((kmax == kmax[0]).all(), "kmax not uniform")
    kmax = int(kmax[0])
    rows_t = np.unique(rr[rr >= 0])
    check(kmax == int(L.lens[rows_t].max()) - 1, f"kmax {kmax} != the tile's last position")
    if kmax < 0:
        check(False, f"block ({bx},{h}): no M-row (kmax < 0)")
        return
    # every row of the tile shares the cache of row r0 (kptr[r0]): a run is one sequence
    check((L.kseq[rows_t] == L.kseq[r0]).all(), "tile rows of different sequences (kptr[r0] used for all)")
    seq = int(L.kseq[r0])
    Kg, Vg = L.K[seq], L.V[seq]
    Cg = L.C[seq] if (SPARSE and L.bias) else None
    cap = Kg.size // (hkv * D)
    spb = -(-L.bs // PF_BN) if SPARSE else 1
    ubase = (bx * hkv + h) * L.u_max if SPARSE else 0
    if SPARSE:
        un = int(L.un[bx * hkv + h])
        check(0 <= un <= L.u_max, f"un {un} outside 0 .. u_max")
        nkt = un * spb
    else:
        nkt = kmax // PF_BN + 1
    KS = 0
    VS = S * PF_BN * RS * 2
    BS = 2 * S * PF_BN * RS * 2
    ks_lane = KS + 2 * ldsm_k_lane(lane, RS)
    vs_lane = VS + 2 * ldsm_v_lane(lane, RS)
    tok_stride = hkv * D
    my_row = tid // CPR
    my_part = tid - my_row * CPR
    loader = my_row < RPP
    kd_lane = KS + 2 * (my_row * RS + my_part * 8)
    vd_lane = VS + 2 * (my_row * RS + my_part * 8)
    bd_lane = BS + 4 * my_row

    def tile_keys(t):
        if SPARSE:
            e = t // spb
            c = t - e * spb
            check(0 <= e < un, f"ublk read at entry {e} past the union count {un}")
            kt0 = int(L.ublk[ubase + e]) * L.bs + c * PF_BN
            nv = min(PF_BN, L.bs - c * PF_BN)
        else:
            kt0, nv = t * PF_BN, PF_BN
        return kt0, nv

    def load_tile(t, st):
        if not loader.any():
            return
        kt0, nv = tile_keys(t)
        sto = st * (PF_BN * RS * 2)
        alive = loader.copy()
        kt, ka, kd, vd, bt, ba, bd = [], [], [], [], [], [], []
        for i in range((PF_BN + RPP - 1) // RPP):
            row = my_row + i * RPP
            if (i + 1) * RPP > PF_BN:
                alive &= ~(row >= PF_BN)  # break: this thread's later passes are skipped too
            a = alive
            if not a.any():
                continue
            j = kt0 + row[a]
            ok = (row[a] < nv) & (j <= kmax)
            if "no_zero_fill" in MUT:  # only the valid rows copied
                a = a.copy()
                a[a] = ok
                j, ok = j[ok], ok[ok]
            dst = kd_lane[a] + sto + i * (RPP * RS * 2)
            kdat = np.zeros((a.sum(), 8), np.uint16)
            vdat = np.zeros((a.sum(), 8), np.uint16)
            if ok.any():
                ge = j[ok] * tok_stride + h * D + my_part[a][ok] * 8  # element index in the cache
                check((ge * 2 % 16 == 0).all(), "K/V cp.async source not 16-byte aligned")
                check(((j[ok] >= 0) & (j[ok] < cap)).all(), f"K/V read past the sequence's {cap} tokens")
                check((j[ok] <= kmax).all(), "K/V read past the tile's last position")
                ix = ge[:, None] + np.arange(8)[None, :]
                kdat[ok] = Kg[ix]
                vdat[ok] = Vg[ix]
                stats["kv_rows_read"] = stats.get("kv_rows_read", 0) + int(ok.sum())
            kt.append(tid[a])
            ka.append(dst)
            kd.append(kdat)
            vd.append(vdat)
            if SPARSE and Cg is not None:
                b = my_part[a] == 0
                bdst = bd_lane[a][b] + st * (PF_BN * 4) + i * (RPP * 4)
                bdat = np.zeros(b.sum(), F32)
                okb = ok[b]
                if okb.any():
                    jb = j[b][okb]
                    check(((jb >= 0) & (jb < cap)).all(), "bias read past the sequence")
                    bdat[okb] = Cg[jb * hkv + h]
                bt.append(tid[a][b])
                ba.append(bdst)
                bd.append(bdat)
        if kt:
            t_ = np.concatenate(kt)
            dyn.cp_async(t_, np.concatenate(ka), np.concatenate(kd).view(np.uint8).reshape(-1, 16), "K cp.async")
            dyn.cp_async(t_, np.concatenate(ka) + (VS - KS), np.concatenate(vd).view(np.uint8).reshape(-1, 16),
                         "V cp.async")
        if bt:
            dyn.cp_async(np.concatenate(bt), np.concatenate(ba), as_bytes(np.concatenate(bd), '<f4'), "bias cp.async")

    # ---- accumulators
    o_acc = np.zeros((T, ND, 4), F32)
    mr = np.full((T, 2), NEG_INF, F32)
    lr = np.zeros((T, 2), F32)
    sl2 = F32(L.scale * LOG2E)
    cb = (lane & 3) * 2

    def tile_sel(t):
        if SPARSE:
            e = t // spb
            check(0 <= e < un, "umask read past the union count")
            return np.uint64(L.umask[ubase + e])
        return np.uint64(0xFFFFFFFFFFFFFFFF)

    def compute(t, st):
        """Key tile t from stage st of dyn by every warp whose rows see it (the lockstep variants)."""
        kt0, nv = tile_keys(t)
        sel_rows = tile_sel(t)
        act = (kt0 <= wmax) & ((not SPARSE) | ((sel_rows & wbits) != 0))
        stats["warp_tiles"] = stats.get("warp_tiles", 0) + PF_WARPS
        stats["warp_tiles_skipped"] = stats.get("warp_tiles_skipped", 0) + int(PF_WARPS - act.reshape(-1, 32)[:, 0].sum())
        bst = 0 if "bias_stage0" in MUT else st
        tile_math(np.full(T, kt0, np.int64), np.full(T, nv, np.int64), np.full(T, sel_rows, np.uint64), allt, dyn,
                  ks_lane + st * (PF_BN * RS * 2), vs_lane + st * (PF_BN * RS * 2),
                  np.full(T, BS + bst * PF_BN * 4, np.int64), f"tile {t}")
        stats["tiles_computed"] = stats.get("tiles_computed", 0) + int(act.any())

    def tile_math(kt0, nv, sel_rows, step, mem, ks, vs, bsa, label):
        """The body of the key-tile loop for the warps in step whose rows see the tile, per thread: kt0 / nv
        its keys, sel_rows its umask entry, ks / vs this lane's ldmatrix addresses of the K / V tile in mem
        (an object with .read, as Shared), bsa the byte address of the tile's 64 bias values."""
        act = step & (kt0 <= wmax) & ((not SPARSE) | ((sel_rows & wbits) != 0))
        warp_uniform(act, allt, "tile branch (kt0 <= wmax && selected)")
        if not act.any():
            return
        # S = Q.K^T (mma_qk_tile64): one ldmatrix per (nb, kk)
        addr = ks[:, None, None] + ((np.arange(4)[:, None] * 16 * RS + np.arange(NK)[None, :] * 16) * 2)[None]
        bk = ldmatrix_x4(mem, tid, addr.reshape(T, 4 * NK), act, False, "ldmatrix K").reshape(T, 4, NK, 4)
        s = np.zeros((T, 8, 4), F32)
        for kk in range(NK):
            aa = np.broadcast_to(qa[:, kk][:, None, :], (T, 8, 4))
            b0 = np.stack([bk[:, nb, kk, r] for nb in range(4) for r in (0, 2)], 1)  # c = 2nb, 2nb+1
            b1 = np.stack([bk[:, nb, kk, r] for nb in range(4) for r in (1, 3)], 1)
            s = mma_bf16_x(s, aa, b0, b1)
        mx = np.full((T, 2), NEG_INF, F32)
        if SPARSE:
            rs = np.zeros((T, 2), bool)
            for k in range(2):
                v = ti[:, k] >= 0
                rs[v, k] = ((sel_rows[v] >> ti[v, k].astype(np.uint64)) & np.uint64(1)) != 0
            unmasked = ((sel_rows & wbits) == wbits) & (nv == PF_BN) & (kt0 + PF_BN - 1 <= wmin)
            warp_uniform(unmasked, act, "sparse unmasked branch")
            um = act & unmasked
            stats["sparse_unmasked_warp_tiles"] = stats.get("sparse_unmasked_warp_tiles", 0) + int(um.reshape(-1, 32)[:, 0].sum())
            for c in range(8):
                for e_ in range(2):
                    col = cb + 8 * c + e_
                    j = kt0 + col
                    if Cg is not None:
                        bias = bytes_to_u32(mem.read(tid[act], bsa[act] + 4 * col[act], 4, 4,
                                                     "bias load")).view(F32)[:, 0]
                        bv = np.zeros(T, F32)
                        bv[act] = bias
                    else:
                        bv = np.zeros(T, F32)
                    for k in range(2):
                        v = (fma32(s[:, c, 2 * k + e_], L.scale, bv) * LOG2E).astype(F32)
                        msk = ~rs[:, k] | (col >= nv) | (j > pp[:, k] - ("causal_off_by_one" in MUT))
                        # the unmasked path applies no mask: it must have had nothing to mask
                        check(not (um & msk).any(), f"block ({bx},{h}) {label}: the unmasked path skips a "
                                                    f"mask that the masked path would apply")
                        v = np.where(~unmasked & msk, NEG_INF, v)
                        s[:, c, 2 * k + e_] = v
                        mx[:, k] = np.fmax(mx[:, k], v)
        else:
            need = kt0 + PF_BN - 1 > wmin
            warp_uniform(need, act, "dense causal-mask branch")
            for c in range(8):
                for e_ in range(2):
                    j = kt0 + cb + 8 * c + e_
                    for k in range(2):
                        s[:, c, 2 * k + e_] = np.where(need & (j > pp[:, k] - ("causal_off_by_one" in MUT)), NEG_INF,
                                                       s[:, c, 2 * k + e_])
                    # the no-mask path must have had nothing to mask
                    check(not (act & ~need & ((j > pp[:, 0]) | (j > pp[:, 1]))).any(),
                          f"block ({bx},{h}) {label}: the dense no-mask path skips a needed mask")
            for c in range(8):
                for e_ in range(4):
                    mx[:, e_ >> 1] = np.fmax(mx[:, e_ >> 1], s[:, c, e_])
            mx = (mx * sl2).astype(F32)
        corr = np.zeros((T, 2), F32)
        u = np.zeros((T, 2), F32)
        for k in range(2):
            mx[:, k] = np.fmax(mx[:, k], shfl_xor(mx[:, k], 1))
            mx[:, k] = np.fmax(mx[:, k], shfl_xor(mx[:, k], 2))
            nm = np.fmax(mr[:, k], mx[:, k])
            u[:, k] = np.where(nm == NEG_INF, F32(0), nm)
            corr[:, k] = np.where(mr[:, k] == NEG_INF, F32(1), ex2_ftz((mr[:, k] - u[:, k]).astype(F32)))
            mr[act, k] = nm[act]
        ls = np.zeros((T, 2), F32)
        pb = np.zeros((T, 8, 2), np.uint32)
        for c in range(8):
            for k in range(2):
                if SPARSE:
                    x0 = (s[:, c, 2 * k] - u[:, k]).astype(F32)
                    x1 = (s[:, c, 2 * k + 1] - u[:, k]).astype(F32)
                else:
                    x0 = fma32(s[:, c, 2 * k], sl2, -u[:, k])
                    x1 = fma32(s[:, c, 2 * k + 1], sl2, -u[:, k])
                pk = pack_bf2_rn(ex2_ftz(x0), ex2_ftz(x1))
                pb[:, c, k] = pk
                ls[:, k] = (ls[:, k] + bf2_lo(pk)).astype(F32)
                ls[:, k] = (ls[:, k] + bf2_hi(pk)).astype(F32)
                # (row, head, key) of every non-zero P, for the key-set check
                for e_ in range(2):
                    pv = bf2_lo(pk) if e_ == 0 else bf2_hi(pk)
                    sel_ = act & (rr[:, k] >= 0) & (pv != 0)
                    if sel_.any():
                        j = kt0[sel_] + cb[sel_] + 8 * c + e_
                        keyrec.append((rr[sel_, k] * H + hh[sel_, k]) * L.keyspan + j)
        for k in range(2):
            lr[act, k] = fma32(lr[:, k], corr[:, k], ls[:, k])[act]
        resc = any_sync((corr[:, 0] != 1) | (corr[:, 1] != 1)) & act
        if resc.any():
            o_acc[resc, :, 0] *= corr[resc, 0][:, None]
            o_acc[resc, :, 1] *= corr[resc, 0][:, None]
            o_acc[resc, :, 2] *= corr[resc, 1][:, None]
            o_acc[resc, :, 3] *= corr[resc, 1][:, None]
        # O += P.V: ldmatrix.trans per (kk, j even)
        js = np.arange(0, ND, 2)
        addr = vs[:, None, None] + ((np.arange(4)[:, None] * 16 * RS + js[None, :] * 8) * 2)[None]
        bv_ = ldmatrix_x4(mem, tid, addr.reshape(T, 4 * js.size), act, True, "ldmatrix.trans V").reshape(T, 4, js.size, 4)
        o_new = o_acc.copy()
        for kk in range(4):
            pa = np.stack([pb[:, 2 * kk, 0], pb[:, 2 * kk, 1], pb[:, 2 * kk + 1, 0], pb[:, 2 * kk + 1, 1]], 1)
            aa = np.broadcast_to(pa[:, None, :], (T, ND, 4))
            b0 = np.zeros((T, ND), np.uint32)
            b1 = np.zeros((T, ND), np.uint32)
            b0[:, 0::2], b1[:, 0::2] = bv_[:, kk, :, 0], bv_[:, kk, :, 1]
            b0[:, 1::2], b1[:, 1::2] = bv_[:, kk, :, 2], bv_[:, kk, :, 3]
            o_new = mma_bf16_x(o_new, aa, b0, b1)
        o_acc[act] = o_new[act]

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if one_barrier:
            for s0 in range(S - 1):
                if s0 < nkt:
                    load_tile(s0, s0)
                dyn.commit(tid)
            st = 0
            for t in range(nkt):
                dyn.wait_group(tid, S - 1 if "wait_late" in MUT else S - 2, f"tile {t}")
                early = "issue_before_barrier" in MUT
                if not early:
                    sync(allt)
                tn = t + S - 1
                if tn < nkt:
                    load_tile(tn, st if "stage_same" in MUT else (S - 1 if st == 0 else st - 1))
                dyn.commit(tid)
                if early:
                    sync(allt)
                compute(t, st)
                st = 0 if st + 1 == S else st + 1
        else:
            if nkt > 0:
                load_tile(0, 0)
                dyn.commit(tid)
            for t in range(nkt):
                st = t & 1
                if t + 1 < nkt:
                    load_tile(t + 1, st ^ 1)
                    dyn.commit(tid)
                    dyn.wait_group(tid, 1, f"tile {t}")
                else:
                    dyn.wait_group(tid, 0, f"tile {t}")
                sync(allt)
                compute(t, st)
                if "no_second_barrier" not in MUT:
                    sync(allt)

        # ---- row sums and the output
        for k in range(2):
            lr[:, k] = (lr[:, k] + shfl_xor(lr[:, k], 1)).astype(F32)
            lr[:, k] = (lr[:, k] + shfl_xor(lr[:, k], 2)).astype(F32)
        cc = (lane & 3) * 2
        for k in range(2):
            w = rr[:, k] >= 0
            if not w.any():
                continue
            inv = np.where(lr[w, k] > 0, (F32(1) / lr[w, k]).astype(F32), F32(0))
            base = rr[w, k] * L.out_stride + hh[w, k] * D + cc[w]
            check(((hh[w, k] >= h * G) & (hh[w, k] < (h + 1) * G)).all(), "output head outside the block's KV head")
            for j in range(ND):
                e = base + j * 8
                check((e * 2 % 4 == 0).all(), "output u32 store misaligned")
                check(((e >= 0) & (e + 1 < L.out.size)).all(), "output store out of bounds")
                col = e - rr[w, k] * L.out_stride
                check(((col >= 0) & (col + 1 < H * D)).all(), "output store outside the row's H*D values")
                lo = f2bf_bits((o_acc[w, j, 2 * k] * inv).astype(F32))
                hi = f2bf_bits((o_acc[w, j, 2 * k + 1] * inv).astype(F32))
                L.out[e] = lo
                L.out[e + 1] = hi
                np.add.at(L.written, e, 1)
                np.add.at(L.written, e + 1, 1)
    dyn.finish(f"block ({bx},{h})")
    stats["barriers"] = stats.get("barriers", 0) + nbar[0]
    stats["smem_max_byte"] = max(stats.get("smem_max_byte", -1), dyn.max_byte)
    stats["smem_bytes"] = dyn_bytes
    stats["cp_async"] = stats.get("cp_async", 0) + dyn.copies


# ---------------------------------------------------------------- a case
def reference(L):
    """float64 attention of every (row, query head); and the (row, head, key) set."""
    D, G, H, hkv = L.D, L.G, L.H, L.hkv
    out = np.zeros((L.nrows, H, D))
    keys = []
    sc = F64(L.scale)
    for r, (s, t) in enumerate(L.rows):
        q = bf_bits_to_f32(L.q[r * L.q_stride:r * L.q_stride + H * D]).astype(F64).reshape(H, D)
        K = L.K[s].reshape(-1, hkv, D)
        V = L.V[s].reshape(-1, hkv, D)
        for h in range(hkv):
            ks = L.keys_of(r, h)
            if ks.size == 0:
                continue
            Kk = bf_bits_to_f32(K[ks, h]).astype(F64)
            Vk = bf_bits_to_f32(V[ks, h]).astype(F64)
            lg = q[h * G:(h + 1) * G] @ Kk.T * sc
            if L.bias:
                lg = lg + L.C[s].reshape(-1, hkv)[ks, h].astype(F64)[None, :]
            p = np.exp(lg - lg.max(1, keepdims=True))
            out[r, h * G:(h + 1) * G] = (p @ Vk) / p.sum(1, keepdims=True)
            for g in range(G):
                keys.append((r * H + h * G + g) * L.keyspan + ks)
    return out, (np.concatenate(keys) if keys else np.zeros(0, np.int64))


def run_case(case, D, mode, stages, seed):
    """One case: its inputs, the union kernel (sparse), every attention block and the checks; one line.
    Returns whether it passed."""
    rng = np.random.default_rng(seed)
    LOG.errors.clear()
    LOG.count = 0
    t0 = time.time()
    L = Launch(case, D, mode, rng)
    L.keyspan = max(ln for ln, _ in case["seqs"]) + 64
    stats = {}
    if L.sparse:
        for bx in range(L.ntiles):
            for h in range(L.hkv):
                union_block(bx, h, L, rng, stats)
        # entries past un are never read: make them garbage that would show
        for bx in range(L.ntiles):
            for h in range(L.hkv):
                check((L.uw[(bx * L.hkv + h) * L.u_max:(bx * L.hkv + h) * L.u_max + int(L.un[bx * L.hkv + h])] == 1).all(),
                      f"union ({bx},{h}): an entry below un written other than once")
    keyrec = []
    aborted = None
    try:
        for bx in range(L.ntiles):
            for h in range(L.hkv):
                attn_block(bx, h, L, stages, rng, stats, keyrec)
    except RuntimeError as ex:
        aborted = str(ex)
    ok, line = check_outputs(L, D, keyrec, stats)
    ok = ok and aborted is None
    dt = time.time() - t0
    print(f"[{'ok  ' if ok else 'FAIL'}] {mode:6s} stages={stages or 0:<6} D={D:3d} {case['name']:58s} {line} "
          f"errors={LOG.count} ({dt:.1f} s)", flush=True)
    if aborted:
        print(f"   aborted: {aborted}")
    for e in LOG.errors[:12]:
        print("   ERROR:", e)
    if LOG.count > 12:
        print(f"   ... {LOG.count - 12} more errors")
    return ok


def check_outputs(L, D, keyrec, stats):
    """The launch's outputs against the float64 reference: -> (ok, the line's fields)."""
    # outputs: every (row, head, d) written once, the row padding never
    wr = L.written.reshape(L.nrows, L.out_stride)
    want = np.zeros_like(wr)
    want[:, :L.H * D] = 1
    if not (wr == want).all():
        bad = np.argwhere(wr != want)
        LOG.err(f"output written-once map: {len(bad)} elements wrong, e.g. (row, col, count) "
                f"{[(int(a), int(b), int(wr[a, b])) for a, b in bad[:4]]}")
    ref, keys_ref = reference(L)
    got = bf_bits_to_f32(L.out.reshape(L.nrows, L.out_stride)[:, :L.H * D]).astype(F64).reshape(L.nrows, L.H, D)
    fin = np.isfinite(got).all()
    check(fin, "non-finite outputs")
    num = ((got - ref) ** 2).sum()
    den = (ref ** 2).sum()
    rel = float(np.sqrt(num / den)) if den > 0 else 0.0
    per = np.sqrt(((got - ref) ** 2).sum(-1) / np.maximum((ref ** 2).sum(-1), 1e-300))
    worst = float(per.max()) if per.size else 0.0
    if not fin:
        rel = worst = float("inf")
    # key sets
    kr = np.concatenate(keyrec) if keyrec else np.zeros(0, np.int64)
    u, c = np.unique(kr, return_counts=True)
    check((c == 1).all(), f"{int((c > 1).sum())} (row, head, key) with P counted in more than once")
    ur = np.unique(keys_ref)
    extra = np.setdiff1d(u, ur, assume_unique=True)
    miss = np.setdiff1d(ur, u, assume_unique=True)

    def dec(x):
        x = int(x)
        return (x // L.keyspan // L.H, x // L.keyspan % L.H, x % L.keyspan)
    check(extra.size == 0, f"{extra.size} (row, head, key) with P > 0 that the reference masks, e.g. {[dec(x) for x in extra[:3]]}")
    check(miss.size == 0, f"{miss.size} (row, head, key) of the reference with P = 0 or never computed, e.g. {[dec(x) for x in miss[:3]]}")
    ok = LOG.count == 0 and rel <= 1e-2 and worst <= 2e-2
    extra_s = ""
    if L.sparse:
        extra_s = (f" u_max={L.u_max} union<={stats.get('union_max', 0)} passes={stats.get('union_passes', 0)}"
                   f" unmasked={stats.get('sparse_unmasked_warp_tiles', 0)}")
    line = (f"rows={L.nrows:3d} tiles={L.ntiles:3d}x{L.hkv} keytiles={stats.get('tiles_computed', 0):4d} "
            f"warp-skips={stats.get('warp_tiles_skipped', 0):4d}{extra_s} smem {stats.get('smem_max_byte', -1) + 1}/"
            f"{stats.get('smem_bytes', 0)} B relL2={rel:.3e} worst(row,head)={worst:.3e}")
    return ok, line


# (name, seqs [(len, rows)], G, hkv, default D, extras)
DENSE_CASES = [
    dict(name="30-token prompt (< one key tile); a row split over 2 tiles", seqs=[(30, 30)], G=3, hkv=2, D=64),
    dict(name="33-token prompt (just past a 16 boundary)", seqs=[(33, 33)], G=8, hkv=1, D=80),
    dict(name="chunk T0=300 + 37 rows (6 key tiles)", seqs=[(337, 37)], G=16, hkv=2, D=128),
    dict(name="two runs: 71 tok (rows 50..70: warp skips) + 17 tok", seqs=[(71, 21), (17, 5)], G=3, hkv=2, D=80),
    dict(name="chunk T0=900 + 12 rows (15 key tiles)", seqs=[(912, 12)], G=8, hkv=2, D=64),
]
SPARSE_CASES = [
    dict(name="20-token prompt (one block)", seqs=[(20, 20)], G=3, hkv=2, D=64),
    dict(name="65-token prompt (just past a block, 2 blocks)", seqs=[(65, 65)], G=8, hkv=1, D=80),
    dict(name="chunk T0=400 + 40 rows (7 blocks)", seqs=[(440, 40)], G=16, hkv=2, D=128),
    dict(name="2 runs, no bias; -1/future ids; s_max padded; empty union", seqs=[(200, 30), (50, 6)], G=3,
         hkv=2, D=64, bias=False, junk=True, s_pad=2, empty_seq=1),
    dict(name="131,120 tokens: block ids past 2048 (two union passes)", seqs=[(131120, 5)], G=16, hkv=1, D=64,
         few=5),
    dict(name="block_size 128 (2 key tiles a block)", seqs=[(300, 20)], G=8, hkv=1, D=128, bs=128),
    dict(name="block_size 32 (half a key tile a block)", seqs=[(150, 12)], G=16, hkv=2, D=80, bs=32),
    dict(name="block_size 256 (4 key tiles a block, warps end apart)", seqs=[(357, 61)], G=1, hkv=2, D=64, bs=256,
         p_sel=0.5),
]


SELFTEST_CASE = dict(name="selftest: 300 tokens, 6 rows (5 key tiles)", seqs=[(300, 6)], G=8, hkv=1, D=64)
SELFTEST_RUNS = {  # mutation -> (mode, stages, case)
    "stage_same": ("dense", 3, SELFTEST_CASE),
    "wait_late": ("dense", 3, SELFTEST_CASE),
    "issue_before_barrier": ("dense", 2, SELFTEST_CASE),
    "no_second_barrier": ("dense", None, SELFTEST_CASE),
    "smem_2stages": ("dense", 3, SELFTEST_CASE),
    "no_zero_fill": ("dense", 3, DENSE_CASES[3]),
    "causal_off_by_one": ("dense", None, SELFTEST_CASE),
    "union_no_rq_skip": ("sparse", 2, SPARSE_CASES[3]),
    "bias_stage0": ("sparse", 3, dict(SPARSE_CASES[0], name="selftest: 300 tokens, 6 rows, sparse", seqs=[(300, 6)],
                                      G=8, hkv=1, p_sel=0.8)),
}


def selftest(only=None):
    """Each mutation must make its case fail (and the unmutated case pass)."""
    bad = 0
    runs = {k: v for k, v in SELFTEST_RUNS.items() if only is None or k in only}
    for name, (mode, st, case) in runs.items():
        MUT.clear()
        base = run_case(case, case["D"], mode, st, 7)
        MUT.add(name)
        print(f"--- mutation {name}: {MUTATIONS[name]}")
        caught = not run_case(case, case["D"], mode, st, 7)
        MUT.clear()
        print(f"--- {name}: {'caught' if caught else 'NOT CAUGHT'}{'' if base else ' (but the unmutated case failed)'}")
        bad += (not caught) or (not base)
    print(f"selftest: {len(runs) - bad} passed, {bad} failed")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", choices=["0", "2", "3"], action="append",
                    help="PF_STAGES variant(s) (repeatable; default all three)")
    ap.add_argument("--mode", choices=["dense", "sparse"], action="append", help="default both")
    ap.add_argument("--d", type=int, choices=[64, 80, 128], help="run every case at this head dim")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--selftest", action="store_true",
                    help="inject each deliberate kernel bug of MUTATIONS into a small case: each must fail")
    ap.add_argument("--only", action="append", help="--selftest: only this mutation (repeatable)")
    a = ap.parse_args()
    if a.selftest:
        sys.exit(selftest(a.only))
    stages = [None if s == "0" else int(s) for s in (a.stages or ["0", "2", "3"])]
    modes = a.mode or ["dense", "sparse"]
    t0 = time.time()
    nok = nfail = 0
    for st in stages:
        for mode in modes:
            cases = DENSE_CASES if mode == "dense" else SPARSE_CASES
            for i, c in enumerate(cases):
                D = a.d or c["D"]
                try:
                    ok = run_case(c, D, mode, st, a.seed * 1000 + i)
                except RuntimeError as ex:
                    print(f"[FAIL] {mode} stages={st or 0} D={D} {c['name']}: aborted: {ex}")
                    for e in LOG.errors[:12]:
                        print("   ERROR:", e)
                    ok = False
                nok += ok
                nfail += not ok
    print(f"{nok} passed, {nfail} failed ({time.time() - t0:.0f} s)")
    sys.exit(1 if nfail else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Layout check of kernels/qa_prefill.cu's wgmma window-scoring kernel (qa_prefill_scores_wg_*), without
a GPU: the shared-memory layouts its cp.async copies build and the addresses its wgmma descriptors make
the hardware read. It re-implements the kernel's issue_tile (both thread mappings: the 128-byte
swizzle, the default, and the unswizzled constant-stride mapping of QW_SWIZZLE=0; D 64 and 128, the
head dims the kernel takes) and packs the descriptors bit for bit as wg_desc / wg_desc_sw128 in
kernels/wgmma.cuh do, then decodes their fields (start, LBO, SBO, base offset, layout type) as the
PTX ISA places them and reads through the decoded values: change it with the kernel. Not modelled:
QW_STAGES=2 (two of the three stages) and the zero-fill of windows past the block's last one.

For every D, layout and stage it checks that
  - the copies of one tile are a bijection: every 16-byte chunk of the stage's two part tiles is
    written exactly once, inside the stage (the 1,024-byte-aligned base, three stages, and the
    host's qa_prefill_wg_smem_bytes = 3 * 2 * 64 * D * 2 + 1024 with a misaligned dynamic base);
  - what wgmma reads for every (k-step, part, window n, dim k) through the decoded descriptor is the
    value Kc part[p][w0 + n][k] the copies put there (the B operand of m64n64k16, K-major: core
    matrices of 8 rows x 16 bytes; no swizzle: start + (n / 8) * SBO + (k / 8 % 2) * LBO + (n % 8) * 16;
    128-byte swizzle: the row's byte offset then bits [4, 7) XORed with bits [7, 10) of the address);
  - with the swizzle, each group of 8 consecutive lanes (one 128-byte shared wavefront of 16-byte
    copies) writes 8 distinct 16-byte bank groups, and a warp's global reads touch 4 L2 lines of
    128 bytes (8 without it);
  - a mutation self-test: a wrong XOR, a wrong SBO, an unaligned base and the layout type in the
    wrong bit each fail the read check.
This models the descriptor as the PTX ISA documents it; the GPU's gpu-check select group is what
confirms the hardware agrees (both layouts were confirmed on an H100, 2026-12-07).

Run: python3 scripts/sim/qa_prefill_wg_layout_sim.py (pure Python, about 5 s). Exit 1 on any error.
"""
import sys

QW_THREADS, QW_NP, QP_BN, STAGES = 256, 2, 64, 3
ERRORS = []
QUIET = [False]  # the self-test's expected errors are counted, not printed


def err(msg):
    if not QUIET[0] and len(ERRORS) < 20:
        print("error:", msg)
    ERRORS.append(msg)


def copies(D, sw, w0, buf, sh):
    """The kernel's issue_tile: (tid, part, window w, dims chunk c, shared byte address) per 16-byte copy."""
    CH = D // 8
    SBO = CH * 128
    PART_B = QP_BN * D * 2
    out = []
    if sw:
        RP = QW_THREADS // 8
        KATOMS, KATOM_B = D // 64, QP_BN * 128
        for tid in range(QW_THREADS):
            cc, wq = tid & 7, tid >> 3
            dst = sh + buf * QW_NP * PART_B + (wq >> 3) * 1024 + (wq & 7) * 128 + ((cc ^ (wq & 7)) * 16)
            for p in range(QW_NP):
                for ka in range(KATOMS):
                    for j in range(QP_BN // RP):
                        out.append((tid, p, wq + RP * j, ka * 8 + cc,
                                    dst + p * PART_B + ka * KATOM_B + j * (RP // 8) * 1024))
    else:
        GP = QW_THREADS // (8 * CH)
        for tid in range(QW_THREADS):
            y, g0 = tid % (8 * CH), tid // (8 * CH)
            c, w = (y & 1) + 2 * (y >> 4), ((y >> 1) & 7) + 8 * g0
            dst = sh + buf * QW_NP * PART_B + g0 * SBO + c * 128 + ((y >> 1) & 7) * 16
            for p in range(QW_NP):
                for j in range(QP_BN // (8 * GP)):
                    out.append((tid, p, w + 8 * GP * j, c, dst + p * PART_B + GP * j * SBO))
    return out


def sw128(addr):
    """The 128-byte swizzle on a shared address: bits [4, 7) ^= bits [7, 10)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def wg_desc(saddr, lbo, sbo):
    """kernels/wgmma.cuh wg_desc, bit for bit."""
    return ((saddr >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32)


def wg_desc_sw128(saddr):
    """kernels/wgmma.cuh wg_desc_sw128, bit for bit."""
    return ((saddr >> 4) & 0x3FFF) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


def decode(desc):
    """The PTX ISA's fields of an sm_90 matrix descriptor: start address, LBO, SBO (bytes), base offset,
    layout type (0 no swizzle, 1 128-byte, 2 64-byte, 3 32-byte swizzle)."""
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4,
            (desc >> 49) & 7, (desc >> 62) & 3)


def read_addr(desc, n, k, xor=True):
    """The byte wgmma reads for window n, dim k (0 .. 15) of a K-major bf16 B operand with descriptor
    `desc`: no swizzle, core matrices of 8 rows x 16 bytes (rows 16 bytes apart; LBO the next 8 dims,
    SBO the next 8 rows); 128-byte swizzle, rows of 128 bytes (SBO the next 8 rows, the k-step's
    offset in the start address) with address bits [4, 7) XORed with bits [7, 10). Other layout
    types and a nonzero base offset are errors here (the kernel uses neither)."""
    start, lbo, sbo, base, layout = decode(desc)
    if base != 0:
        err(f"descriptor {desc:#x}: base offset {base}")
    if layout == 1:
        a = start + (n // 8) * sbo + (n % 8) * 128 + (k // 8) * 16 + (k % 8) * 2
        return sw128(a) if xor else a
    if layout != 0:
        err(f"descriptor {desc:#x}: layout type {layout}")
    return start + (n // 8) * sbo + (k // 8) * lbo + (n % 8) * 16 + (k % 8) * 2


def kernel_desc(D, sw, sh, buf, p, kk, sbo_override=None):
    """The kernel's descriptor for stage buf, part p, k-step kk (tile_logits)."""
    PART_B = QP_BN * D * 2
    if sw:
        d = wg_desc_sw128(sh + (buf * QW_NP + p) * PART_B + (kk >> 2) * (QP_BN * 128) + (kk & 3) * 32)
    else:
        d = wg_desc(sh + (buf * QW_NP + p) * PART_B + kk * 256, 128, (D // 8) * 128)
    if sbo_override is not None:  # self-test: a descriptor with another SBO
        d = (d & ~(0x3FFF << 32)) | ((sbo_override >> 4) << 32)
    return d


def check(D, sw, dyn_base, mutate=None):
    """All checks of one (D, layout); returns the number of errors found."""
    before = len(ERRORS)
    smem = 3 * 2 * 64 * D * 2 + 1024  # prefill_scores.rs qa_prefill_wg_smem_bytes
    sh = (dyn_base + 1023) & ~1023
    if mutate == "unaligned":
        sh += 512  # half an atom off: the XOR of the absolute address bits no longer matches the rows
    tag = f"D {D} {'sw128' if sw else 'no swizzle'}{' (' + mutate + ')' if mutate else ''}"
    for buf in range(STAGES):
        cps = copies(D, sw, 0, buf, sh)
        phys = {}
        for tid, p, w, c, a in cps:
            if a % 16:
                err(f"{tag}: copy to {a:#x} not 16-byte aligned")
            if not (dyn_base <= a and a + 16 <= dyn_base + smem):
                err(f"{tag}: copy to {a:#x} outside dynamic shared memory [{dyn_base:#x}, +{smem})")
            if a in phys:
                err(f"{tag}: chunk {a:#x} written twice (part {p} window {w} chunk {c})")
            phys[a] = (p, w, c)
        want = QW_NP * QP_BN * (D // 8)
        if len(phys) != want:
            err(f"{tag}: {len(phys)} chunks written, want {want}")
        seen = {(p, w, c) for p, w, c in phys.values()}
        if len(seen) != want:
            err(f"{tag}: {len(seen)} distinct (part, window, chunk), want {want}")
        # what wgmma reads
        for p in range(QW_NP):
            for kk in range(D // 16):
                desc = kernel_desc(D, sw, sh, buf, p, kk, sbo_override=2048 if mutate == "sbo" else None)
                if mutate == "layout":  # self-test: the layout type in bit 63 instead of 62
                    desc ^= (1 << 62) | (1 << 63)
                for n in range(QP_BN):
                    for k in range(16):
                        a = read_addr(desc, n, k, xor=mutate != "xor")
                        got = phys.get(a & ~15)
                        dim = kk * 16 + k
                        if got != (p, n, dim // 8) or (a % 16) != (dim % 8) * 2:
                            err(f"{tag}: stage {buf} part {p} k-step {kk} window {n} dim {dim}: reads "
                                f"{a:#x} holding {got}, want part {p} window {n} chunk {dim // 8}")
                            break
        if sw and mutate is None:
            by_tid = {}
            for tid, p, w, c, a in cps:
                by_tid.setdefault(tid, []).append((p, w, c, a))
            for i in range(len(by_tid[0])):
                for g in range(0, QW_THREADS, 8):  # one 128-byte wavefront of 16-byte copies
                    banks = {(by_tid[t][i][3] >> 4) & 7 for t in range(g, g + 8)}
                    if len(banks) != 8:
                        err(f"{tag}: lanes {g}..{g + 7}, copy {i}: {8 - len(banks)} bank-group conflicts")
                for wp in range(0, QW_THREADS, 32):
                    lines = {((by_tid[t][i][1]) * D * 2 + by_tid[t][i][2] * 16) // 128 for t in range(wp, wp + 32)}
                    if len(lines) != 4:
                        err(f"{tag}: warp {wp // 32}, copy {i}: {len(lines)} L2 lines, want 4")
    return len(ERRORS) - before


def main():
    for D in (64, 128):
        for sw in (True, False):
            for base in (0, 512, 1536):  # dynamic shared memory after 0 or 512 bytes of static arrays
                n = check(D, sw, base)
                print(f"D {D:3d} {'sw128     ' if sw else 'no swizzle'} base {base:4d}: {'ok' if n == 0 else f'{n} errors'}")
    # self-test: each mutation must be caught
    saved = len(ERRORS)
    QUIET[0] = True
    for D in (64, 128):
        for m in ("xor", "sbo", "unaligned", "layout"):
            n = check(D, True, 512, mutate=m)
            if n == 0:
                ERRORS.append(f"self-test: mutation {m} at D {D} not caught")
                print(f"self-test: mutation {m} at D {D} NOT caught")
            else:
                print(f"self-test: mutation {m} at D {D} caught ({n} errors)")
    QUIET[0] = False
    caught_errors = ERRORS[saved:]
    del ERRORS[saved:]
    ERRORS.extend(e for e in caught_errors if e.startswith("self-test"))
    if ERRORS:
        print(f"{len(ERRORS)} errors")
        sys.exit(1)
    print("all layout checks passed")


if __name__ == "__main__":
    main()

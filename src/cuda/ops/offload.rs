//! Typed wrappers of the offloaded-KV kernels (kernels/kv_offload.cu):
//! `slot_diff`, `kv_fetch_sm`, `kv_store_blocks`, the copy-engine fetch
//! through `cuMemcpyBatchAsync`, and the split fetch that runs both on
//! shares of one layer's misses (runtime.md §1, §4).

use crate::cuda::context::{dptr_mut, grid, i32_dim, CudaResultExt};
use crate::cuda::device_error::ErrorSink;
use crate::cuda::Gpu;
use crate::{Error, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaEvent, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Threads per block of `slot_diff` (`SD_THREADS` in kernels/kv_offload.cu).
const SLOT_DIFF_THREADS: u32 = 128;
/// Largest pool (slots per (sequence, layer, KV head)) `slot_diff` handles.
pub const SLOT_DIFF_MAX_SLOTS: usize = 1024;
/// Largest selection list width `slot_diff` handles.
pub const SLOT_DIFF_MAX_SEL: usize = 1024;
/// Threads per task group of `kv_fetch_sm` (`FETCH_THREADS`; a CTA is 1 to 4 groups).
const FETCH_THREADS: u32 = 256;
/// Dynamic shared memory of `kv_fetch_sm`, bytes (`FETCH_SMEM_INTS` × 4:
/// the prefix of one chunk of 512 (row, head) fetch counts and the block
/// scan's 32 warp sums).
const FETCH_SMEM_BYTES: u32 = (512 + 1 + 32) * 4;

/// Default CTA count of the SM fetch (runtime.md §2: every GPU but the
/// H100 / A100 at large batch gets 16).
pub const DEFAULT_FETCH_CTAS: usize = 16;

/// Device addresses and geometry of one `slot_diff` launch: the set
/// difference between each (row, KV head)'s new selection and its slot map,
/// exactly [`kv::plan_slots`](crate::kv::plan_slots)`(slots, selected,
/// ring_first(len))` per (row, head), or with `aged`
/// [`kv::plan_slots_lru`](crate::kv::plan_slots_lru) (a pool with cache slots).
#[derive(Debug, Clone, Copy)]
pub struct SlotDiffArgs {
    /// i32 \[rows\]\[kv_heads\]\[s_max\]: selected block ids, strictly ascending
    /// among the first nsel entries that are ≥ 0 (negative entries inside
    /// nsel are absent: slot −1, no fetch).
    pub sel: u64,
    /// i32 \[rows\]\[kv_heads\]: valid entries of each selection row.
    pub nsel: u64,
    /// Width of a selection row (≤ [`SLOT_DIFF_MAX_SEL`]).
    pub s_max: usize,
    /// i32 \[rows\]: tokens each row attends to, its new token included (sets
    /// the ring: blocks ≥ `kv::ring_first(len)` take no slot).
    pub lens: u64,
    /// u64 \[rows\]: per row, the address of its (sequence, layer)'s slot map
    /// i32 \[kv_heads\]\[slots\], updated in place.
    pub slot_tab: u64,
    /// Slots per (sequence, layer, KV head), S (≤ [`SLOT_DIFF_MAX_SLOTS`]).
    pub slots: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Rows (sequences) of the launch.
    pub rows: usize,
    /// Out i32 \[rows\]\[kv_heads\]\[s_max\]: per selection entry its slot, −1 for
    /// ring blocks, absent entries and entries ≥ nsel.
    pub slot_list: u64,
    /// Out i32 \[rows\]\[kv_heads\]\[slots\]\[2\]: (slot, block) to fetch, ascending block.
    pub fetch: u64,
    /// Out i32 \[rows\]\[kv_heads\]: valid pairs of `fetch`.
    pub nfetch: u64,
    /// u64 \[2\] or 0: `[0] +=` selected blocks, `[1] +=` fetched blocks
    /// (locality γ = 1 − \[1\]/\[0\]); typically one pair per layer.
    pub stats: u64,
    /// Where more misses than free slots are reported (the excess stays
    /// unfetched, slot −1, either way); [`ErrorSink::NONE`] reports nothing.
    pub err: ErrorSink,
    /// Least-recently-selected reuse ([`kv::plan_slots_lru`](crate::kv::plan_slots_lru)):
    /// each slot map buffer is followed by its ages i32 \[kv_heads\]\[slots\]
    /// (steps since the slot's block was last selected), updated in place;
    /// false: free slots are reused in ascending order
    /// ([`kv::plan_slots`](crate::kv::plan_slots)) and no ages exist.
    pub aged: bool,
}

/// Launches `slot_diff` (grid (rows, kv_heads), 128 threads) on `stream`.
/// `rows = 0` is a no-op. A (row, head) with more misses than free slots
/// is reported to `a.err` ([`DeviceErrorKind::SlotDiffNoSlot`](crate::cuda::device_error::DeviceErrorKind::SlotDiffNoSlot);
/// read the record after a synchronisation).
///
/// Errors: [`Error::Input`] when S or s_max exceed the kernel's limits, a
/// size is 0 or exceeds i32, or a required address is 0; [`Error::Cuda`] on
/// a launch failure.
pub fn slot_diff(gpu: &Gpu, stream: &CudaStream, a: &SlotDiffArgs) -> Result<()> {
    const OP: &str = "slot_diff";
    if a.rows == 0 || a.kv_heads == 0 {
        return Ok(());
    }
    if a.slots == 0 || a.slots > SLOT_DIFF_MAX_SLOTS {
        return Err(Error::Input(format!(
            "{OP}: {} slots per (sequence, layer, KV head), must be 1..={SLOT_DIFF_MAX_SLOTS}",
            a.slots
        )));
    }
    if a.s_max == 0 || a.s_max > SLOT_DIFF_MAX_SEL {
        return Err(Error::Input(format!(
            "{OP}: selection width s_max = {}, must be 1..={SLOT_DIFF_MAX_SEL}",
            a.s_max
        )));
    }
    if a.block_size == 0 {
        return Err(Error::Input(format!("{OP}: block_size 0")));
    }
    for (what, p) in [
        ("sel", a.sel),
        ("nsel", a.nsel),
        ("lens", a.lens),
        ("slot_tab", a.slot_tab),
        ("slot_list", a.slot_list),
        ("fetch", a.fetch),
        ("nfetch", a.nfetch),
    ] {
        if p == 0 {
            return Err(Error::Input(format!("{OP}: null address for {what}")));
        }
    }
    i32_dim(a.rows * a.kv_heads * a.s_max, "rows·kv_heads·s_max")?;
    i32_dim(a.rows * a.kv_heads * a.slots * 2, "rows·kv_heads·slots·2")?;
    let (s_max, s, bs, hkv) = (
        i32_dim(a.s_max, "s_max")?,
        i32_dim(a.slots, "slots")?,
        i32_dim(a.block_size, "block_size")?,
        i32_dim(a.kv_heads, "kv_heads")?,
    );
    let layer = a.err.layer_arg()?;
    let aged = i32::from(a.aged);
    let f = gpu.function(OP)?;
    let cfg = LaunchConfig {
        grid_dim: (grid(a.rows, "rows")?, grid(a.kv_heads, "kv_heads")?, 1),
        block_dim: (SLOT_DIFF_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    b.arg(&a.sel)
        .arg(&a.nsel)
        .arg(&s_max)
        .arg(&a.lens)
        .arg(&a.slot_tab)
        .arg(&s)
        .arg(&bs)
        .arg(&hkv)
        .arg(&a.slot_list)
        .arg(&a.fetch)
        .arg(&a.nfetch)
        .arg(&a.stats)
        .arg(&a.err.record)
        .arg(&layer)
        .arg(&aged);
    // SAFETY: argument list matches kernels/kv_offload.cu slot_diff; the caller
    // passes buffers of the documented shapes; limits checked above.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Device addresses and geometry of one fetch (SM kernel or copy engines).
#[derive(Debug, Clone, Copy)]
pub struct FetchArgs {
    /// i32 \[rows\]\[kv_heads\]\[slots\]\[2\]: (slot, block) pairs (`slot_diff`'s output).
    pub fetch: u64,
    /// i32 \[rows\]\[kv_heads\]: valid pairs per (row, head).
    pub nfetch: u64,
    /// Slots per (sequence, layer, KV head), S.
    pub slots: usize,
    /// Rows (sequences).
    pub rows: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// u64 \[rows\]: device-visible address of block 0 of each row's host
    /// store ([`PinnedKv::device_ptr`](crate::kv::host_store::PinnedKv::device_ptr) + the (sequence, layer) offset).
    pub host_tab: u64,
    /// u64 \[rows\]: address of each row's slot pool bf16 \[kv_heads\]\[slots\]\[2\]\[B\]\[D\].
    pub pool_tab: u64,
    /// Tokens per block, B.
    pub block_size: usize,
    /// Head dim, D (a multiple of 8).
    pub head_dim: usize,
    /// Per-CTA timeline of the SM kernel, u64 \[ctas\]\[3\] (start ns, end
    /// ns, SM id: kernels/common.cuh `cta_log_start`), or 0 (none, the
    /// default; [`crate::trace::cta`]). The copy engines ignore it.
    pub cta_log: u64,
}

/// Environment variable: task groups of 256 threads per `kv_fetch_sm` CTA,
/// 1 to 4, for every launch (unset: [`fetch_groups_default`]). Each group
/// copies its own (block, head) chunks, so one CTA keeps up to 4 × 32 KiB
/// in flight.
pub const ENV_FETCH_GROUPS: &str = "SPARDA_FETCH_GROUPS";

/// Task groups per `kv_fetch_sm` CTA when [`ENV_FETCH_GROUPS`] is unset: 4
/// on whole SMs (the SM holds nothing else; H200, 64K B 16, forecast +
/// prefetch on 8 whole SMs, median step: 11.69 ms with 1 group, 10.73 with
/// 2, 10.54 with 4; the prefetched step over max(P, C) of forecast without
/// prefetch 1.18 → 1.09), 1 on SMs shared with compute blocks (256 threads
/// leave them the rest). [`ENV_FETCH_GROUPS`] = 4 on shared SMs takes a
/// whole SM's registers per copy CTA (64 a thread × 1024), so no compute
/// block can share it.
pub fn fetch_groups_default(whole_sms: bool) -> u32 {
    if whole_sms {
        4
    } else {
        1
    }
}

/// The task groups per `kv_fetch_sm` CTA: [`ENV_FETCH_GROUPS`] (read once)
/// or [`fetch_groups_default`].
///
/// Errors: [`Error::Input`] for a value that is not 1 to 4.
pub fn fetch_groups(whole_sms: bool) -> Result<u32> {
    static GROUPS: std::sync::OnceLock<std::result::Result<Option<u32>, String>> =
        std::sync::OnceLock::new();
    let env = GROUPS
        .get_or_init(|| match std::env::var(ENV_FETCH_GROUPS) {
            Err(_) => Ok(None),
            Ok(v) => parse_fetch_groups(&v).map(Some),
        })
        .clone()
        .map_err(Error::Input)?;
    Ok(env.unwrap_or_else(|| fetch_groups_default(whole_sms)))
}

/// Parses a [`ENV_FETCH_GROUPS`] value: 1 to 4, or an error naming the
/// variable and the value.
fn parse_fetch_groups(v: &str) -> std::result::Result<u32, String> {
    match v.trim().parse::<u32>() {
        Ok(g @ 1..=4) => Ok(g),
        _ => Err(format!(
            "{ENV_FETCH_GROUPS}={v}: task groups per fetch CTA must be 1 to 4"
        )),
    }
}

/// Launches `kv_fetch_sm` on `stream`: `ctas` CTAs of 256 threads per task
/// group ([`fetch_groups_default`], [`ENV_FETCH_GROUPS`]) striding
/// over the (row, head, i < nfetch) tasks, each copying one (block, head) K+V
/// chunk (2·B·D·2 bytes) from pinned host memory into its slot through UVA
/// with 16-byte loads, 8 in flight per thread. `ctas` = 16 is the default
/// ([`DEFAULT_FETCH_CTAS`]), 32 nears the PCIe ceiling. `rows = 0` is a no-op.
///
/// `whole_sms`: each CTA also asks for all the shared memory a block may
/// have (unused), so that no other kernel's block shares its SM while it
/// runs: the copy CTAs then hold `ctas` SMs outright instead of slowing the
/// compute blocks they would share SMs with (runtime.md §4). Same copies.
///
/// Errors: [`Error::Input`] for `ctas` = 0, D not a multiple of 8, a zero
/// size or address, or a size beyond i32; [`Error::Cuda`] on a launch failure.
pub fn kv_fetch_sm(
    gpu: &Gpu,
    stream: &CudaStream,
    a: &FetchArgs,
    ctas: usize,
    whole_sms: bool,
) -> Result<()> {
    const OP: &str = "kv_fetch_sm";
    if a.rows == 0 || a.kv_heads == 0 {
        return Ok(());
    }
    check_geometry(OP, a.block_size, a.head_dim)?;
    if ctas == 0 || a.slots == 0 || a.slots > SLOT_DIFF_MAX_SLOTS {
        return Err(Error::Input(format!(
            "{OP}: {ctas} CTAs, {} slots: both must be ≥ 1, and the slots at most {SLOT_DIFF_MAX_SLOTS} (slot_diff's pool)",
            a.slots
        )));
    }
    for (what, p) in [
        ("fetch", a.fetch),
        ("nfetch", a.nfetch),
        ("host_tab", a.host_tab),
        ("pool_tab", a.pool_tab),
    ] {
        if p == 0 {
            return Err(Error::Input(format!("{OP}: null address for {what}")));
        }
    }
    i32_dim(a.rows * a.kv_heads, "rows·kv_heads")?;
    let (s, rows, hkv, bs, d) = (
        i32_dim(a.slots, "slots")?,
        i32_dim(a.rows, "rows")?,
        i32_dim(a.kv_heads, "kv_heads")?,
        i32_dim(a.block_size, "block_size")?,
        i32_dim(a.head_dim, "head_dim")?,
    );
    let f = gpu.function(OP)?;
    let smem = if whole_sms {
        // the kernel has no static shared memory: all of it is this request
        let optin = gpu
            .context()
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .cuda("cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")?
            as usize;
        super::select::ensure_smem(gpu, f, optin, 0, "kv_fetch_sm (whole SMs)")?
            .max(FETCH_SMEM_BYTES)
    } else {
        FETCH_SMEM_BYTES
    };
    let cfg = LaunchConfig {
        grid_dim: (grid(ctas, "ctas")?, 1, 1),
        block_dim: (FETCH_THREADS * fetch_groups(whole_sms)?, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut b = stream.launch_builder(f);
    b.arg(&a.fetch)
        .arg(&a.nfetch)
        .arg(&s)
        .arg(&rows)
        .arg(&hkv)
        .arg(&a.host_tab)
        .arg(&a.pool_tab)
        .arg(&bs)
        .arg(&d)
        .arg(&a.cta_log);
    // SAFETY: argument list matches kernels/kv_offload.cu kv_fetch_sm; the
    // caller passes buffers of the documented shapes (the CTA log: `ctas`
    // records, or none); D a multiple of 8.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// B and D usable by the copy kernels: both ≥ 1, D a multiple of 8 (each
/// token row of one head is whole 16-byte pieces).
fn check_geometry(op: &str, block_size: usize, head_dim: usize) -> Result<()> {
    if block_size == 0 || head_dim == 0 || !head_dim.is_multiple_of(8) {
        return Err(Error::Input(format!(
            "{op}: block_size {block_size}, head_dim {head_dim}: both must be ≥ 1 and head_dim a multiple of 8"
        )));
    }
    Ok(())
}

/// Which blocks [`kv_store_blocks`] writes per row.
#[derive(Debug, Clone, Copy)]
pub enum StoreBlocks {
    /// Write-back of a decode step: i32 \[rows\] lens (tokens incl. the new
    /// one); a row with len > 0 and len % B == 0 writes block len/B − 1,
    /// any other row nothing.
    Completed {
        /// Address of i32 \[rows\].
        lens: u64,
    },
    /// Prefill spill: blocks [lo\[r\], hi\[r\]) of each row.
    Range {
        /// Address of i32 \[rows\] first blocks.
        lo: u64,
        /// Address of i32 \[rows\] end blocks (exclusive).
        hi: u64,
    },
}

/// Device addresses and geometry of one `kv_store_blocks` launch.
#[derive(Debug, Clone, Copy)]
pub struct StoreArgs {
    /// u64 \[rows\]: K cache bf16 \[tokens\]\[kv_heads\]\[D\] of each row.
    pub kptr: u64,
    /// u64 \[rows\]: V cache, same layout.
    pub vptr: u64,
    /// u64 \[rows\]: device-visible address of block 0 of each row's host store.
    pub host_tab: u64,
    /// Token t sits at cache row t % ring (the tail ring, 2·B), or row t when 0.
    pub ring: usize,
    /// Rows (sequences).
    pub rows: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Tokens per block, B.
    pub block_size: usize,
    /// Head dim, D (a multiple of 8).
    pub head_dim: usize,
    /// Which blocks.
    pub blocks: StoreBlocks,
}

/// Launches `kv_store_blocks` on `stream`: copies whole blocks of each row's
/// token-major K/V cache into its host tiles (16-byte UVA stores in host byte
/// order). Grid (`grid_x`, rows) × 256 threads, grid-stride; `grid_x` = 0
/// picks 8 (a write-back moves ≤ hkv·32 KiB per row; a spill of many blocks
/// may pass more).
///
/// Errors: [`Error::Input`] for D not a multiple of 8, a ring that does not
/// hold whole blocks (ring % B ≠ 0), a zero address or a size beyond i32;
/// [`Error::Cuda`] on a launch failure.
pub fn kv_store_blocks(gpu: &Gpu, stream: &CudaStream, a: &StoreArgs, grid_x: usize) -> Result<()> {
    const OP: &str = "kv_store_blocks";
    if a.rows == 0 || a.kv_heads == 0 {
        return Ok(());
    }
    check_geometry(OP, a.block_size, a.head_dim)?;
    if !a.ring.is_multiple_of(a.block_size) {
        return Err(Error::Input(format!(
            "{OP}: ring of {} tokens is not whole blocks of {}",
            a.ring, a.block_size
        )));
    }
    for (what, p) in [("kptr", a.kptr), ("vptr", a.vptr), ("host_tab", a.host_tab)] {
        if p == 0 {
            return Err(Error::Input(format!("{OP}: null address for {what}")));
        }
    }
    let (lens, lo, hi) = match a.blocks {
        StoreBlocks::Completed { lens } => (lens, 0u64, 0u64),
        StoreBlocks::Range { lo, hi } => (0, lo, hi),
    };
    if lens == 0 && (lo == 0 || hi == 0) {
        return Err(Error::Input(format!(
            "{OP}: null address for lens / lo / hi"
        )));
    }
    let (hkv, d, bs, ring) = (
        i32_dim(a.kv_heads, "kv_heads")?,
        i32_dim(a.head_dim, "head_dim")?,
        i32_dim(a.block_size, "block_size")?,
        i32_dim(a.ring, "ring")?,
    );
    let f = gpu.function(OP)?;
    let gx = if grid_x == 0 { 8 } else { grid_x };
    let cfg = LaunchConfig {
        grid_dim: (grid(gx, "grid_x")?, grid(a.rows, "rows")?, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    b.arg(&a.kptr)
        .arg(&a.vptr)
        .arg(&a.host_tab)
        .arg(&lens)
        .arg(&lo)
        .arg(&hi)
        .arg(&hkv)
        .arg(&d)
        .arg(&bs)
        .arg(&ring);
    // SAFETY: argument list matches kernels/kv_offload.cu kv_store_blocks; the
    // caller passes buffers of the documented shapes; D a multiple of 8.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// One row of a copy-engine fetch: where its host store and slot pool start.
#[derive(Debug, Clone, Copy)]
pub struct DmaRow {
    /// Address (host or device-visible: same under UVA) of block 0 of the
    /// row's host store.
    pub host: u64,
    /// Device address of the row's slot pool bf16 \[kv_heads\]\[slots\]\[2\]\[B\]\[D\].
    pub pool: u64,
}

/// The copies of a copy-engine fetch, host side: per (row, head) list k
/// the pairs from `from[k]` (all pairs with `from = None`) to `nfetch[k]`,
/// each one (source, destination) of one 2·B·D·2-byte chunk: source
/// `rows[r].host + block·Hkv·chunk + h·chunk` (block-major host store),
/// destination `rows[r].pool + (h·S + slot)·chunk` (slot pool), in list
/// order. The arguments are those of [`fetch_dma`].
///
/// Errors: [`Error::Input`] for B or D unusable by the copy kernels, a
/// shape mismatch (`fetch`, `nfetch`, `from` against rows × Hkv × S), a
/// count above S, a `from` outside 0 ≤ from ≤ nfetch, or a bad pair
/// (negative slot or block, slot ≥ S).
#[allow(clippy::too_many_arguments)]
pub fn dma_copies(
    fetch: &[i32],
    nfetch: &[i32],
    from: Option<&[i32]>,
    slots: usize,
    kv_heads: usize,
    rows: &[DmaRow],
    block_size: usize,
    head_dim: usize,
) -> Result<Vec<(u64, u64)>> {
    const OP: &str = "fetch_dma";
    check_geometry(OP, block_size, head_dim)?;
    let nrh = rows.len() * kv_heads;
    if nfetch.len() != nrh || fetch.len() != nrh * slots * 2 || from.is_some_and(|f| f.len() != nrh)
    {
        return Err(Error::Input(format!(
            "{OP}: nfetch has {} entries, fetch {} and the split's counts {}, expected {nrh}, {} and {nrh} ({} rows × {kv_heads} heads × {slots} slots)",
            nfetch.len(),
            fetch.len(),
            from.map_or(nrh, <[i32]>::len),
            nrh * slots * 2,
            rows.len()
        )));
    }
    let chunk = 2 * block_size * head_dim * 2;
    let block_bytes = kv_heads * chunk;
    let mut copies = Vec::new();
    for (rh, &n) in nfetch.iter().enumerate() {
        let n = n.max(0) as usize;
        if n > slots {
            return Err(Error::Input(format!(
                "{OP}: nfetch {n} > {slots} slots at (row, head) {rh}"
            )));
        }
        let first = match from.map(|f| f[rh]) {
            None => 0,
            Some(f) if f >= 0 && f as usize <= n => f as usize,
            Some(f) => {
                return Err(Error::Input(format!(
                    "{OP}: the split's SM count {f} is outside 0 … {n} at (row, head) {rh}"
                )))
            }
        };
        let (r, h) = (rh / kv_heads, rh % kv_heads);
        let row = rows[r];
        let pairs = &fetch[(rh * slots + first) * 2..(rh * slots + n) * 2];
        for p in pairs.chunks_exact(2) {
            let (slot, block) = (p[0], p[1]);
            if slot < 0 || slot as usize >= slots || block < 0 {
                return Err(Error::Input(format!(
                    "{OP}: bad fetch pair (slot {slot}, block {block}) at (row {r}, head {h}) with {slots} slots"
                )));
            }
            copies.push((
                row.host + (block as usize * block_bytes + h * chunk) as u64,
                row.pool + ((h * slots + slot as usize) * chunk) as u64,
            ));
        }
    }
    Ok(copies)
}

/// The copy-engine fetch: one `cuMemcpyBatchAsync` on `stream` over every
/// (block, head) chunk of the fetch lists (one 2·B·D·2-byte chunk each, host
/// → slot), with one attribute set: source access in stream order, prefer
/// overlap with compute, source hint host, destination hint the device.
///
/// - `fetch`: i32 \[rows\]\[kv_heads\]\[slots\]\[2\] (slot, block) pairs and
///   `nfetch`: i32 \[rows\]\[kv_heads\], as `slot_diff` wrote them, downloaded
///   to the host (pairs past nfetch are ignored; a negative slot or block,
///   or a slot ≥ slots, is an error);
/// - `rows`: per row its host and pool base addresses.
///
/// Returns the bytes enqueued (0 when nothing is to be fetched: no call).
///
/// Errors: [`Error::Input`] on a shape mismatch, a bad pair or nfetch >
/// slots; [`Error::Cuda`] when the driver refuses the batch.
#[allow(clippy::too_many_arguments)]
pub fn fetch_dma(
    gpu: &Gpu,
    stream: &CudaStream,
    fetch: &[i32],
    nfetch: &[i32],
    slots: usize,
    kv_heads: usize,
    rows: &[DmaRow],
    block_size: usize,
    head_dim: usize,
) -> Result<usize> {
    let copies = dma_copies(
        fetch, nfetch, None, slots, kv_heads, rows, block_size, head_dim,
    )?;
    memcpy_batch(gpu, stream, &copies, 2 * block_size * head_dim * 2)
}

/// One `cuMemcpyBatchAsync` on `stream` of `copies` (source, destination),
/// `chunk` bytes each (see [`fetch_dma`] for the attributes). Returns the
/// bytes enqueued; no call for no copies.
fn memcpy_batch(
    gpu: &Gpu,
    stream: &CudaStream,
    copies: &[(u64, u64)],
    chunk: usize,
) -> Result<usize> {
    let total = copies.len();
    if total == 0 {
        return Ok(0);
    }
    let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
    let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
    let mut sizes = vec![chunk; total];
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
        dstLocHint: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: gpu.info().ordinal as i32,
        },
        flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
    };
    let mut attr_idx = [0usize];
    gpu.context()
        .bind_to_thread()
        .cuda("binding the CUDA context")?;
    // SAFETY: dsts/srcs/sizes hold `total` entries each, read during the call;
    // every source lies inside a row's host store and every destination inside
    // its pool (slot < slots checked by dma_copies; block range is the caller's
    // contract, as for the kernel); one attribute set applying from copy 0; a
    // live stream of this context.
    let r = unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            total,
            &mut attrs,
            attr_idx.as_mut_ptr(),
            1,
            stream.cu_stream(),
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Cuda(format!(
            "cuMemcpyBatchAsync of {total} chunks of {chunk} bytes: {r:?}"
        )));
    }
    Ok(total * chunk)
}

/// Where a split fetch's two halves run and meet ([`fetch_split`]).
pub struct SplitStreams<'a> {
    /// The stream the fetch belongs to (the compute stream for the
    /// synchronous fetch, the copy stream for prefetch): the SM kernel's
    /// share runs here, and everything enqueued here afterwards sees both
    /// halves done.
    pub fetch: &'a Arc<CudaStream>,
    /// The side stream the copy engines' share is enqueued on.
    pub ce: &'a Arc<CudaStream>,
    /// Recorded on `fetch` before the copies; `ce` waits for it.
    pub fork: &'a CudaEvent,
    /// Recorded on `ce` after the copies; `fetch` waits for it.
    pub join: &'a CudaEvent,
    /// Stress: a spin of this many ns on `ce` before the copies (0 = none),
    /// so that a missing wait for the copy engines' share shows as wrong
    /// bytes in the identity checks.
    pub ce_delay_ns: u64,
    /// The SM kernel's CTAs hold whole SMs ([`kv_fetch_sm`]'s `whole_sms`).
    pub whole_sms: bool,
}

/// The split fetch (runtime.md §4, [`crate::kv::split`]): one layer's
/// misses, `ce_pct` % (1 … 99) through the copy engines and the rest
/// through `kv_fetch_sm` on `ctas` CTAs, at the same time.
///
/// - `a`: the device lists and tables, as for [`kv_fetch_sm`];
/// - `fetch`, `nfetch`: the same lists downloaded to the host (i32
///   \[rows\]\[Hkv\]\[S\]\[2\] and \[rows\]\[Hkv\]);
/// - `rows`: the host and pool bases per row, as for [`fetch_dma`];
/// - `sm_counts`: a device buffer of ≥ rows·Hkv i32 that the SM kernel's
///   per-list counts are copied to (stream-ordered on `s.fetch`; it must
///   stay untouched until the kernel has run — give each layer its own).
///
/// Ordering (why the attention of the layer waits for both halves): the
/// copy engines' share waits on `s.fork`, recorded on `s.fetch` after
/// everything the fetch must follow (the set difference that freed the
/// slots, and in prefetch mode the copy stream's wait for it); the SM
/// kernel's share runs on `s.fetch` in order; then `s.fetch` waits on
/// `s.join`, recorded after the copies. So whatever the caller enqueues on
/// `s.fetch` next — the attention in the synchronous mode, the `fetched(l)`
/// event that the compute stream waits for before the attention in
/// prefetch mode — follows both halves. The two halves write disjoint slots
/// (each pair is in one half only), so they need no order between them.
///
/// Returns the plan applied (counts per engine); nothing is enqueued when
/// the layer has no misses, and only one engine runs when its share rounds
/// to every pair.
///
/// Errors: [`Error::Input`] for a share outside 1 … 99, a bad list or
/// shape ([`dma_copies`]), `sm_counts` shorter than rows·Hkv, or the
/// kernel's argument checks; [`Error::Cuda`] on an event, copy or launch
/// failure.
#[allow(clippy::too_many_arguments)]
pub fn fetch_split<C: DevicePtrMut<i32>>(
    gpu: &Gpu,
    s: &SplitStreams<'_>,
    a: &FetchArgs,
    fetch: &[i32],
    nfetch: &[i32],
    rows: &[DmaRow],
    sm_counts: &mut C,
    ctas: usize,
    ce_pct: usize,
) -> Result<crate::kv::split::SplitPlan> {
    const OP: &str = "fetch_split";
    let plan = crate::kv::split::split_misses(nfetch, a.slots, ce_pct)?;
    if rows.len() != a.rows {
        return Err(Error::Input(format!(
            "{OP}: {} row addresses for {} rows",
            rows.len(),
            a.rows
        )));
    }
    if plan.total() == 0 {
        return Ok(plan);
    }
    // The lists are checked, and the SM share's counts uploaded, before the
    // copy engines' batch is enqueued, and the small upload cannot queue
    // behind the batch on a copy engine. A launch that still fails after the
    // batch (the SM kernel's) leaves the fetch stream waiting for the batch
    // (below), so no copy is left behind unwaited.
    let copies = if plan.ce_chunks > 0 {
        dma_copies(
            fetch,
            nfetch,
            Some(&plan.sm),
            a.slots,
            a.kv_heads,
            rows,
            a.block_size,
            a.head_dim,
        )?
    } else {
        Vec::new()
    };
    if plan.sm_chunks > 0 {
        if sm_counts.len() < plan.sm.len() {
            return Err(Error::Input(format!(
                "{OP}: {} SM counts fit a buffer of {}",
                plan.sm.len(),
                sm_counts.len()
            )));
        }
        s.fetch
            .memcpy_htod(&plan.sm, sm_counts)
            .cuda("host→device copy of the split's SM counts")?;
    }
    if plan.ce_chunks > 0 {
        s.fork.record(s.fetch).cuda("cuEventRecord (split fork)")?;
        s.ce.wait(s.fork).cuda("cuStreamWaitEvent (split fork)")?;
        if s.ce_delay_ns > 0 {
            let f = gpu.function("spin_wait")?;
            let mut b = s.ce.launch_builder(f);
            b.arg(&s.ce_delay_ns);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches spin_wait (kernels/forecast.cu).
            unsafe { b.launch(cfg) }.cuda("spin_wait (split stress)")?;
        }
        memcpy_batch(gpu, s.ce, &copies, 2 * a.block_size * a.head_dim * 2)?;
        s.join.record(s.ce).cuda("cuEventRecord (split join)")?;
    }
    if plan.sm_chunks > 0 {
        let args = FetchArgs {
            nfetch: dptr_mut(gpu, sm_counts),
            ..*a
        };
        let r = kv_fetch_sm(gpu, s.fetch, &args, ctas, s.whole_sms);
        if r.is_err() && plan.ce_chunks > 0 {
            // the fetch stream still waits for the copies already enqueued
            let _ = s.fetch.wait(s.join);
        }
        r?;
    }
    if plan.ce_chunks > 0 {
        s.fetch
            .wait(s.join)
            .cuda("cuStreamWaitEvent (split join)")?;
    }
    Ok(plan)
}

#[cfg(test)]
mod smem_tests {
    /// The value of `#define NAME …` in kernels/kv_offload.cu.
    fn define(name: &str) -> String {
        let src = include_str!("../../../kernels/kv_offload.cu");
        let key = format!("#define {name} ");
        let line = src
            .lines()
            .find(|l| l.starts_with(&key))
            .unwrap_or_else(|| panic!("{key} not in kernels/kv_offload.cu"));
        line[key.len()..]
            .split("//")
            .next()
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn fetch_shared_memory_matches_the_kernel() {
        assert_eq!(define("FETCH_SCAN"), "512");
        assert_eq!(define("FETCH_SMEM_INTS"), "(FETCH_SCAN + 1 + 32)");
        assert_eq!(define("FETCH_THREADS"), super::FETCH_THREADS.to_string());
        // the kernel's launch bounds take the most task groups the host may ask for
        let src = include_str!("../../../kernels/kv_offload.cu");
        assert!(src.contains("__launch_bounds__(FETCH_THREADS * 4) void kv_fetch_sm("));
        assert_eq!(super::FETCH_SMEM_BYTES, (512 + 1 + 32) * 4);
    }

    #[test]
    fn fetch_groups_parse_and_default() {
        assert_eq!(super::parse_fetch_groups("1"), Ok(1));
        assert_eq!(super::parse_fetch_groups(" 4 "), Ok(4));
        for bad in ["0", "5", "two", ""] {
            let e = super::parse_fetch_groups(bad).unwrap_err();
            assert!(
                e.contains("SPARDA_FETCH_GROUPS") && e.contains("1 to 4"),
                "{e}"
            );
        }
        assert_eq!(super::fetch_groups_default(true), 4);
        assert_eq!(super::fetch_groups_default(false), 1);
    }
}

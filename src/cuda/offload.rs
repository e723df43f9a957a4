//! The offloaded KV cache on the GPU (runtime.md §1 steps 4–5, §2, §4): the
//! pinned host store, the slot diff, the fetch of missing (block, head)
//! chunks (an SM kernel reading host memory through UVA, or the copy engines
//! through one `cuMemcpyBatchAsync`), and the write of completed blocks back
//! to host memory. Kernels: `kernels/kv_offload.cu`; CPU oracles:
//! [`crate::kv`] ([`plan_slots`](crate::kv::plan_slots),
//! [`ring_first`](crate::kv::ring_first), [`HostLayout`](crate::kv::HostLayout));
//! checks: [`super::check_offload`].
//!
//! Layouts (B = block size, D = head dim, hkv = KV heads, S = pool slots per
//! (sequence, layer, KV head)):
//! - host store per (sequence, layer): block-major, block b of head h is its
//!   K tile then its V tile, [B, D] bf16 each, at byte
//!   `b · block_bytes + h · 2 · tile_bytes` ([`HostLayout`](crate::kv::HostLayout));
//! - slot pool per (sequence, layer): bf16 \[hkv\]\[S\]\[2\]\[B\]\[D\];
//! - slot map per (sequence, layer): i32 \[hkv\]\[S\], block id or −1;
//! - fetch list: i32 \[rows\]\[hkv\]\[S\]\[2\] (slot, block) pairs, nfetch i32 \[rows\]\[hkv\].
//!
//! The launch wrappers take raw device addresses (like `ops::AttnArgs`) and
//! an explicit stream, since the engine runs the fetch on a copy stream.

use super::context::{grid, i32_dim, CudaResultExt};
use super::Gpu;
use crate::{Error, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Threads per block of `slot_diff` (`SD_THREADS` in kernels/kv_offload.cu).
const SLOT_DIFF_THREADS: u32 = 128;
/// Largest pool (slots per (sequence, layer, KV head)) `slot_diff` handles.
pub const SLOT_DIFF_MAX_SLOTS: usize = 1024;
/// Largest selection list width `slot_diff` handles.
pub const SLOT_DIFF_MAX_SEL: usize = 1024;
/// Threads per CTA of `kv_fetch_sm` (`FETCH_THREADS`).
const FETCH_THREADS: u32 = 256;
/// Default CTA count of the SM fetch (runtime.md §2: every GPU but the
/// H100 / A100 at large batch gets 16).
pub const DEFAULT_FETCH_CTAS: usize = 16;

/// A pinned, device-mapped host buffer (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`, not write-combined, so the CPU reads it at full
/// speed): the host store of the offloaded KV cache. Kernels reach it
/// through [`PinnedKv::device_ptr`] (UVA); freed on drop.
pub struct PinnedKv {
    host: *mut u8,
    dev: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain pinned host memory owned by this value; the
// context handle is thread-safe (bound before every driver call).
unsafe impl Send for PinnedKv {}
// SAFETY: shared references only read (read() copies out); writes need &mut.
unsafe impl Sync for PinnedKv {}

impl std::fmt::Debug for PinnedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedKv")
            .field("host", &self.host)
            .field("dev", &format_args!("{:#x}", self.dev))
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedKv {
    /// Allocates `bytes` of pinned, device-mapped host memory on `gpu`'s
    /// context (contents unspecified).
    ///
    /// Errors: [`Error::Input`] for 0 bytes; [`Error::Cuda`] naming the bytes
    /// requested when the driver refuses (out of pinnable memory), or when
    /// the device pointer cannot be obtained.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<PinnedKv> {
        if bytes == 0 {
            return Err(Error::Input(
                "pinned KV store: 0 bytes requested".to_string(),
            ));
        }
        let ctx = gpu.context().clone();
        ctx.bind_to_thread().cuda("binding the CUDA context")?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the context is current on this thread.
        let r = unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || p.is_null() {
            return Err(Error::Cuda(format!(
                "cuMemHostAlloc of {bytes} bytes ({:.2} GiB) of pinned host memory failed: {r:?}",
                bytes as f64 / (1u64 << 30) as f64
            )));
        }
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: p was just allocated with DEVICEMAP on this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: p came from cuMemHostAlloc and is freed once.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(Error::Cuda(format!(
                "cuMemHostGetDevicePointer for {bytes} bytes of pinned host memory: {r:?}"
            )));
        }
        Ok(PinnedKv {
            host: p.cast(),
            dev,
            len: bytes,
            ctx,
        })
    }

    /// The host address (also valid on the device under UVA).
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The device-visible address of byte 0 (`cuMemHostGetDevicePointer`).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: 0-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, offset: usize, n: usize) -> Result<()> {
        if offset.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(Error::Input(format!(
                "pinned KV store: bytes {offset}..{} out of range (0..{})",
                offset.saturating_add(n),
                self.len
            )));
        }
        Ok(())
    }

    /// Copies `out.len()` bytes starting at `offset` out of the buffer. Call
    /// it after the GPU work that writes the range has completed (e.g. after
    /// [`Gpu::synchronize`]); bytes written concurrently are unspecified.
    ///
    /// Errors: [`Error::Input`] when the range exceeds the buffer.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.range(offset, out.len())?;
        // SAFETY: in range (checked); `out` is a distinct Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(self.host.add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Copies `data` into the buffer at `offset`. GPU work reading the range
    /// must not be in flight.
    ///
    /// Errors: [`Error::Input`] when the range exceeds the buffer.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        self.range(offset, data.len())?;
        // SAFETY: in range (checked); `data` is a distinct Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.host.add(offset), data.len()) };
        Ok(())
    }

    /// The whole buffer as a byte slice.
    ///
    /// # Safety
    /// No GPU work that writes the buffer may be in flight while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.host, self.len)
    }

    /// The whole buffer as a mutable byte slice.
    ///
    /// # Safety
    /// No GPU work that reads or writes the buffer may be in flight while the
    /// slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.host, self.len)
    }
}

impl PinnedKv {
    /// Waits for all work on the buffer's context (every stream): before
    /// freeing memory that kernels or copies may still use.
    ///
    /// Errors: [`Error::Cuda`] when the context cannot synchronise.
    pub fn synchronize_context(&self) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(|e| Error::Cuda(format!("cuCtxSynchronize: {e}")))
    }
}

impl Drop for PinnedKv {
    /// Waits for the context's work (a kernel may still read or write the
    /// buffer through its device pointer), then frees it.
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return; // the context is gone; nothing safe to do
        }
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!("synchronising before cuMemFreeHost: {e}");
        }
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed exactly once here.
        let r = unsafe { sys::cuMemFreeHost(self.host.cast()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("cuMemFreeHost of {} pinned bytes: {r:?}", self.len);
        }
    }
}

/// `MemAvailable` of /proc/meminfo in bytes: the host memory that can still
/// be pinned without swapping (compare with
/// [`Footprint::host_pinned_bytes`](crate::kv::Footprint) via
/// [`Footprint::check`](crate::kv::Footprint::check)).
///
/// Errors: [`Error::Io`] when /proc/meminfo cannot be read,
/// [`Error::Limit`] when it has no parsable `MemAvailable` line.
pub fn host_available_bytes() -> Result<usize> {
    let path = std::path::Path::new("/proc/meminfo");
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_mem_available(&text).ok_or_else(|| {
        Error::Limit("/proc/meminfo has no parsable `MemAvailable: N kB` line".to_string())
    })
}

/// The `MemAvailable: N kB` line of a /proc/meminfo text, in bytes.
fn parse_mem_available(text: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line["MemAvailable:".len()..].split_whitespace();
    let n: usize = it.next()?.parse().ok()?;
    let mult = match it.next() {
        Some("kB") | Some("KB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    n.checked_mul(mult)
}

/// Device addresses and geometry of one `slot_diff` launch: the set
/// difference between each (row, KV head)'s new selection and its slot map,
/// exactly [`kv::plan_slots`](crate::kv::plan_slots)`(slots, selected,
/// ring_first(len))` per (row, head).
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
}

/// Launches `slot_diff` (grid (rows, kv_heads), 128 threads) on `stream`.
/// `rows = 0` is a no-op.
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
        .arg(&a.stats);
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
    /// store ([`PinnedKv::device_ptr`] + the (sequence, layer) offset).
    pub host_tab: u64,
    /// u64 \[rows\]: address of each row's slot pool bf16 \[kv_heads\]\[slots\]\[2\]\[B\]\[D\].
    pub pool_tab: u64,
    /// Tokens per block, B.
    pub block_size: usize,
    /// Head dim, D (a multiple of 8).
    pub head_dim: usize,
}

/// Launches `kv_fetch_sm` on `stream`: `ctas` CTAs × 256 threads striding
/// over the (row, head, i < nfetch) tasks, each copying one (block, head) K+V
/// chunk (2·B·D·2 bytes) from pinned host memory into its slot through UVA
/// with 16-byte loads, 8 in flight per thread. `ctas` = 16 is the default
/// ([`DEFAULT_FETCH_CTAS`]), 32 nears the PCIe ceiling. `rows = 0` is a no-op.
///
/// Errors: [`Error::Input`] for `ctas` = 0, D not a multiple of 8, a zero
/// size or address, or a size beyond i32; [`Error::Cuda`] on a launch failure.
pub fn kv_fetch_sm(gpu: &Gpu, stream: &CudaStream, a: &FetchArgs, ctas: usize) -> Result<()> {
    const OP: &str = "kv_fetch_sm";
    if a.rows == 0 || a.kv_heads == 0 {
        return Ok(());
    }
    check_geometry(OP, a.block_size, a.head_dim)?;
    if ctas == 0 || a.slots == 0 {
        return Err(Error::Input(format!(
            "{OP}: {ctas} CTAs, {} slots: both must be ≥ 1",
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
    let cfg = LaunchConfig {
        grid_dim: (grid(ctas, "ctas")?, 1, 1),
        block_dim: (FETCH_THREADS, 1, 1),
        shared_mem_bytes: 0,
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
        .arg(&d);
    // SAFETY: argument list matches kernels/kv_offload.cu kv_fetch_sm; the
    // caller passes buffers of the documented shapes; D a multiple of 8.
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
    const OP: &str = "fetch_dma";
    check_geometry(OP, block_size, head_dim)?;
    let nrh = rows.len() * kv_heads;
    if nfetch.len() != nrh || fetch.len() != nrh * slots * 2 {
        return Err(Error::Input(format!(
            "{OP}: nfetch has {} entries and fetch {}, expected {nrh} and {} ({} rows × {kv_heads} heads × {slots} slots)",
            nfetch.len(),
            fetch.len(),
            nrh * slots * 2,
            rows.len()
        )));
    }
    let tile = block_size * head_dim * 2;
    let chunk = 2 * tile;
    let block_bytes = kv_heads * chunk;
    let total: usize = nfetch.iter().map(|&n| n.max(0) as usize).sum();
    if total == 0 {
        return Ok(0);
    }
    let mut dsts: Vec<sys::CUdeviceptr> = Vec::with_capacity(total);
    let mut srcs: Vec<sys::CUdeviceptr> = Vec::with_capacity(total);
    for (rh, &n) in nfetch.iter().enumerate() {
        let n = n.max(0) as usize;
        if n > slots {
            return Err(Error::Input(format!(
                "{OP}: nfetch {n} > {slots} slots at (row, head) {rh}"
            )));
        }
        let (r, h) = (rh / kv_heads, rh % kv_heads);
        let row = rows[r];
        let pairs = &fetch[rh * slots * 2..rh * slots * 2 + n * 2];
        for p in pairs.chunks_exact(2) {
            let (slot, block) = (p[0], p[1]);
            if slot < 0 || slot as usize >= slots || block < 0 {
                return Err(Error::Input(format!(
                    "{OP}: bad fetch pair (slot {slot}, block {block}) at (row {r}, head {h}) with {slots} slots"
                )));
            }
            srcs.push(row.host + (block as usize * block_bytes + h * chunk) as u64);
            dsts.push(row.pool + (((h * slots + slot as usize) * 2) * tile) as u64);
        }
    }
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
    // its pool (slot < slots checked; block range is the caller's contract, as
    // for the kernel); one attribute set applying from copy 0; a live stream
    // of this context.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_parses() {
        let t = "MemTotal:       131000000 kB\nMemFree:  5 kB\nMemAvailable:   1000 kB\n";
        assert_eq!(parse_mem_available(t), Some(1000 * 1024));
        assert_eq!(parse_mem_available("MemFree: 3 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: 7 MB\n"), None);
    }

    #[test]
    fn host_available_reads_proc_on_linux() {
        if std::path::Path::new("/proc/meminfo").exists() {
            let b = host_available_bytes().expect("MemAvailable");
            assert!(b > 0);
        }
    }
}

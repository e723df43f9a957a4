//! The pinned host store of offloaded KV (runtime.md §1, §4): page-locked,
//! device-mapped host memory that holds every offloaded layer's full K/V in
//! the block-major layout of [`HostLayout`](crate::kv::HostLayout) (block b
//! of head h is its K tile then its V tile, [B, D] bf16 each), readable by
//! kernels through unified virtual addressing; and how much host memory is
//! free for it.

use crate::cuda::context::CudaResultExt;
use crate::cuda::Gpu;
use crate::{Error, Result};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use std::io::Write;
use std::sync::Arc;

/// A pinned, device-mapped host buffer (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`, not write-combined, so the CPU reads it at full
/// speed): the host store of the offloaded KV cache. Kernels reach it
/// through [`PinnedKv::device_ptr`] (UVA); freed on drop.
pub struct PinnedKv {
    host: *mut u8,
    dev: u64,
    len: usize,
    ctx: Arc<CudaContext>,
    /// How the memory was obtained, and so how it is freed.
    pages: HostPages,
    /// With [`HostPages::Huge`], the registered length (`len` rounded up to
    /// 2 MiB): the mapping is exactly [host, host + it).
    mapped: usize,
}

/// How the pinned host store gets its memory (`SPARDA_HOST_PAGES`).
///
/// - `Driver` (the default): `cuMemHostAlloc` with `DEVICEMAP | PORTABLE`.
/// - `Huge` (`SPARDA_HOST_PAGES=huge`): an anonymous mapping aligned to
///   2 MiB and advised for transparent huge pages (`madvise(MADV_HUGEPAGE)`),
///   then pinned and mapped for the device with `cuMemHostRegister`
///   (`DEVICEMAP | PORTABLE`). An experiment on the cost of address
///   translation for the fetch's random 32 KiB reads across tens of GiB of
///   host memory (traces/README.md, "beside a fetch"); the bytes and the
///   addresses kernels read are the same either way, so results are too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostPages {
    /// `cuMemHostAlloc`.
    Driver,
    /// A 2 MiB-aligned THP mapping registered with `cuMemHostRegister`.
    Huge,
}

impl HostPages {
    /// From `SPARDA_HOST_PAGES` (`huge`, else the default).
    ///
    /// Errors: [`Error::Input`] for a value other than `driver` or `huge`.
    pub fn from_env() -> Result<HostPages> {
        Self::parse(std::env::var("SPARDA_HOST_PAGES").ok().as_deref())
    }

    /// A `SPARDA_HOST_PAGES` value (`None`: unset).
    ///
    /// Errors: [`Error::Input`] for a value other than `driver` or `huge`.
    pub fn parse(v: Option<&str>) -> Result<HostPages> {
        match v {
            None | Some("") | Some("driver") => Ok(HostPages::Driver),
            Some("huge") => Ok(HostPages::Huge),
            Some(other) => Err(Error::Input(format!(
                "SPARDA_HOST_PAGES={other}: expected `driver` (cuMemHostAlloc, the default) or `huge` (a transparent-huge-page mapping registered with cuMemHostRegister)"
            ))),
        }
    }

    /// The name reports give it: `driver` or `huge`.
    pub fn name(self) -> &'static str {
        match self {
            HostPages::Driver => "driver",
            HostPages::Huge => "huge",
        }
    }
}

/// 2 MiB: the transparent huge page size on x86-64.
const HUGE_PAGE: usize = 2 << 20;

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
    /// context (contents unspecified) with `cuMemHostAlloc`
    /// ([`HostPages::Driver`]).
    ///
    /// Errors: [`Error::Input`] for 0 bytes; [`Error::Cuda`] naming the bytes
    /// requested when the driver refuses (out of pinnable memory), or when
    /// the device pointer cannot be obtained.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<PinnedKv> {
        Self::with_pages(gpu, bytes, HostPages::Driver)
    }

    /// [`PinnedKv::new`] with the memory obtained as `pages` says (the
    /// offloaded KV store passes [`HostPages::from_env`]).
    ///
    /// Errors: as [`PinnedKv::new`]; with [`HostPages::Huge`] also
    /// [`Error::Limit`] when the mapping cannot be made (its size overflows
    /// or `mmap` refuses) and [`Error::Cuda`] when `cuMemHostRegister`
    /// refuses.
    pub fn with_pages(gpu: &Gpu, bytes: usize, pages: HostPages) -> Result<PinnedKv> {
        if bytes == 0 {
            return Err(Error::Input(
                "pinned KV store: 0 bytes requested".to_string(),
            ));
        }
        let ctx = gpu.context().clone();
        ctx.bind_to_thread().cuda("binding the CUDA context")?;
        if pages == HostPages::Huge {
            return Self::new_huge(ctx, bytes);
        }
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
            pages: HostPages::Driver,
            mapped: 0,
        })
    }

    /// [`HostPages::Huge`]: `bytes` rounded up to 2 MiB, mapped at a 2 MiB
    /// boundary (a mapping 2 MiB larger, its unaligned head and tail
    /// unmapped), advised for huge pages and registered (the context is
    /// current). The first such store of the process says on stderr how
    /// much of it the kernel backs with huge pages (/proc/self/smaps).
    fn new_huge(ctx: Arc<CudaContext>, bytes: usize) -> Result<PinnedKv> {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let (len, total) = bytes
            .checked_next_multiple_of(HUGE_PAGE)
            .and_then(|l| Some((l, l.checked_add(HUGE_PAGE)?)))
            .ok_or_else(|| {
                Error::Limit(format!(
                    "pinned KV store (SPARDA_HOST_PAGES=huge): {bytes} bytes cannot be rounded to 2 MiB pages"
                ))
            })?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Limit(format!(
                "pinned KV store (SPARDA_HOST_PAGES=huge): mmap of {total} bytes ({:.2} GiB) failed: {}",
                gib(total),
                std::io::Error::last_os_error()
            )));
        }
        let base = base.cast::<u8>();
        let head = base.align_offset(HUGE_PAGE);
        let host = base.wrapping_add(head);
        // Keep exactly [host, host + len): the unaligned head and the tail
        // (2 MiB together) go back at once.
        // SAFETY: both ranges lie inside the mapping just made and are
        // page-aligned (mmap returns page-aligned addresses; head, len and
        // total are page multiples).
        unsafe {
            if head > 0 {
                libc::munmap(base.cast(), head);
            }
            if head < HUGE_PAGE {
                libc::munmap(host.wrapping_add(len).cast(), HUGE_PAGE - head);
            }
        }
        let unmap = || {
            // SAFETY: [host, host + len) is what is left of the mapping; called
            // once, on an error path.
            unsafe { libc::munmap(host.cast(), len) };
        };
        // SAFETY: [host, host + len) is mapped. The advice is a hint: where THP
        // is off the range keeps small pages.
        if unsafe { libc::madvise(host.cast(), len, libc::MADV_HUGEPAGE) } != 0 {
            tracing::warn!(
                "madvise(MADV_HUGEPAGE) on the pinned KV store: {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: the range is mapped read-write and stays mapped until drop.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                host.cast(),
                len,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            unmap();
            return Err(Error::Cuda(format!(
                "cuMemHostRegister of {len} bytes ({:.2} GiB) of huge-page host memory failed: {r:?}",
                gib(len)
            )));
        }
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: the range was just registered with DEVICEMAP on this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: registered above, unregistered once on this error path.
            unsafe { sys::cuMemHostUnregister(host.cast()) };
            unmap();
            return Err(Error::Cuda(format!(
                "cuMemHostGetDevicePointer for {len} bytes of registered host memory: {r:?}"
            )));
        }
        let kv = PinnedKv {
            host,
            dev,
            len: bytes,
            ctx,
            pages: HostPages::Huge,
            mapped: len,
        };
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            let huge = std::fs::read_to_string("/proc/self/smaps")
                .ok()
                .and_then(|t| smaps_anon_huge_bytes(&t, host as usize))
                .map_or("an unknown part".to_string(), |h| format!("{:.2} GiB", gib(h)));
            // a failed write to stderr is not worth a panic here
            let _ = writeln!(
                std::io::stderr(),
                "pinned KV store (SPARDA_HOST_PAGES=huge): the first store registers {:.2} GiB, {huge} of it in huge pages (/proc/self/smaps AnonHugePages)",
                gib(len)
            );
        });
        Ok(kv)
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
        match self.pages {
            HostPages::Driver => {
                // SAFETY: allocated by cuMemHostAlloc in `new`, freed exactly once here.
                let r = unsafe { sys::cuMemFreeHost(self.host.cast()) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    tracing::warn!("cuMemFreeHost of {} pinned bytes: {r:?}", self.len);
                }
            }
            HostPages::Huge => {
                // SAFETY: registered in `new_huge`, unregistered exactly once here.
                let r = unsafe { sys::cuMemHostUnregister(self.host.cast()) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    tracing::warn!("cuMemHostUnregister of {} bytes: {r:?}", self.len);
                }
                // SAFETY: the mapping made in `new_huge`, unmapped exactly once here.
                unsafe { libc::munmap(self.host.cast(), self.mapped) };
            }
        }
    }
}

/// `MemAvailable` of /proc/meminfo in bytes: the host memory that can still
/// be pinned without swapping (compare with
/// [`Footprint::host_pinned_bytes`](crate::kv::Footprint) via
/// [`crate::memory::check`]).
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
    meminfo_bytes(text, "MemAvailable")
}

/// The `AnonHugePages` of the mapping that holds address `addr` in a
/// /proc/self/smaps text (bytes of it backed by transparent huge pages).
/// A mapping starts with a header line whose first field is its address
/// range (`start-end`, hex); its `Key: value` lines follow.
fn smaps_anon_huge_bytes(text: &str, addr: usize) -> Option<usize> {
    let mut inside = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a <= addr && addr < b;
                continue;
            }
        }
        if inside {
            if let Some(v) = meminfo_bytes(line, "AnonHugePages") {
                return Some(v);
            }
        }
    }
    None
}

/// The `KEY: N kB` line of a /proc/meminfo text, in bytes.
fn meminfo_bytes(text: &str, key: &str) -> Option<usize> {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))?;
    let mut it = line[key.len() + 1..].split_whitespace();
    let n: usize = it.next()?.parse().ok()?;
    let mult = match it.next() {
        Some("kB") | Some("KB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    n.checked_mul(mult)
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
        // a key is matched whole: `MemAvailableX` is not `MemAvailable`
        assert_eq!(parse_mem_available("MemAvailableX: 4 kB\n"), None);
        let t = "AnonPages: 7 kB\nAnonHugePages:   4096 kB\n";
        assert_eq!(meminfo_bytes(t, "AnonHugePages"), Some(4 << 20));
        assert_eq!(meminfo_bytes(t, "AnonPages"), Some(7 << 10));
    }

    #[test]
    fn smaps_gives_the_huge_pages_of_the_mapping_holding_an_address() {
        let t = "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\n\
                 Size:               4096 kB\n\
                 AnonHugePages:      2048 kB\n\
                 7f0000400000-7f0000800000 rw-p 00000000 00:00 0 \n\
                 Size:               4096 kB\n\
                 AnonHugePages:      4096 kB\n\
                 VmFlags: rd wr mr mw me ac hg\n";
        assert_eq!(smaps_anon_huge_bytes(t, 0x7f00_0000_1000), Some(2 << 20));
        assert_eq!(smaps_anon_huge_bytes(t, 0x7f00_0040_0000), Some(4 << 20));
        assert_eq!(smaps_anon_huge_bytes(t, 0x7f00_0080_0000), None);
        assert_eq!(smaps_anon_huge_bytes("", 1), None);
    }

    #[test]
    fn host_pages_setting_parses_and_names_a_bad_value() {
        assert_eq!(HostPages::parse(None).unwrap(), HostPages::Driver);
        assert_eq!(HostPages::parse(Some("")).unwrap(), HostPages::Driver);
        assert_eq!(HostPages::parse(Some("driver")).unwrap(), HostPages::Driver);
        assert_eq!(HostPages::parse(Some("huge")).unwrap(), HostPages::Huge);
        let e = HostPages::parse(Some("2m")).unwrap_err().to_string();
        assert!(
            e.contains("SPARDA_HOST_PAGES=2m") && e.contains("huge"),
            "{e}"
        );
        assert_eq!(HostPages::Huge.name(), "huge");
    }

    #[test]
    fn host_available_reads_proc_on_linux() {
        if std::path::Path::new("/proc/meminfo").exists() {
            let b = host_available_bytes().expect("MemAvailable");
            assert!(b > 0);
        }
    }
}

//! Prefill attention on the tensor cores (kernels/attn_prefill.cu, spec §6):
//! the dense causal kernel and the block-sparse one over the union of a
//! tile's selected blocks, their work items (tiles, union lists), shared
//! memory opt-ins and typed entry points the GPU checks call.

use super::*;

/// (row, query head) pairs per thread block of the prefill attention kernel
/// (`PF_BM` in kernels/attn_prefill.cu): the M dimension of its tiles.
pub const PREFILL_TILE_M: usize = 64;
/// Keys per shared-memory tile of the prefill attention kernel (`PF_BN`).
pub const PREFILL_TILE_N: usize = 64;
/// Threads per block of the prefill attention kernel (`PF_THREADS`).
const PREFILL_THREADS: u32 = 128;
/// The prefill attention kernels and the head dim each is compiled for
/// (kernels/attn_prefill.cu); other head dims take the rowwise path.
pub const PREFILL_ATTN_FUNCTIONS: [(&str, usize); 3] = [
    ("attn_prefill_d64", 64),
    ("attn_prefill_d80", 80),
    ("attn_prefill_d128", 128),
];

/// Dynamic shared memory of the prefill attention kernel at head dim `d`,
/// bytes: [`prefill_stages`] stages of K and V tiles of [`PREFILL_TILE_N`]
/// rows of d + 8 bf16 ([`prefill_smem_bytes_at`]).
pub fn prefill_smem_bytes(d: usize) -> usize {
    prefill_smem_bytes_at(d, prefill_stages())
}

/// Dynamic shared memory of the prefill attention kernel at head dim `d`
/// with `stages` K/V stages, bytes (69,632 at d = 128 and 2 stages).
pub const fn prefill_smem_bytes_at(d: usize, stages: usize) -> usize {
    2 * stages * PREFILL_TILE_N * (d + 8) * 2
}

/// Shared-memory stages the prefill attention kernels are compiled with:
/// 3 for a `-DPF_STAGES=3` (or `--define-macro=PF_STAGES=3`) in
/// `$SPARDA_NVRTC_OPTIONS`, otherwise 2 (the
/// default, one block barrier per key tile; `-DPF_STAGES=0` is the earlier
/// double buffer with two barriers per tile, also 2 stages). What the host
/// sizes shared memory for. Read once.
pub fn prefill_stages() -> usize {
    static STAGES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *STAGES.get_or_init(|| prefill_stages_from(&crate::cuda::context::env_nvrtc_options()))
}

/// [`prefill_stages`]'s rule on the NVRTC options: the last `-DPF_STAGES=`
/// or `--define-macro=PF_STAGES=` wins; a value other than 0, 2 or 3 is left to fail the kernel's compile
/// (its `#error` names the values) and sizes for 2 here.
fn prefill_stages_from(opts: &[String]) -> usize {
    opts.iter()
        .rev()
        .find_map(|o| {
            o.strip_prefix("-DPF_STAGES=")
                .or_else(|| o.strip_prefix("--define-macro=PF_STAGES="))
        })
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&s| s == 3)
        .unwrap_or(2)
}

/// The prefill attention kernel for head dim `d`.
///
/// Errors: [`Error::Input`] naming `d` and the supported head dims when
/// there is none (64, 80, 128).
pub fn prefill_attn_function(op: &str, d: usize) -> Result<&'static str> {
    PREFILL_ATTN_FUNCTIONS
        .iter()
        .find(|(_, dd)| *dd == d)
        .map(|(f, _)| *f)
        .ok_or_else(|| {
            Error::Input(format!(
                "{op}: head dim {d} has no tensor-core prefill attention kernel (D = 64, 80 or 128); use the rowwise prefill attention"
            ))
        })
}

/// The work items of one prefill attention launch, from the call's query
/// rows `rows` = (sequence, position) in row order and the GQA group G =
/// H / Hkv: i32 triples (first row r0 of a run, rows in the run, first
/// flattened entry m0), one per thread block (and KV head). A run is a
/// maximal range of consecutive rows of one sequence at consecutive
/// positions; its (row, query head) pairs are flattened as m = i·G + g and
/// cut into tiles of [`PREFILL_TILE_M`]. Tiles come longest context first
/// (descending last position, ties in row order), so the blocks with the
/// most keys start in the first wave.
///
/// Errors: [`Error::Input`] for no rows, G = 0, or counts past i32.
pub fn prefill_tiles(rows: &[(usize, usize)], group: usize) -> Result<Vec<i32>> {
    if rows.is_empty() || group == 0 {
        return Err(Error::Input(format!(
            "prefill tiles: {} rows, GQA group {group} (need ≥ 1 of each)",
            rows.len()
        )));
    }
    // (last position, r0, nrows, m0) per tile.
    let mut tiles: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut r0 = 0;
    while r0 < rows.len() {
        let (seq, pos0) = rows[r0];
        let mut n = 1;
        while r0 + n < rows.len() && rows[r0 + n] == (seq, pos0 + n) {
            n += 1;
        }
        let entries = n * group;
        for m0 in (0..entries).step_by(PREFILL_TILE_M) {
            let last = (m0 + PREFILL_TILE_M).min(entries) - 1;
            tiles.push((pos0 + last / group, r0, n, m0));
        }
        r0 += n;
    }
    tiles.sort_by_key(|t| std::cmp::Reverse(t.0));
    let mut out = Vec::with_capacity(3 * tiles.len());
    for (_, r0, n, m0) in tiles {
        out.push(i32_dim(r0, "prefill tile row")?);
        out.push(i32_dim(n, "prefill run rows")?);
        out.push(i32_dim(m0, "prefill tile entry")?);
    }
    Ok(out)
}

/// Device addresses and geometry of one prefill attention launch (the
/// argument list of kernels/attn_prefill.cu).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillAttnArgs {
    /// bf16 queries, row r's H·D values at r·`q_stride`.
    pub q: u64,
    pub q_stride: usize,
    /// u64 [rows] tables of each row's K and V cache (bf16 [cap, Hkv, D]).
    pub kptr: u64,
    pub vptr: u64,
    /// i32 [rows]: position + 1 of each row.
    pub lens: u64,
    /// i32 [ntiles, 3] work items ([`prefill_tiles`]).
    pub tiles: u64,
    pub ntiles: usize,
    /// bf16 output, row r's H·D values at r·`out_stride`.
    pub out: u64,
    pub out_stride: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Enqueues the dense causal prefill attention kernel: every row's output
/// written directly (no partials, no combine).
///
/// Errors: [`Error::Input`] for a head dim without a kernel
/// ([`prefill_attn_function`]), H not a multiple of Hkv, an odd stride or
/// dimensions past i32; [`Error::Cuda`] on a launch failure.
pub(crate) fn launch_attn_prefill(gpu: &Gpu, a: &PrefillAttnArgs) -> Result<()> {
    const OP: &str = "attn_prefill";
    let name = prefill_attn_function(OP, a.head_dim)?;
    let Some((qs, os, h_, hk, grid_dim)) = prefill_launch_dims(OP, a)? else {
        return Ok(());
    };
    let f = gpu.function(name)?;
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (PREFILL_THREADS, 1, 1),
        shared_mem_bytes: prefill_smem_bytes(a.head_dim) as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&a.q)
        .arg(&qs)
        .arg(&a.kptr)
        .arg(&a.vptr)
        .arg(&a.lens)
        .arg(&a.tiles)
        .arg(&a.out)
        .arg(&os)
        .arg(&h_)
        .arg(&hk)
        .arg(&a.scale);
    // SAFETY: argument list matches kernels/attn_prefill.cu; the callers size the
    // tables (one entry per row), the tiles (built by prefill_tiles over those rows)
    // and q/out (rows at their strides).
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Dense causal prefill attention without bias (spec §5 "Dense", §6) on
/// the tensor cores: sequence b of `kv` contributes its last `rows[b]`
/// tokens as query rows (positions lens\[b\] − rows\[b\] … lens\[b\] − 1;
/// a chunk starting at T0 = lens\[b\] − rows\[b\] > 0 attends to the earlier
/// tokens too), the rows of all sequences back to back in sequence order.
/// Row at position t, query head g attends to keys 0 … t of KV head
/// g / G: softmax(q·k·scale)·V with bf16 operands, P rounded to bf16, f32
/// accumulation and online softmax (kernels/attn_prefill.cu); each K/V
/// tile is read once for all G query heads of the rows it serves.
///
/// - `q`: bf16, query row i's H·D values at i·`q_stride` (post-RoPE; even stride);
/// - `out`: bf16, row i's H·D outputs at i·`out_stride` (even stride);
/// - `scale`: 1/√D normally.
///
/// Errors: [`Error::Input`] when `rows` does not have one count per
/// sequence, a count is 0 or past its sequence's length, H is not a
/// multiple of Hkv, D has no prefill kernel (64, 80, 128), or q/out are too
/// short; [`Error::Cuda`] on a copy or launch failure.
#[allow(clippy::too_many_arguments)]
pub fn attention_dense_prefill<Q, O>(
    gpu: &Gpu,
    q: &Q,
    q_stride: usize,
    heads: usize,
    kv: &KvBatch<'_>,
    rows: &[usize],
    scale: f32,
    out: &mut O,
    out_stride: usize,
) -> Result<()>
where
    Q: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    const OP: &str = "attention_dense_prefill";
    let (d, hk) = (kv.head_dim, kv.kv_heads);
    prefill_attn_function(OP, d)?;
    let (per_row, kp, vp, lens) = prefill_row_tables(OP, kv, rows, heads)?;
    let nrows = per_row.len();
    prefill_io_fits(
        OP,
        (q.len(), q_stride),
        (out.len(), out_stride),
        nrows,
        heads * d,
    )?;
    let tiles = prefill_tiles(&per_row, heads / hk)?;
    let (kp, vp, lens_d, tiles_d) = (
        gpu.upload(&kp)?,
        gpu.upload(&vp)?,
        gpu.upload(&lens)?,
        gpu.upload(&tiles)?,
    );
    let args = PrefillAttnArgs {
        q: dptr(gpu, q),
        q_stride,
        kptr: dptr(gpu, &kp),
        vptr: dptr(gpu, &vp),
        lens: dptr(gpu, &lens_d),
        tiles: dptr(gpu, &tiles_d),
        ntiles: tiles.len() / 3,
        out: dptr_mut(gpu, out),
        out_stride,
        heads,
        kv_heads: hk,
        head_dim: d,
        scale,
    };
    launch_attn_prefill(gpu, &args)
}

/// Checks that `nrows` query rows of `row` = H·D values fit the query and
/// output buffers, given as (elements, row stride).
///
/// Errors: [`Error::Input`] naming `op` when a stride is below H·D or a
/// buffer is too short, with the numbers.
fn prefill_io_fits(
    op: &str,
    (q_len, q_stride): (usize, usize),
    (out_len, out_stride): (usize, usize),
    nrows: usize,
    row: usize,
) -> Result<()> {
    if q_stride < row || out_stride < row {
        return Err(Error::Input(format!(
            "{op}: q stride {q_stride} / out stride {out_stride} below H·D = {row}"
        )));
    }
    let need = |stride: usize| nrows.saturating_sub(1) * stride + row;
    let (need_q, need_o) = (need(q_stride), need(out_stride));
    if q_len < need_q || out_len < need_o {
        return Err(Error::Input(format!(
            "{op}: q has {q_len} and out {out_len} elements; {nrows} rows need {need_q} and {need_o}"
        )));
    }
    Ok(())
}

/// The per-row tables of a prefill launch over `kv` with the last
/// `rows[b]` tokens of sequence b as query rows: (sequence, position) of
/// each row, its K and V cache addresses and its length (position + 1).
///
/// Errors: [`Error::Input`] when `rows` does not have one count per
/// sequence, a count is 0 or past its sequence's length, or `heads` is not
/// a positive multiple of Hkv; i32 overflow of a position.
#[allow(clippy::type_complexity)]
fn prefill_row_tables(
    op: &str,
    kv: &KvBatch<'_>,
    rows: &[usize],
    heads: usize,
) -> Result<(Vec<(usize, usize)>, Vec<u64>, Vec<u64>, Vec<i32>)> {
    let hk = kv.kv_heads;
    if rows.len() != kv.batch() {
        return Err(Error::Input(format!(
            "{op}: {} row counts for {} sequences",
            rows.len(),
            kv.batch()
        )));
    }
    if heads == 0 || !heads.is_multiple_of(hk) {
        return Err(Error::Input(format!(
            "{op}: {heads} query heads is not a multiple of {hk} KV heads"
        )));
    }
    let mut per_row: Vec<(usize, usize)> = Vec::new();
    let (mut kp, mut vp, mut lens) = (Vec::new(), Vec::new(), Vec::new());
    for (b, (&n, &len)) in rows.iter().zip(kv.lens()).enumerate() {
        if n == 0 || n > len {
            return Err(Error::Input(format!(
                "{op}: sequence {b} has {len} tokens; its query rows must be 1 … {len}, got {n}"
            )));
        }
        for t in len - n..len {
            per_row.push((b, t));
            kp.push(kv.host_k[b]);
            vp.push(kv.host_v[b]);
            lens.push(i32_dim(t + 1, "position")?);
        }
    }
    Ok((per_row, kp, vp, lens))
}

// ---- block-sparse prefill on the tensor cores (kernels/attn_prefill.cu) ----

/// The block-sparse prefill attention kernels and the head dim each is
/// compiled for (kernels/attn_prefill.cu), the same family and head dims as
/// [`PREFILL_ATTN_FUNCTIONS`].
pub const PREFILL_SPARSE_ATTN_FUNCTIONS: [(&str, usize); 3] = [
    ("attn_prefill_sparse_d64", 64),
    ("attn_prefill_sparse_d80", 80),
    ("attn_prefill_sparse_d128", 128),
];
/// Threads per block of `prefill_sel_union` (`PF_UNION_THREADS`).
const PREFILL_UNION_THREADS: u32 = 256;
/// Most bytes the union lists of one launch may take (i32 block id and u64
/// row mask per entry, [`PREFILL_UNION_ENTRY_BYTES`]): 1 GiB. A chunk of
/// 512 rows at G = 3 selecting 64 blocks each over a 1M-token context
/// needs about 33 MiB.
pub const PREFILL_UNION_MAX_BYTES: usize = 1 << 30;
/// Device bytes per union entry: an i32 block id and a u64 row mask.
pub const PREFILL_UNION_ENTRY_BYTES: usize = 12;

/// Dynamic shared memory of the sparse prefill attention kernel at head dim
/// `d`, bytes: [`prefill_smem_bytes`] plus a stage of [`PREFILL_TILE_N`]
/// f32 bias values per K/V stage ([`prefill_sparse_smem_bytes_at`]).
pub fn prefill_sparse_smem_bytes(d: usize) -> usize {
    prefill_sparse_smem_bytes_at(d, prefill_stages())
}

/// [`prefill_sparse_smem_bytes`] at `stages` stages (70,144 at d = 128 and
/// 2 stages).
pub const fn prefill_sparse_smem_bytes_at(d: usize, stages: usize) -> usize {
    prefill_smem_bytes_at(d, stages) + stages * PREFILL_TILE_N * 4
}

/// Every prefill attention kernel (dense and sparse) with its dynamic
/// shared memory in bytes: what `Gpu::new` opts each into (a launch past
/// 48 KiB fails without `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
pub fn prefill_smem_opt_ins() -> Vec<(&'static str, usize)> {
    PREFILL_ATTN_FUNCTIONS
        .iter()
        .map(|&(n, d)| (n, prefill_smem_bytes(d)))
        .chain(
            PREFILL_SPARSE_ATTN_FUNCTIONS
                .iter()
                .map(|&(n, d)| (n, prefill_sparse_smem_bytes(d))),
        )
        .collect()
}

/// The sparse prefill attention kernel for head dim `d`.
///
/// Errors: [`Error::Input`] naming `d` and the supported head dims when
/// there is none (64, 80, 128).
pub fn prefill_sparse_attn_function(op: &str, d: usize) -> Result<&'static str> {
    PREFILL_SPARSE_ATTN_FUNCTIONS
        .iter()
        .find(|(_, dd)| *dd == d)
        .map(|(f, _)| *f)
        .ok_or_else(|| {
            Error::Input(format!(
                "{op}: head dim {d} has no tensor-core sparse prefill attention kernel (D = 64, 80 or 128); use the rowwise prefill attention"
            ))
        })
}

/// The query rows one work item of [`prefill_tiles`] covers: rows
/// `r0 + m0/G ..= r0 + (mend − 1)/G` of the call (mend = min(m0 + 64,
/// nrows·G)), at most [`PREFILL_TILE_M`] of them. Returns (first row, row
/// count).
pub fn prefill_tile_rows(tile: [i32; 3], group: usize) -> (usize, usize) {
    let (r0, n, m0) = (tile[0] as usize, tile[1] as usize, tile[2] as usize);
    let g = group.max(1);
    let mend = (m0 + PREFILL_TILE_M).min(n * g).max(m0 + 1);
    (r0 + m0 / g, (mend - 1) / g - m0 / g + 1)
}

/// Union list capacity per (tile, KV head) of the sparse prefill path
/// (`u_max` of kernels/attn_prefill.cu `prefill_sel_union`): the largest
/// over the tiles of min(blocks of the tile's last row, tile rows ·
/// `s_max`) — a tile's rows select at most `s_max` distinct blocks each,
/// all among blocks 0 … q of its last row (spec §4 and §6: current block
/// q(t) = t div block_size) — so the union can never overflow it.
/// `rows` = (sequence, position) of the call's query rows, `tiles` built
/// from them by [`prefill_tiles`] with the same `group`.
///
/// Errors: [`Error::Input`] for tiles that do not fit `rows`, block_size
/// 0 or s_max 0; [`Error::Limit`] with the numbers when the union lists of
/// the launch (tiles · `kv_heads` · capacity entries of
/// [`PREFILL_UNION_ENTRY_BYTES`]) would pass [`PREFILL_UNION_MAX_BYTES`] or
/// a count would pass i32.
pub fn prefill_union_capacity(
    rows: &[(usize, usize)],
    tiles: &[i32],
    group: usize,
    kv_heads: usize,
    s_max: usize,
    block_size: usize,
) -> Result<usize> {
    const OP: &str = "sparse prefill union";
    if block_size == 0 || s_max == 0 || group == 0 || !tiles.len().is_multiple_of(3) {
        return Err(Error::Input(format!(
            "{OP}: block size {block_size}, list width {s_max}, GQA group {group}, {} tile values (need ≥ 1 each, whole tiles)",
            tiles.len()
        )));
    }
    let mut cap = 1usize;
    for t in tiles.chunks_exact(3) {
        let (first, count) = prefill_tile_rows([t[0], t[1], t[2]], group);
        let last = rows.get(first + count - 1).ok_or_else(|| {
            Error::Input(format!(
                "{OP}: a tile covers rows {first} … {} of a call of {} rows",
                first + count - 1,
                rows.len()
            ))
        })?;
        let blocks = last.1 / block_size + 1;
        cap = cap.max(blocks.min(count.saturating_mul(s_max)));
    }
    let ntiles = tiles.len() / 3;
    let entries = ntiles.saturating_mul(kv_heads).saturating_mul(cap);
    let bytes = entries.saturating_mul(PREFILL_UNION_ENTRY_BYTES);
    if bytes > PREFILL_UNION_MAX_BYTES || cap > i32::MAX as usize || entries > i32::MAX as usize {
        return Err(Error::Limit(format!(
            "{OP}: {ntiles} tiles × {kv_heads} KV heads × {cap} union entries (min(blocks, tile rows × {s_max} selected)) need {bytes} bytes, more than the {PREFILL_UNION_MAX_BYTES}-byte limit; prefill in shorter chunks or use --prefill-attention rowwise"
        )));
    }
    Ok(cap)
}

/// Device addresses and geometry of one sparse prefill launch pair
/// (`prefill_sel_union` then `attn_prefill_sparse_d*`, kernels/attn_prefill.cu).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillSparseArgs {
    /// The dense launch's fields (q, K/V tables, lengths, tiles, output).
    pub base: PrefillAttnArgs,
    /// u64 [rows] table of each row's bias c (f32 [cap, Hkv]), 0 entries
    /// or 0 for no bias (InfLLM-V2); rows of a run share it.
    pub cptr: u64,
    /// i32 [rows, Hkv, s_max] block lists and i32 [rows, Hkv] counts.
    pub sel: u64,
    pub nsel: u64,
    pub s_max: usize,
    pub block_size: usize,
    /// Union lists: i32 block ids and u64 row masks [ntiles, Hkv, u_max],
    /// i32 counts [ntiles, Hkv] (workspace, written by the union kernel).
    pub ublk: u64,
    pub umask: u64,
    pub un: u64,
    pub u_max: usize,
}

/// What both tensor-core prefill launches check and pass: the strides and
/// head counts as i32 (q stride, out stride, H, Hkv) and the grid (tiles,
/// KV heads); `None` when there is no tile (nothing to launch).
///
/// Errors: [`Error::Input`] naming `op` when H is not a multiple of Hkv, a
/// stride is odd, or a dimension passes i32 / the grid limits.
#[allow(clippy::type_complexity)]
fn prefill_launch_dims(
    op: &str,
    a: &PrefillAttnArgs,
) -> Result<Option<(i32, i32, i32, i32, (u32, u32, u32))>> {
    if a.kv_heads == 0
        || !a.heads.is_multiple_of(a.kv_heads)
        || !a.q_stride.is_multiple_of(2)
        || !a.out_stride.is_multiple_of(2)
    {
        return Err(Error::Input(format!(
            "{op}: H {} / Hkv {} / q stride {} / out stride {} (need H a multiple of Hkv, even strides)",
            a.heads, a.kv_heads, a.q_stride, a.out_stride
        )));
    }
    if a.ntiles == 0 {
        return Ok(None);
    }
    Ok(Some((
        i32_dim(a.q_stride, "q_stride")?,
        i32_dim(a.out_stride, "out_stride")?,
        i32_dim(a.heads, "H")?,
        i32_dim(a.kv_heads, "Hkv")?,
        (
            grid(a.ntiles, "prefill tiles")?,
            grid(a.kv_heads, "KV heads")?,
            1,
        ),
    )))
}

/// Enqueues the union of the tiles' block selections and the block-sparse
/// prefill attention kernel over it: every row's output written directly
/// (no host synchronisation, no partials).
///
/// Errors: [`Error::Input`] for a head dim without a kernel, H not a
/// multiple of Hkv, odd strides, a zero block size / list width / union
/// capacity or dimensions past i32; [`Error::Cuda`] on a launch failure.
pub(crate) fn launch_attn_prefill_sparse(gpu: &Gpu, a: &PrefillSparseArgs) -> Result<()> {
    const OP: &str = "attn_prefill_sparse";
    let p = &a.base;
    let name = prefill_sparse_attn_function(OP, p.head_dim)?;
    if a.block_size == 0 || a.s_max == 0 || a.u_max == 0 {
        return Err(Error::Input(format!(
            "{OP}: block size {} / list width {} / union capacity {} (need each ≥ 1)",
            a.block_size, a.s_max, a.u_max
        )));
    }
    let Some((qs, os, h_, hk, grid_dim)) = prefill_launch_dims(OP, p)? else {
        return Ok(());
    };
    let (sm, bs, um) = (
        i32_dim(a.s_max, "s_max")?,
        i32_dim(a.block_size, "block_size")?,
        i32_dim(a.u_max, "union capacity")?,
    );
    let fu = gpu.function("prefill_sel_union")?;
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (PREFILL_UNION_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(fu);
    b.arg(&p.tiles)
        .arg(&p.lens)
        .arg(&a.sel)
        .arg(&a.nsel)
        .arg(&sm)
        .arg(&h_)
        .arg(&hk)
        .arg(&bs)
        .arg(&a.ublk)
        .arg(&a.umask)
        .arg(&a.un)
        .arg(&um);
    // SAFETY: argument list matches kernels/attn_prefill.cu prefill_sel_union; the
    // lists hold rows·Hkv·s_max entries, the union buffers ntiles·Hkv·u_max
    // (u_max from prefill_union_capacity, which bounds every tile's union).
    unsafe { b.launch(cfg) }.cuda("prefill_sel_union")?;
    let f = gpu.function(name)?;
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (PREFILL_THREADS, 1, 1),
        shared_mem_bytes: prefill_sparse_smem_bytes(p.head_dim) as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&p.q)
        .arg(&qs)
        .arg(&p.kptr)
        .arg(&p.vptr)
        .arg(&a.cptr)
        .arg(&p.lens)
        .arg(&p.tiles)
        .arg(&a.ublk)
        .arg(&a.umask)
        .arg(&a.un)
        .arg(&um)
        .arg(&bs)
        .arg(&p.out)
        .arg(&os)
        .arg(&h_)
        .arg(&hk)
        .arg(&p.scale);
    // SAFETY: argument list matches kernels/attn_prefill.cu attn_prefill_sparse_d*;
    // the tables hold one entry per row, the tiles cover those rows, the union
    // buffers were written by the launch above on the same stream.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Block-sparse prefill attention (spec §5, §6) on the tensor cores:
/// sequence b of `kv` contributes its last `rows[b]` tokens as query rows
/// (positions lens\[b\] − rows\[b\] … lens\[b\] − 1, a chunk at T0 > 0
/// included), the rows of all sequences back to back in sequence order.
/// Query row i (position t) and query head g (KV head h = g / G) attend to
/// the tokens j ≤ t of the blocks `sel` lists for (row i, h) — ascending
/// block ids, the row's own selection (spec §4) — with logit
/// q·k_j·scale + c[j, h] (the bias on the *scaled* logit) when `kv` carries
/// eviction scores (NOSA), no bias otherwise (InfLLM-V2). The tiles of
/// [`prefill_tiles`] read the union of their rows' blocks once for all
/// their rows and query heads, masking (row, block) pairs the row did not
/// select (kernels/attn_prefill.cu; the union is built on the device).
/// Arithmetic as [`attention_dense_prefill`].
///
/// - `q`: bf16, query row i's H·D values at i·`q_stride` (post-RoPE; even stride);
/// - `sel`: one list per query row (its `batch` = the total of `rows`), Hkv lists each;
/// - `out`: bf16, row i's H·D outputs at i·`out_stride` (even stride);
/// - `scale`: 1/√D normally.
///
/// Errors: [`Error::Input`] when `rows` does not have one count per
/// sequence, a count is 0 or past its sequence's length, `sel` does not
/// have one list per row and KV head, block_size is 0, H is not a multiple
/// of Hkv, D has no kernel (64, 80, 128) or q/out are too short;
/// [`Error::Limit`] when the union lists would be too large
/// ([`prefill_union_capacity`]); [`Error::Cuda`] on a copy or launch
/// failure.
#[allow(clippy::too_many_arguments)]
pub fn attention_sparse_prefill<Q, O>(
    gpu: &Gpu,
    q: &Q,
    q_stride: usize,
    heads: usize,
    kv: &KvBatch<'_>,
    rows: &[usize],
    sel: &BlockSelection,
    block_size: usize,
    scale: f32,
    out: &mut O,
    out_stride: usize,
) -> Result<()>
where
    Q: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    const OP: &str = "attention_sparse_prefill";
    let (d, hk) = (kv.head_dim, kv.kv_heads);
    prefill_sparse_attn_function(OP, d)?;
    let (per_row, kp, vp, lens) = prefill_row_tables(OP, kv, rows, heads)?;
    let nrows = per_row.len();
    if sel.batch != nrows || sel.kv_heads != hk || block_size == 0 {
        return Err(Error::Input(format!(
            "{OP}: selection for {} rows × {} KV heads, call has {nrows} × {hk} (block size {block_size})",
            sel.batch, sel.kv_heads
        )));
    }
    prefill_io_fits(
        OP,
        (q.len(), q_stride),
        (out.len(), out_stride),
        nrows,
        heads * d,
    )?;
    let group = heads / hk;
    let tiles = prefill_tiles(&per_row, group)?;
    let ntiles = tiles.len() / 3;
    let u_max = prefill_union_capacity(&per_row, &tiles, group, hk, sel.s_max, block_size)?;
    let cp: Vec<u64> = if kv.has_bias() {
        let mut v = Vec::with_capacity(nrows);
        for (b, &n) in rows.iter().enumerate() {
            v.extend(std::iter::repeat_n(kv.host_c[b], n));
        }
        v
    } else {
        Vec::new()
    };
    let (kp, vp, lens_d, tiles_d) = (
        gpu.upload(&kp)?,
        gpu.upload(&vp)?,
        gpu.upload(&lens)?,
        gpu.upload(&tiles)?,
    );
    let cp_d = if cp.is_empty() {
        None
    } else {
        Some(gpu.upload(&cp)?)
    };
    let what = format!("allocating {ntiles} × {hk} × {u_max} sparse prefill union entries");
    // SAFETY: written by prefill_sel_union (entries below each count) before the
    // attention kernel reads them; entries past a count are never read.
    let ublk = unsafe { gpu.stream().alloc::<i32>(ntiles * hk * u_max) }.cuda(&what)?;
    let umask = unsafe { gpu.stream().alloc::<u64>(ntiles * hk * u_max) }.cuda(&what)?;
    let un = unsafe { gpu.stream().alloc::<i32>(ntiles * hk) }.cuda(&what)?;
    let args = PrefillSparseArgs {
        base: PrefillAttnArgs {
            q: dptr(gpu, q),
            q_stride,
            kptr: dptr(gpu, &kp),
            vptr: dptr(gpu, &vp),
            lens: dptr(gpu, &lens_d),
            tiles: dptr(gpu, &tiles_d),
            ntiles,
            out: dptr_mut(gpu, out),
            out_stride,
            heads,
            kv_heads: hk,
            head_dim: d,
            scale,
        },
        cptr: cp_d.as_ref().map_or(0, |c| dptr(gpu, c)),
        sel: dptr(gpu, &sel.sel),
        nsel: dptr(gpu, &sel.nsel),
        s_max: sel.s_max,
        block_size,
        ublk: dptr(gpu, &ublk),
        umask: dptr(gpu, &umask),
        un: dptr(gpu, &un),
        u_max,
    };
    launch_attn_prefill_sparse(gpu, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefill_kernel_past_48_kib_gets_the_shared_memory_opt_in() {
        let opt = prefill_smem_opt_ins();
        for (n, _) in PREFILL_ATTN_FUNCTIONS
            .iter()
            .chain(&PREFILL_SPARSE_ATTN_FUNCTIONS)
        {
            assert!(opt.iter().any(|(m, _)| m == n), "{n} has no opt-in");
        }
        let get = |n: &str| opt.iter().find(|(m, _)| *m == n).map(|x| x.1);
        // the sparse kernel at D = 128 needs more than the 48 KiB default
        assert_eq!(get("attn_prefill_sparse_d128"), Some(70_144));
        assert_eq!(get("attn_prefill_d128"), Some(69_632));
        assert!(get("attn_prefill_sparse_d128").unwrap() > 48 * 1024);
    }

    /// Expands tiles into the (row, query head) entries they cover.
    fn covered(tiles: &[i32], group: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for t in tiles.chunks(3) {
            let (r0, n, m0) = (t[0] as usize, t[1] as usize, t[2] as usize);
            for m in m0..(m0 + PREFILL_TILE_M).min(n * group) {
                v.push((r0 + m / group, m % group));
            }
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn prefill_tiles_cover_every_row_and_head_once() {
        // One chunk at T0 = 100 (the engine's case) and a batch of three
        // sequences, one split in two runs by another sequence's rows.
        let chunk: Vec<(usize, usize)> = (0..37).map(|i| (0, 100 + i)).collect();
        let mut mixed: Vec<(usize, usize)> = (0..5).map(|i| (0, i)).collect();
        mixed.extend((0..70).map(|i| (1, 3000 + i)));
        mixed.extend((5..9).map(|i| (0, i)));
        mixed.push((2, 0));
        for rows in [chunk, mixed] {
            for g in [1usize, 3, 8, 16] {
                let tiles = prefill_tiles(&rows, g).unwrap();
                assert_eq!(tiles.len() % 3, 0);
                let want: Vec<(usize, usize)> = (0..rows.len())
                    .flat_map(|r| (0..g).map(move |h| (r, h)))
                    .collect();
                assert_eq!(covered(&tiles, g), want, "G {g}");
                // Every tile stays inside one run of consecutive positions.
                for t in tiles.chunks(3) {
                    let (r0, n) = (t[0] as usize, t[1] as usize);
                    for i in 1..n {
                        assert_eq!(rows[r0 + i], (rows[r0].0, rows[r0].1 + i));
                    }
                }
            }
        }
    }

    #[test]
    fn prefill_tiles_come_longest_context_first() {
        // 512 rows at T0 = 0, G = 3: 24 tiles, descending last position.
        let rows: Vec<(usize, usize)> = (0..512).map(|i| (0, i)).collect();
        let tiles = prefill_tiles(&rows, 3).unwrap();
        assert_eq!(tiles.len() / 3, (512 * 3usize).div_ceil(PREFILL_TILE_M));
        let last: Vec<usize> = tiles
            .chunks(3)
            .map(|t| {
                let end = (t[2] as usize + PREFILL_TILE_M).min(t[1] as usize * 3);
                (end - 1) / 3
            })
            .collect();
        assert_eq!(last[0], 511);
        assert!(last.windows(2).all(|w| w[0] >= w[1]), "{last:?}");
        // A single row with G = 16: one tile of 16 entries.
        assert_eq!(prefill_tiles(&[(0, 7)], 16).unwrap(), vec![0, 1, 0]);
        assert!(prefill_tiles(&[], 3).is_err());
        assert!(prefill_tiles(&[(0, 1)], 0).is_err());
    }

    #[test]
    fn prefill_kernels_cover_the_tested_head_dims() {
        for d in [64usize, 80, 128] {
            let f = prefill_attn_function("t", d).unwrap();
            assert_eq!(f, format!("attn_prefill_d{d}"));
            // two blocks per SM fit the H200's 227 KiB of shared memory, at 3 stages too
            assert!(2 * prefill_smem_bytes_at(d, 3) <= 227 * 1024);
        }
        assert_eq!(prefill_smem_bytes_at(128, 2), 69_632);
        assert_eq!(prefill_smem_bytes_at(128, 3), 104_448);
        let e = prefill_attn_function("t", 96).unwrap_err().to_string();
        assert!(e.contains("head dim 96"), "{e}");
    }
    #[test]
    fn stages_come_from_the_last_pf_stages_option_three_or_else_two() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(prefill_stages_from(&o(&[])), 2);
        assert_eq!(prefill_stages_from(&o(&["-lineinfo", "-DPF_STAGES=3"])), 3);
        assert_eq!(
            prefill_stages_from(&o(&["-DPF_STAGES=3", "-DPF_STAGES=2"])),
            2
        );
        assert_eq!(prefill_stages_from(&o(&["-DPF_STAGES=4"])), 2);
        assert_eq!(prefill_stages_from(&o(&["--define-macro=PF_STAGES=3"])), 3);
        assert_eq!(
            prefill_stages_from(&o(&["-DPF_STAGES=3", "-DPF_STAGES=0"])),
            2
        );
        assert_eq!(prefill_stages_from(&o(&["-DPF_MIN_BLOCKS=3"])), 2);
    }

    #[test]
    fn sparse_prefill_kernels_and_shared_memory() {
        for d in [64usize, 80, 128] {
            let f = prefill_sparse_attn_function("t", d).unwrap();
            assert_eq!(f, format!("attn_prefill_sparse_d{d}"));
            // two blocks per SM fit the H200's 227 KiB of shared memory, at 3 stages too
            assert!(2 * prefill_sparse_smem_bytes_at(d, 3) <= 227 * 1024);
        }
        assert_eq!(prefill_sparse_smem_bytes_at(128, 2), 70_144);
        assert_eq!(prefill_sparse_smem_bytes_at(128, 3), 105_216);
        let e = prefill_sparse_attn_function("t", 96)
            .unwrap_err()
            .to_string();
        assert!(e.contains("head dim 96") && e.contains("rowwise"), "{e}");
    }

    #[test]
    fn tile_rows_match_the_entries_a_tile_covers() {
        let rows: Vec<(usize, usize)> = (0..100).map(|i| (0, 300 + i)).collect();
        for g in [1usize, 3, 8, 16] {
            let tiles = prefill_tiles(&rows, g).unwrap();
            for t in tiles.chunks(3) {
                let (first, count) = prefill_tile_rows([t[0], t[1], t[2]], g);
                let want: std::collections::BTreeSet<usize> =
                    covered(t, g).into_iter().map(|(r, _)| r).collect();
                assert_eq!(want.len(), count, "G {g}");
                assert_eq!(*want.iter().next().unwrap(), first);
                assert!(count <= PREFILL_TILE_M);
            }
        }
        // G = 3, a tile starting mid-row: entries 63 … 126 are rows 21 … 42.
        assert_eq!(prefill_tile_rows([5, 100, 63], 3), (26, 22));
    }

    #[test]
    fn union_capacity_bounds_every_tiles_union() {
        // 512 rows from T0 = 4000 at G = 3, S = 2 lists of random distinct
        // blocks at or below each row's current block (64-token blocks).
        let (g, hk, s_max, bs) = (3usize, 2usize, 2usize, 64usize);
        let rows: Vec<(usize, usize)> = (0..512).map(|i| (0, 4000 + i)).collect();
        let tiles = prefill_tiles(&rows, g).unwrap();
        let cap = prefill_union_capacity(&rows, &tiles, g, hk, s_max, bs).unwrap();
        // 22 rows × 2 blocks < 71 blocks of the last row (position 4511) …
        assert_eq!(cap, 22 * 2);
        // … and 71 blocks < 22 rows × 6.
        assert_eq!(
            prefill_union_capacity(&rows, &tiles, g, hk, 6, bs).unwrap(),
            71
        );
        let mut x = 12_345u64;
        let mut next = |m: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as usize
        };
        let lists: Vec<Vec<usize>> = rows
            .iter()
            .map(|&(_, t)| {
                let mut l: Vec<usize> = (0..s_max).map(|_| next(t / bs + 1)).collect();
                l.sort_unstable();
                l.dedup();
                l
            })
            .collect();
        for t in tiles.chunks(3) {
            let (first, count) = prefill_tile_rows([t[0], t[1], t[2]], g);
            let union: std::collections::BTreeSet<usize> = lists[first..first + count]
                .iter()
                .flatten()
                .copied()
                .collect();
            assert!(union.len() <= cap);
        }
        // Short contexts: the blocks bound it (a 20-token prompt has one).
        let rows: Vec<(usize, usize)> = (0..20).map(|i| (0, i)).collect();
        let tiles = prefill_tiles(&rows, 16).unwrap();
        assert_eq!(
            prefill_union_capacity(&rows, &tiles, 16, hk, 64, bs).unwrap(),
            1
        );
        // Errors: bad inputs, tiles past the rows, a union past the byte limit.
        assert!(prefill_union_capacity(&rows, &tiles, 16, hk, 0, bs).is_err());
        assert!(prefill_union_capacity(&rows, &tiles, 16, hk, 64, 0).is_err());
        assert!(prefill_union_capacity(&rows[..3], &tiles, 16, hk, 64, bs).is_err());
        let far: Vec<(usize, usize)> = (0..512).map(|i| (0, (1usize << 40) + i)).collect();
        let tiles = prefill_tiles(&far, 1).unwrap();
        let e = prefill_union_capacity(&far, &tiles, 1, 64, 1 << 20, bs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("8 tiles × 64 KV heads") && e.contains("bytes"),
            "{e}"
        );
    }
}

//! The KV cache (runtime.md §1, §3, §4). Host logic in this file:
//! the host layout of the full cache, the GPU slot pool of one (sequence,
//! layer, KV head), the set difference between consecutive selections, the
//! slot assignment, the fetch tasks, the attention order and the memory
//! footprint of a request.
//!
//! Everything here is a pure function of small integer inputs, so the rules
//! that NOSI gets wrong (runtime.md §3 faults 2–4, 7) are pinned by CPU tests;
//! the GPU runs the same logic in kernels and is checked against these.

//!
//! The GPU side, each in its own file:
//! - [`resident`]: GPU-resident K/V, c, Kc, p per (sequence, layer);
//! - [`host_store`]: the pinned, device-mapped host store;
//! - [`offload`]: offloaded sequences and batches (settings, counters,
//!   moving a prefilled sequence to host memory);
//! - [`slot_pool`]: the per-layer slot pools and their set difference;
//! - [`fetch`]: the fetch engines (SM copy kernel, copy engines, or a
//!   split between them), sync or prefetched on the copy stream;
//! - [`split`]: how a split fetch divides a layer's misses;
//! - [`write_back`]: completed blocks back to host memory, and the spill
//!   of a prefill for offload.

pub mod fetch;
pub mod fetch_table;
pub mod host_store;
pub mod offload;
pub mod resident;
pub mod slot_pool;
pub mod split;
pub mod write_back;

use crate::config::ModelConfig;
use crate::{Error, Result};

/// Block-major host layout of the full KV cache (runtime.md §3 fault 7):
/// per (sequence, layer, block) one contiguous range holding, for every KV
/// head h, its K tile then its V tile, each [block_size, D] bf16. A (block,
/// head) K+V pair is one chunk of 2·tile_bytes; a whole block of all heads
/// is one chunk of `block_bytes` (64 KiB on NOSA-8B).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLayout {
    /// Sequences.
    pub batch: usize,
    /// Decoder layers offloaded.
    pub layers: usize,
    /// Blocks reserved per sequence (capacity in tokens / block_size).
    pub blocks_per_seq: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Head dim.
    pub head_dim: usize,
}

/// K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kv {
    /// Keys.
    K = 0,
    /// Values.
    V = 1,
}

impl HostLayout {
    /// Bytes of one [block_size, D] bf16 tile (16 KiB at 64 × 128).
    pub fn tile_bytes(&self) -> usize {
        self.block_size * self.head_dim * 2
    }
    /// Bytes of one (sequence, layer, block): all heads, K and V.
    pub fn block_bytes(&self) -> usize {
        self.kv_heads * 2 * self.tile_bytes()
    }
    /// Total bytes of the host store.
    pub fn total_bytes(&self) -> usize {
        self.batch * self.layers * self.blocks_per_seq * self.block_bytes()
    }
    /// Byte offset of the (seq, layer, block, head, K|V) tile.
    ///
    /// Errors: any index out of range, naming it and the limit.
    pub fn tile_offset(
        &self,
        seq: usize,
        layer: usize,
        block: usize,
        head: usize,
        kv: Kv,
    ) -> Result<usize> {
        for (what, i, n) in [
            ("sequence", seq, self.batch),
            ("layer", layer, self.layers),
            ("block", block, self.blocks_per_seq),
            ("kv head", head, self.kv_heads),
        ] {
            if i >= n {
                return Err(Error::Limit(format!(
                    "host KV layout: {what} {i} out of range (0..{n})"
                )));
            }
        }
        let blk = (seq * self.layers + layer) * self.blocks_per_seq + block;
        Ok(blk * self.block_bytes() + (head * 2 + kv as usize) * self.tile_bytes())
    }
}

/// Marks a slot that holds no block.
pub const EMPTY: u32 = u32::MAX;

/// Blocks the GPU keeps in each (sequence, layer)'s tail ring instead of the
/// slot pool: the current block and the one before it. The ring holds the
/// last `RING_BLOCKS · block_size` tokens in the resident token-major layout,
/// so the append, the compression of a window that straddles a block
/// boundary (kernel_size = 2 · stride) and the write-back of a block that
/// just completed all read it without a slot lookup.
pub const RING_BLOCKS: usize = 2;

/// First block id that lives in the ring for a row attending to `len`
/// tokens (its own token included): max(cur − 1, 0) with cur = (len − 1) /
/// block_size the current block. Blocks ≥ this are never fetched and take
/// no slot.
pub fn ring_first(len: usize, block_size: usize) -> u32 {
    (len.saturating_sub(1) / block_size).saturating_sub(RING_BLOCKS - 1) as u32
}

/// What one step's set difference decided for one (sequence, layer, KV head).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotPlan {
    /// Slot map after the step: slot → block id or [`EMPTY`]. Length = pool size.
    pub slots: Vec<u32>,
    /// Selected blocks already resident in a slot: (slot, block), ascending block.
    pub hits: Vec<(u32, u32)>,
    /// Selected blocks to fetch from host memory into (slot, block),
    /// ascending block. Never a ring block.
    pub fetches: Vec<(u32, u32)>,
    /// Selected blocks read from the tail ring (≥ `ring_first`), ascending.
    pub ring: Vec<u32>,
    /// Per selected block, in selection order: its slot, or −1 for a ring
    /// block. This is the list the GPU attention kernel reads beside the
    /// block list (`slot_diff` in kernels/kv_offload.cu writes the same).
    pub slot_list: Vec<i32>,
    /// [`plan_slots_lru`] only (else empty): per slot, steps since its block
    /// was last selected, after this step.
    pub ages: Vec<u32>,
}

impl SlotPlan {
    /// Locality γ of this step: selected blocks already on the GPU (slot
    /// hits and ring blocks) / selected blocks (1 when nothing is selected).
    pub fn locality(&self) -> f64 {
        let sel = self.slot_list.len();
        if sel == 0 {
            1.0
        } else {
            (sel - self.fetches.len()) as f64 / sel as f64
        }
    }
}

/// Set difference and slot assignment of one (sequence, layer, KV head)
/// (runtime.md §1 step 4):
/// - blocks ≥ `ring_first` ([`ring_first`]) are read from the tail ring:
///   never fetched, no slot (the current block is attended on every step,
///   runtime.md §3 fault 2, and never overwrites a pool slot, fault 3);
/// - a selected block already in a slot is a hit and keeps its slot;
/// - every other selected block gets a slot that is empty or whose block
///   left the selection (lowest such slot first, blocks in ascending order);
/// - a slot whose block is still selected is never overwritten, and empty
///   slots are never counted as hits (fault 4).
///
/// `slots`: the slot map before the step (slot → block or [`EMPTY`]);
/// `selected`: strictly ascending block ids. Work is O(pool + selected)
/// with a bitmap over block ids. The GPU's `slot_diff` kernel computes the
/// same plan and is checked against this function.
///
/// Errors: more non-ring selected blocks than slots, a selection that is
/// not strictly ascending, or a block held by two slots.
pub fn plan_slots(slots: &[u32], selected: &[u32], ring_first: u32) -> Result<SlotPlan> {
    plan(slots, None, selected, ring_first)
}

/// Largest slot age [`plan_slots_lru`] (and `slot_diff`) count to: 2^30 steps.
pub const MAX_AGE: u32 = 1 << 30;

/// [`plan_slots`] for a pool with cache slots beyond the attended budget
/// (`OffloadOptions::cache_slots`): the same hits, ring blocks and
/// ascending-block assignment of misses, but misses take empty slots first
/// (ascending), then the slots whose blocks were selected least recently
/// (largest age; ties: lower slot), so a block that leaves the selection
/// stays on the GPU as long as the cache allows and a return to it is a hit.
///
/// `ages`: per slot, steps since its block was last selected (same length
/// as `slots`). The returned plan's `ages` are those after the step: 0 for
/// a slot whose block is selected (hit or fetched) and for an empty slot,
/// else age + 1, at most [`MAX_AGE`]. `slot_diff` with `aged` computes the
/// same. Errors: those of [`plan_slots`], and `ages` of another length.
pub fn plan_slots_lru(
    slots: &[u32],
    ages: &[u32],
    selected: &[u32],
    ring_first: u32,
) -> Result<SlotPlan> {
    if ages.len() != slots.len() {
        return Err(Error::Input(format!(
            "slot pool: {} ages for {} slots",
            ages.len(),
            slots.len()
        )));
    }
    plan(slots, Some(ages), selected, ring_first)
}

fn plan(
    slots: &[u32],
    ages: Option<&[u32]>,
    selected: &[u32],
    ring_first: u32,
) -> Result<SlotPlan> {
    if selected.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Input(
            "slot pool: selection must be strictly ascending block ids".into(),
        ));
    }
    let pooled = selected.iter().filter(|&&b| b < ring_first).count();
    if pooled > slots.len() {
        return Err(Error::Limit(format!(
            "slot pool: {pooled} selected blocks outside the ring do not fit {} slots",
            slots.len()
        )));
    }
    let max_block = selected
        .iter()
        .chain(slots.iter().filter(|&&b| b != EMPTY))
        .copied()
        .max()
        .unwrap_or(0) as usize;
    let mut is_selected = vec![false; max_block + 1];
    for &b in selected {
        is_selected[b as usize] = true;
    }
    let mut slot_of = vec![EMPTY; max_block + 1];
    for (s, &b) in slots.iter().enumerate() {
        if b != EMPTY {
            if slot_of[b as usize] != EMPTY {
                return Err(Error::Input(format!(
                    "slot pool: block {b} held by two slots"
                )));
            }
            slot_of[b as usize] = s as u32;
        }
    }
    let mut out = SlotPlan {
        slots: slots.to_vec(),
        ..Default::default()
    };
    // slots free for reuse: empty, or holding a block that left the selection;
    // with ages, empty ones first, then the least recently selected
    let mut free: Vec<u32> = slots
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == EMPTY || !is_selected[b as usize])
        .map(|(s, _)| s as u32)
        .collect();
    if let Some(a) = ages {
        // an empty slot's age plays no part: empty slots go in slot order
        free.sort_by_key(|&s| {
            let held = slots[s as usize] != EMPTY;
            (
                held,
                std::cmp::Reverse(if held { a[s as usize] } else { 0 }),
                s,
            )
        });
    }
    let mut free = free.into_iter();
    for &b in selected {
        if b >= ring_first {
            out.ring.push(b);
            out.slot_list.push(-1);
            continue;
        }
        let s = slot_of[b as usize];
        if s != EMPTY {
            out.hits.push((s, b));
            out.slot_list.push(s as i32);
            continue;
        }
        // Free slots run short only when a slot holds a ring block that is
        // still selected (never the case in the engine, where ring blocks
        // never enter a slot).
        let Some(s) = free.next() else {
            return Err(Error::Input(format!(
                "slot pool: no free slot for block {b}: a slot holds a ring block (≥ {ring_first})"
            )));
        };
        out.slots[s as usize] = b;
        out.fetches.push((s, b));
        out.slot_list.push(s as i32);
    }
    if let Some(a) = ages {
        out.ages = out
            .slots
            .iter()
            .zip(a)
            .map(|(&b, &age)| {
                // is_selected covers every block a slot holds
                if b == EMPTY || is_selected[b as usize] {
                    0
                } else {
                    age.saturating_add(1).min(MAX_AGE)
                }
            })
            .collect();
    }
    Ok(out)
}

/// Host and GPU bytes that an offloaded request needs (runtime.md §4;
/// [`crate::memory::estimate`] adds the rest and decides whether it fits):
/// the full K/V of every offloaded layer in pinned host memory; on the GPU,
/// per offloaded layer, S slots per (sequence, KV head) plus the
/// [`RING_BLOCKS`] tail ring, plus the resident layers' full cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Pinned host bytes (block-major store).
    pub host_pinned_bytes: usize,
    /// GPU bytes for KV (slot pools + resident layers), excluding weights
    /// and the small compressed state.
    pub gpu_kv_bytes: usize,
}

impl Footprint {
    /// Footprint of `batch` sequences of up to `capacity_tokens` each on the
    /// model `cfg` with `slots` slots per (sequence, layer, KV head) (the
    /// attended budget S), keeping `resident_layers` layers (layer 0 by
    /// default, runtime.md §2) entirely on the GPU.
    pub fn new(
        cfg: &ModelConfig,
        slots: usize,
        resident_layers: usize,
        batch: usize,
        capacity_tokens: usize,
    ) -> Footprint {
        let block_size = cfg.sparse.map_or(64, |s| s.block_size);
        let blocks = capacity_tokens.div_ceil(block_size);
        let per_block = cfg.num_key_value_heads * 2 * block_size * cfg.head_dim * 2;
        let resident = resident_layers.min(cfg.num_hidden_layers);
        let offloaded = cfg.num_hidden_layers - resident;
        Footprint {
            host_pinned_bytes: batch * offloaded * blocks * per_block,
            gpu_kv_bytes: batch
                * (offloaded * (slots + RING_BLOCKS) + resident * blocks)
                * per_block,
        }
    }
}

//! `SPARDA_PREFILL_UNION_STATS=1`: how much of the sparse tensor-core
//! prefill attention's work is union overhead (kernels/attn_prefill.cu,
//! spec/runtime.md's prefill).
//!
//! A thread block of the sparse kernel holds a tile of 64 M-rows (query
//! row, query head) of one KV head: 64 / G query rows at GQA group G (4 at
//! NOSA-8B's G = 16). It walks the union of those rows' block selections,
//! loading every union block's K/V and passing one or two block barriers per
//! key tile; a warp (16 M-rows) computes only the blocks one of its own rows
//! selected. So the block's loads and barriers scale with the tile union,
//! a warp's arithmetic with its warp union, and the useful work with each
//! row's own selection. With the variable set, every eighth layer of a
//! sparse tensor-core prefill downloads the (tile, KV head) unions (a
//! synchronisation each: a diagnostic, not for timing) and the prefill ends
//! with one line on stderr giving the three means ([`UnionStats::line`]).

use std::sync::Mutex;

/// Layers between two sampled layers (layer 0, 8, 16, …).
pub(crate) const SAMPLE_EVERY: usize = 8;

/// Whether `$SPARDA_PREFILL_UNION_STATS` is `1`. Read once.
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPARDA_PREFILL_UNION_STATS").is_ok_and(|v| v.trim() == "1"))
}

/// Sums of the union counts over the sampled (tile, KV head) pairs.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct UnionStats {
    /// Σ over (tile, head, tile row) of the blocks that row selected.
    row_blocks: u64,
    /// (tile, head, tile row) triples counted.
    rows: u64,
    /// Σ over (tile, head, warp) of the union blocks some row of the warp
    /// selected.
    warp_blocks: u64,
    /// (tile, head, warp) triples with at least one row.
    warps: u64,
    /// Σ over (tile, head) of the union's blocks.
    tile_blocks: u64,
    /// (tile, head) pairs counted.
    tiles: u64,
    /// Layer calls sampled: sampled layers × forward calls (chunks).
    layers: u64,
}

impl UnionStats {
    /// Adds one layer's unions. `tiles`: the call's work items, three i32
    /// per tile (first row, rows, first M-row; `ops::prefill_tiles`);
    /// `un` [tiles · hkv] union lengths; `umask` [tiles · hkv · u_max] row
    /// masks (bit i: tile row i selected the entry's block); `g` the GQA
    /// group. `spb` key tiles per block are not counted: blocks, not key
    /// tiles.
    pub(crate) fn add(
        &mut self,
        tiles: &[i32],
        un: &[i32],
        umask: &[u64],
        hkv: usize,
        u_max: usize,
        g: usize,
    ) {
        const TILE_M: usize = 64;
        const WARP_M: usize = 16;
        self.layers += 1;
        for (t, w) in tiles.chunks_exact(3).enumerate() {
            let (nrows, m0) = (w[1].max(0) as usize, w[2].max(0) as usize);
            let mend = (m0 + TILE_M).min(nrows * g);
            if mend <= m0 || g == 0 {
                continue;
            }
            let ilo = m0 / g;
            let tile_rows = (mend - 1) / g - ilo + 1;
            // the rows each warp holds, as a mask of tile rows
            let warp_masks: Vec<u64> = (m0..mend)
                .step_by(WARP_M)
                .map(|ws| {
                    let we = (ws + WARP_M).min(mend);
                    (ws / g - ilo..=(we - 1) / g - ilo).fold(0u64, |m, r| m | 1u64 << r)
                })
                .collect();
            for h in 0..hkv {
                let pair = t * hkv + h;
                let Some(&n) = un.get(pair) else { continue };
                let n = (n.max(0) as usize).min(u_max);
                let Some(masks) = umask.get(pair * u_max..pair * u_max + n) else {
                    continue;
                };
                self.tiles += 1;
                self.tile_blocks += n as u64;
                self.rows += tile_rows as u64;
                self.row_blocks += masks.iter().map(|m| m.count_ones() as u64).sum::<u64>();
                for &wm in &warp_masks {
                    self.warps += 1;
                    self.warp_blocks += masks.iter().filter(|&&m| m & wm != 0).count() as u64;
                }
            }
        }
    }

    /// Mean blocks per row selection, per warp union and per tile union,
    /// and the layer calls (sampled layers × chunks) and (tile, head) pairs
    /// they came from, e.g. (synthetic NOSA-8B, a 130,048-token prompt on an
    /// H100) `union stats: 508 layer calls, 260096 (tile, head) pairs: blocks
    /// per row selection 63.0, per warp union 63.0, per tile union 100.2
    /// (1.59× the row's)`.
    pub(crate) fn line(&self) -> String {
        let mean = |s: u64, n: u64| if n == 0 { 0.0 } else { s as f64 / n as f64 };
        let (r, w, t) = (
            mean(self.row_blocks, self.rows),
            mean(self.warp_blocks, self.warps),
            mean(self.tile_blocks, self.tiles),
        );
        format!(
            "union stats: {} layer calls, {} (tile, head) pairs: blocks per row selection {r:.1}, per warp union {w:.1}, per tile union {t:.1} ({:.2}× the row's)",
            self.layers,
            self.tiles,
            if r > 0.0 { t / r } else { 0.0 }
        )
    }
}

/// The prefill's running sums and the current call's host tiles.
static STATE: Mutex<Option<(UnionStats, Vec<i32>)>> = Mutex::new(None);

/// Records the tiles of the forward call about to run (its layers' unions
/// refer to them).
pub(crate) fn set_tiles(tiles: &[i32]) {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let st = s.get_or_insert_with(Default::default);
    st.1 = tiles.to_vec();
}

/// Adds a layer's unions against the tiles of [`set_tiles`].
pub(crate) fn add_layer(un: &[i32], umask: &[u64], hkv: usize, u_max: usize, g: usize) {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let st = s.get_or_insert_with(Default::default);
    let tiles = std::mem::take(&mut st.1);
    st.0.add(&tiles, un, umask, hkv, u_max, g);
    st.1 = tiles;
}

/// The prefill's line ([`UnionStats::line`]), clearing the sums (also what a
/// prefill calls first, so a failed prefill's or a bare forward call's counts
/// never reach the next line); `None` when no layer was sampled.
pub(crate) fn finish() -> Option<String> {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    s.take().filter(|st| st.0.layers > 0).map(|st| st.0.line())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn g16_tiles_hold_four_rows_one_per_warp() {
        // one tile of 4 rows at G = 16, one KV head, u_max 4: rows 0 and 1 select
        // block A, row 2 block B, row 3 blocks B and C
        let tiles = [0, 4, 0];
        let masks = [0b0011u64, 0b1100, 0b1000, 0];
        let mut s = UnionStats::default();
        s.add(&tiles, &[3], &masks, 1, 4, 16);
        // 5 row selections over 4 rows; warps hold one row each; the tile union is 3
        assert_eq!((s.row_blocks, s.rows), (5, 4));
        assert_eq!((s.warp_blocks, s.warps), (5, 4));
        assert_eq!((s.tile_blocks, s.tiles), (3, 1));
        let l = s.line();
        assert!(
            l.contains("row selection 1.2") && l.contains("per tile union 3.0"),
            "{l}"
        );
        assert!(l.contains("(2.40× the row's)"), "{l}");
    }

    #[test]
    fn g3_warps_hold_several_rows_and_a_partial_tile_counts_its_rows() {
        // G = 3, 7 rows = 21 M-rows in one tile: warp 0 holds M-rows 0..15 = rows 0..5,
        // warp 1 M-rows 16..20 = rows 5..6
        let tiles = [0, 7, 0];
        let masks = [0b000_0001u64, 0b100_0000, 0b010_0000];
        let mut s = UnionStats::default();
        s.add(
            &tiles,
            &[3, 0],
            &[masks.as_slice(), &[0; 3]].concat(),
            2,
            3,
            3,
        );
        assert_eq!((s.rows, s.row_blocks), (14, 3));
        // head 0: warp 0 sees blocks 0 and 2 (rows 0, 5), warp 1 blocks 1 and 2 (rows 6, 5);
        // head 1: an empty union
        assert_eq!((s.warps, s.warp_blocks), (4, 4));
        assert_eq!((s.tiles, s.tile_blocks), (2, 3));
    }
}

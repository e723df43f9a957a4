// Offloaded KV cache (runtime.md §1 steps 4-5, §2, §4): the slot diff, the SM
// fetch from pinned host memory through UVA, and the write of completed blocks
// back to host memory. Host-side oracles: src/kv/mod.rs (plan_slots, ring_first,
// HostLayout); wrappers: src/cuda/ops/offload.rs; checks: src/checks/offload.rs.
//
// Layouts (B = block_size tokens, D = head_dim, hkv = KV heads, S = pool slots):
// - host store, per (sequence, layer): block-major; block b of head h is
//   K tile then V tile, each [B, D] bf16, at byte
//   b * block_bytes + (h * 2 + kv) * tile_bytes, tile_bytes = B * D * 2,
//   block_bytes = hkv * 2 * tile_bytes. A kernel gets, per row, a
//   device-visible pointer to block 0 of that row's (sequence, layer).
// - GPU slot pool, per (sequence, layer): bf16 [hkv][S][2][B][D]; the K tile of
//   slot s of head h at element ((h * S + s) * 2 + 0) * B * D, its V tile right
//   after. One (block, head) K+V pair is one contiguous 2 * tile_bytes chunk on
//   both sides.
// - slot map, per (sequence, layer): i32 [hkv][S], block id or -1 (empty).
// - tail ring / resident cache: K and V separately, bf16 [R][hkv][D]
//   token-major, token t at row t % R (R = ring > 0) or row t (ring = 0).

// ---------------------------------------------------------------------------
// slot_diff
// ---------------------------------------------------------------------------

// Capacity of the per-(row, head) shared arrays (the wrapper checks S and s_max).
#define SD_MAX_SLOTS 1024
#define SD_MAX_SEL 1024
#define SD_THREADS 128
// aged reuse keys: a slot that is not free, and an empty slot (before every age key -age)
#define SD_NOT_FREE 0x7fffffff
#define SD_EMPTY_KEY (-0x7fffffff - 1)

// Exclusive prefix sum of v over the thread block (blockDim.x a multiple of 32,
// at most 1024); *total gets the sum. shm holds at least 32 ints. Every thread
// must call it (it synchronises).
__device__ __forceinline__ int block_excl_scan(int v, int* shm, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // shm may still be read by a previous call
    if (lane == 31) shm[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nw ? shm[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        shm[lane] = w;
    }
    __syncthreads();
    *total = shm[nw - 1];
    return (warp > 0 ? shm[warp - 1] : 0) + x - v;
}

// Set difference and slot assignment of one (row, KV head): exactly what
// kv::plan_slots(slots, selected, ring_first(len)) computes.
//
// sel: i32 [rows][hkv][s_max] block ids, strictly ascending among the first
//   nsel entries that are >= 0 (entries < 0 inside nsel are absent: slot -1,
//   no fetch; entries >= nsel are ignored).
// nsel: i32 [rows][hkv] (clamped to [0, s_max]).
// lens: i32 [rows] tokens the row attends to, its new token included;
//   ring_first = max((len - 1) / B - 1, 0): blocks >= it live in the tail ring
//   (slot -1, never fetched, no slot).
// slot_tab: u64 [rows] -> that row's slot map i32 [hkv][S], updated in place.
// Out slot_list: i32 [rows][hkv][s_max], parallel to sel: the block's slot,
//   -1 for ring blocks, absent entries and entries >= nsel.
// Out fetch: i32 [rows][hkv][S][2] (slot, block) pairs in ascending block order;
//   nfetch: i32 [rows][hkv] valid pairs.
// stats: u64 [2] or null: stats[0] += selected blocks (valid entries, ring
//   included), stats[1] += fetched blocks (locality = 1 - stats[1] / stats[0]).
// Rule: hits keep their slot; misses (blocks < ring_first with no slot), in
//   ascending block order, take the free slots (empty, or holding a block not in
//   the selection) in ascending slot order, or, with aged != 0 (a pool with cache
//   slots beyond the budget, kv::plan_slots_lru), empty slots first (ascending),
//   then the least recently selected (largest age; ties: lower slot). The ages,
//   i32 [hkv][S] steps since each slot's block was last selected, follow the slot
//   map in the same buffer (slot_tab[r] + hkv * S ints) and are updated in place:
//   0 for a slot whose block is selected after the step (hit or fetched) and for
//   an empty slot, else age + 1 (at most 2^30). More misses than free slots (the
//   caller sized S too small; plan_slots errors) leaves the excess at slot -1,
//   unfetched, and is reported to the device error record err (nullable;
//   common.cuh): DEVERR_SLOT_DIFF, row r, `layer`, KV head h, value misses,
//   limit free slots. A block held by two slots (plan_slots errors) is undefined.
// Grid (rows, hkv), SD_THREADS threads. S <= SD_MAX_SLOTS, s_max <= SD_MAX_SEL.
extern "C" __global__ __launch_bounds__(SD_THREADS) void slot_diff(
    const int* __restrict__ sel, const int* __restrict__ nsel, int s_max, const int* __restrict__ lens,
    const u64* __restrict__ slot_tab, int S, int block_size, int hkv, int* __restrict__ slot_list,
    int* __restrict__ fetch, int* __restrict__ nfetch, unsigned long long* __restrict__ stats,
    int* __restrict__ err, int layer, int aged) {
    __shared__ int smap[SD_MAX_SLOTS];      // slot map before the step
    __shared__ int sage[SD_MAX_SLOTS];      // aged: slot ages before the step
    __shared__ int fkey[SD_MAX_SLOTS];      // aged: reuse key of a free slot, SD_NOT_FREE if not free
    __shared__ unsigned long long sorder[SD_MAX_SLOTS];  // aged: (key, slot) pairs, sorted in place
    __shared__ int free_list[SD_MAX_SLOTS]; // free slots, ascending
    __shared__ int cb[SD_MAX_SEL];          // valid selected blocks, ascending
    __shared__ int ci[SD_MAX_SEL];          // their index in sel
    __shared__ int hit[SD_MAX_SEL];         // slot holding cb[p], or -1
    __shared__ int scan_shm[32];

    const int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const u64 rh = (u64)r * hkv + h;
    const int n = min(max(nsel[rh], 0), s_max);
    const int len = lens[r];
    const int cur = len > 0 ? (len - 1) / block_size : 0;
    const int rf = max(cur - 1, 0);
    int* map = (int*)slot_tab[r] + (u64)h * S;
    const int* srow = sel + rh * s_max;
    int* lrow = slot_list + rh * s_max;
    int* frow = fetch + rh * S * 2;

    int* ages = aged ? (int*)slot_tab[r] + (u64)hkv * S + (u64)h * S : nullptr;
    for (int s = tid; s < S; s += nt) {
        smap[s] = map[s];
        if (aged) sage[s] = ages[s];
    }
    // Compact the valid entries (>= 0) of sel, keeping their order.
    const int cs = (n + nt - 1) / nt;
    const int c0 = min(tid * cs, n), c1 = min(c0 + cs, n);
    int cnt = 0;
    for (int i = c0; i < c1; i++) cnt += srow[i] >= 0;
    int nv;
    int off = block_excl_scan(cnt, scan_shm, &nv);
    for (int i = c0; i < c1; i++) {
        const int b = srow[i];
        if (b >= 0) {
            cb[off] = b;
            ci[off] = i;
            hit[off] = -1;
            off++;
        }
    }
    for (int i = n + tid; i < s_max; i += nt) lrow[i] = -1;
    __syncthreads();

    // Per slot: is its block selected? A hit (block < ring_first) records the slot.
    const int ss = (S + nt - 1) / nt;
    const int s0 = min(tid * ss, S), s1 = min(s0 + ss, S);
    int nfree_mine = 0;
    for (int s = s0; s < s1; s++) {
        const int b = smap[s];
        bool found = false;
        if (b >= 0) {
            int lo = 0, hi = nv;  // first p with cb[p] >= b
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (cb[mid] < b) lo = mid + 1; else hi = mid;
            }
            if (lo < nv && cb[lo] == b) {
                found = true;
                if (b < rf) hit[lo] = s;
            }
        }
        nfree_mine += !found;
        // reuse order key: empty slots first, then the largest age
        if (aged) fkey[s] = found ? SD_NOT_FREE : (b < 0 ? SD_EMPTY_KEY : -sage[s]);
    }
    int nfree;
    int foff = block_excl_scan(nfree_mine, scan_shm, &nfree);  // syncs: fkey complete
    if (aged) {
        // The reuse order: a bitonic sort of the (key, slot) pairs over the pool rounded up to a
        // power of two, O(S log^2 S) compare-exchanges spread over the threads. The key's sign
        // bit is flipped so that the unsigned order of the pair is the order of (key, slot);
        // slots that are not free (SD_NOT_FREE) and the padding sort after every free slot.
        int np = 1;
        while (np < S) np <<= 1;
        for (int i = tid; i < np; i += nt)
            sorder[i] = i < S ? ((unsigned long long)((unsigned)fkey[i] ^ 0x80000000u) << 32) | (unsigned)i
                              : ~0ull;
        __syncthreads();
        for (int k = 2; k <= np; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = tid; i < (np >> 1); i += nt) {
                    const int lo = 2 * j * (i / j) + (i % j), hi = lo + j;
                    const unsigned long long a = sorder[lo], b = sorder[hi];
                    if (((lo & k) == 0) == (a > b)) {
                        sorder[lo] = b;
                        sorder[hi] = a;
                    }
                }
                __syncthreads();
            }
        }
        for (int i = tid; i < nfree; i += nt) free_list[i] = (int)(unsigned)(sorder[i] & 0xffffffffull);
    } else {
        for (int s = s0; s < s1; s++) {
            const int b = smap[s];
            bool found = false;
            if (b >= 0) {
                int lo = 0, hi = nv;
                while (lo < hi) {
                    const int mid = (lo + hi) >> 1;
                    if (cb[mid] < b) lo = mid + 1; else hi = mid;
                }
                found = lo < nv && cb[lo] == b;
            }
            if (!found) free_list[foff++] = s;
        }
    }
    __syncthreads();  // hit[] and free_list[] complete

    // Misses in ascending block order take the free slots in ascending order.
    const int ps = (nv + nt - 1) / nt;
    const int p0 = min(tid * ps, nv), p1 = min(p0 + ps, nv);
    int nmiss_mine = 0;
    for (int p = p0; p < p1; p++) nmiss_mine += cb[p] < rf && hit[p] < 0;
    int nmiss;
    int m = block_excl_scan(nmiss_mine, scan_shm, &nmiss);
    for (int p = p0; p < p1; p++) {
        const int b = cb[p];
        int slot;
        if (b >= rf) {
            slot = -1;
        } else if (hit[p] >= 0) {
            slot = hit[p];
        } else {
            slot = m < nfree ? free_list[m] : -1;
            if (slot >= 0) {
                map[slot] = b;
                frow[2 * m] = slot;
                frow[2 * m + 1] = b;
            }
            m++;
        }
        lrow[ci[p]] = slot;
    }
    // Entries < 0 inside nsel: absent.
    for (int i = c0; i < c1; i++)
        if (srow[i] < 0) lrow[i] = -1;
    if (aged) {
        // Selected and empty slots get age 0, other held slots age + 1; then the first
        // min(nmiss, nfree) free slots of the reuse order, filled this step, get 0.
        for (int s = s0; s < s1; s++)
            sage[s] = fkey[s] != SD_NOT_FREE && smap[s] >= 0 ? min(sage[s] + 1, 1 << 30) : 0;
        __syncthreads();
        const int filled = min(nmiss, nfree);
        for (int i = tid; i < filled; i += nt) sage[free_list[i]] = 0;
        __syncthreads();
        for (int s = s0; s < s1; s++) ages[s] = sage[s];
    }
    if (tid == 0) {
        const int nf = min(nmiss, nfree);
        nfetch[rh] = nf;
        if (nmiss > nfree) raise_device_error(err, DEVERR_SLOT_DIFF, r, layer, h, nmiss, nfree);
        if (stats != nullptr) {
            atomicAdd(stats, (unsigned long long)nv);
            atomicAdd(stats + 1, (unsigned long long)nf);
        }
    }
}

// ---------------------------------------------------------------------------
// kv_fetch_sm
// ---------------------------------------------------------------------------

#define FETCH_THREADS 256
#define FETCH_UNROLL 8
#define FETCH_SCAN 512  // (row, head) pairs per scan chunk: 2 per thread of the first 256
// Dynamic shared memory kv_fetch_sm needs, ints: the chunk's prefix (FETCH_SCAN + 1) and the
// block scan's 32 warp sums (src/cuda/ops/offload.rs FETCH_SMEM_BYTES = this * 4).
#define FETCH_SMEM_INTS (FETCH_SCAN + 1 + 32)

// The persistent UVA fetch (runtime.md §2, §4): a small fixed grid of CTAs
// striding over the (row, head, i < nfetch) copy tasks. A CTA is
// blockDim.x / FETCH_THREADS task groups of FETCH_THREADS threads (1 to 4:
// more groups keep more bytes in flight on one SM), one task at a time per
// group; task k of the concatenation of every (row, head)'s nfetch tasks goes
// to task stream s = k % (gridDim.x * groups), stream s being group s % groups
// of CTA s / groups. Each task copies one (block, head)
// K+V chunk (2 * B * D * 2 bytes) from host_tab[r] + block * block_bytes +
// h * 2 * tile_bytes to pool_tab[r] + ((h * S + slot) * 2) * tile_bytes, with
// 16-byte loads, FETCH_UNROLL loads in flight per thread before the stores.
// The (row, head) pairs are taken FETCH_SCAN at a time: the CTA's threads load
// the chunk's nfetch together and scan them into a prefix in shared memory,
// and each task finds its pair by binary search there. (A serial walk over the
// pairs, one dependent load each, cost ~0.3 us per pair: ~60 us per layer at
// 192 pairs with nothing to fetch.)
// fetch: i32 [rows][hkv][S][2] (slot, block); nfetch: i32 [rows][hkv];
// host_tab, pool_tab: u64 [rows] (device-visible addresses, 16-byte aligned).
// cta_log: null, or u64 [gridDim.x][3] per-CTA timeline (common.cuh cta_log_start).
// Requires D * 2 * B a multiple of 16 (D a multiple of 8).
// Grid (N CTAs), FETCH_THREADS * groups threads (groups 1 to 4), at least
// FETCH_SMEM_INTS * 4 bytes of dynamic shared memory (no static shared memory: with whole
// SMs the launch asks for all of it).
extern "C" __global__ __launch_bounds__(FETCH_THREADS * 4) void kv_fetch_sm(
    const int* __restrict__ fetch, const int* __restrict__ nfetch, int S, int rows, int hkv,
    const u64* __restrict__ host_tab, const u64* __restrict__ pool_tab, int B, int D,
    u64* __restrict__ cta_log) {
    extern __shared__ int fetch_shm[];
    int* pre = fetch_shm;                     // [FETCH_SCAN + 1] exclusive prefix of the chunk
    int* scan_shm = fetch_shm + FETCH_SCAN + 1;  // [32]
    cta_log_start(cta_log);
    const u64 tile_bytes = (u64)B * D * 2;
    const u64 block_bytes = (u64)hkv * 2 * tile_bytes;
    const int n16 = (int)(2 * tile_bytes / 16);  // uint4 per chunk
    // task streams: G = CTAs x groups; this thread's group is stream `me`, its lane in it `tid`
    const int groups = blockDim.x / FETCH_THREADS;
    const int G = gridDim.x * groups, me = blockIdx.x * groups + threadIdx.x / FETCH_THREADS;
    const int tid = threadIdx.x % FETCH_THREADS;
    long long base = 0;  // tasks of the (row, head) pairs before this chunk
    const int nrh = rows * hkv;
    for (int c0 = 0; c0 < nrh; c0 += FETCH_SCAN) {
        const int cnt = min(FETCH_SCAN, nrh - c0);
        const int j0 = 2 * (int)threadIdx.x, j1 = j0 + 1;
        const int v0 = j0 < cnt ? min(max(nfetch[c0 + j0], 0), S) : 0;
        const int v1 = j1 < cnt ? min(max(nfetch[c0 + j1], 0), S) : 0;
        int total;
        const int ex = block_excl_scan(v0 + v1, scan_shm, &total);  // syncs before and after
        if (j0 < cnt) pre[j0] = ex;
        if (j1 < cnt) pre[j1] = ex + v0;
        __syncthreads();
        // first k with (base + k) % G == me
        for (int k = (int)(((long long)me - base % G + G) % G); k < total; k += G) {
            // the pair holding task k: the last j with pre[j] <= k (its count is > k - pre[j])
            int lo = 0, hi = cnt - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (pre[mid] <= k) lo = mid; else hi = mid - 1;
            }
            const int rh = c0 + lo, i = k - pre[lo];
            const int r = rh / hkv, h = rh - r * hkv;
            const int* f = fetch + (u64)rh * S * 2;
            const int slot = f[2 * i], block = f[2 * i + 1];
            if (slot < 0 || slot >= S || block < 0) continue;
            const uint4* src =
                (const uint4*)(host_tab[r] + (u64)block * block_bytes + (u64)h * 2 * tile_bytes);
            uint4* dst = (uint4*)(pool_tab[r] + ((u64)h * S + slot) * 2 * tile_bytes);
            for (int q0 = 0; q0 < n16; q0 += FETCH_THREADS * FETCH_UNROLL) {
                uint4 v[FETCH_UNROLL];
#pragma unroll
                for (int u = 0; u < FETCH_UNROLL; u++) {
                    const int j = q0 + u * FETCH_THREADS + tid;
                    if (j < n16) v[u] = __ldcs(src + j);
                }
#pragma unroll
                for (int u = 0; u < FETCH_UNROLL; u++) {
                    const int j = q0 + u * FETCH_THREADS + tid;
                    if (j < n16) dst[j] = v[u];
                }
            }
        }
        base += total;
        __syncthreads();  // pre is read until here; the next chunk rewrites it
    }
    cta_log_end(cta_log);
}

// ---------------------------------------------------------------------------
// kv_store_blocks
// ---------------------------------------------------------------------------

// Copies whole blocks of a token-major cache into row r's host tiles (UVA
// writes, 16 bytes each, consecutive threads on consecutive host bytes).
// kptr, vptr: u64 [rows] -> K / V bf16 [tokens][hkv][D], token t at row
//   t % ring (ring > 0, the tail ring) or row t (ring = 0).
// host_tab: u64 [rows] -> block 0 of the row's host store (device-visible).
// Blocks: lens != null (write-back of a decode step): block lens[r] / B - 1
//   when lens[r] > 0 and lens[r] % B == 0, else none; lens == null (prefill
//   spill): blocks [b_lo[r], b_hi[r]).
// Requires D a multiple of 8 and 16-byte aligned addresses.
// Grid (x, rows), any block size: grid-stride over the row's
// (block, head, K|V, token, 16-byte piece) units in host byte order.
extern "C" __global__ void kv_store_blocks(const u64* __restrict__ kptr, const u64* __restrict__ vptr,
                                           const u64* __restrict__ host_tab, const int* __restrict__ lens,
                                           const int* __restrict__ b_lo, const int* __restrict__ b_hi, int hkv,
                                           int D, int B, int ring) {
    const int r = blockIdx.y;
    int lo, hi;
    if (lens != nullptr) {
        const int L = lens[r];
        if (L <= 0 || L % B != 0) return;
        lo = L / B - 1;
        hi = lo + 1;
    } else {
        lo = b_lo[r];
        hi = b_hi[r];
    }
    if (lo < 0 || hi <= lo) return;
    const int pieces = D / 8;  // 16-byte pieces per token row of one head
    const u64 tile_bytes = (u64)B * D * 2;
    const u64 block_bytes = (u64)hkv * 2 * tile_bytes;
    const u64 per_block = (u64)hkv * 2 * B * pieces;
    const u64 total = (u64)(hi - lo) * per_block;
    const char* kbase = (const char*)kptr[r];
    const char* vbase = (const char*)vptr[r];
    uint4* hbase = (uint4*)(host_tab[r] + (u64)lo * block_bytes);
    for (u64 u = (u64)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (u64)gridDim.x * blockDim.x) {
        u64 x = u;
        const int c = (int)(x % pieces);
        x /= pieces;
        const int t = (int)(x % B);
        x /= B;
        const int kv = (int)(x & 1);
        x >>= 1;
        const int h = (int)(x % hkv);
        const u64 blk = (u64)lo + x / hkv;
        const u64 tok = blk * B + t;
        const u64 row = ring > 0 ? tok % (u64)ring : tok;
        const uint4* src = (const uint4*)((kv ? vbase : kbase) + ((row * hkv + h) * D) * 2) + c;
        // Host byte order: u counts 16-byte pieces from block lo.
        hbase[u] = *src;
    }
}

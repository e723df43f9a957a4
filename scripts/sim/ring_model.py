#!/usr/bin/env python3
"""Toy model of the sparse prefill attention's per-block time: a block barrier per key tile
against the ring of PF_RING (kernels/attn_prefill.cu), to estimate what the ring can recover.
Not a simulation of the kernel (scripts/sim/attn_prefill_sim.py is): time in units of one warp's
work on one key tile.

Model: 4 warps (one query row each, NOSA-8B's G 16); a union of blocks, each with the set of
warps whose row selected it: 49 blocks selected by all 4 rows (the forced and eviction-chosen
blocks), 14 more per row drawn at random from 2,000 block ids, 7 of which the next row selects
too. Barrier per tile: the block takes one unit per union entry. Ring with S stages: an entry's
load starts when the entry S places earlier has been released by every warp that needed it and
takes 0.3; each warp works through its own entries in order, one unit each, once loaded.
Run: python3 scripts/sim/ring_model.py (200 random unions; prints the mean block time per S,
the barrier time 'bar', the union size 'U' and a row's selection 'row').
"""
import random
def sim(U_entries, S, L=0.3, W=4):
    # entries: list of sets of warps needing entry; time per compute = 1; load latency L
    n=len(U_entries)
    freed=[0.0]*n   # time entry's slot becomes reusable (all needing warps done)
    loaded=[0.0]*n
    done_w=[0.0]*W
    fin={}
    # process entries in order; per entry compute load start = max(freed[e-S]) (slot reuse), loaded = start+L
    warp_t=[0.0]*W
    for e,need in enumerate(U_entries):
        start = freed[e-S] if e>=S else 0.0
        loaded[e]=start+L
        end_all=loaded[e]
        for w in need:
            t0=max(warp_t[w], loaded[e])
            warp_t[w]=t0+1
            end_all=max(end_all,warp_t[w])
        freed[e]=end_all if need else loaded[e]
    return max(warp_t)
def barrier_sim(U_entries):
    return sum(1 for need in U_entries if need)
random.seed(1)
tot={}
for trial in range(200):
    # 49 shared entries, each row 14 own QA entries with some overlap with others
    entries=[]
    shared=random.sample(range(2000),49)
    own={w:set(random.sample(range(2000),14)) for w in range(4)}
    blocks={}
    for b in shared: blocks[b]={0,1,2,3}
    for w in range(4):
        for b in own[w]: blocks.setdefault(b,set()).add(w)
    # add overlap: row w+1 shares half of row w's QA
    for w in range(3):
        for b in list(own[w])[:7]: blocks[b].add(w+1)
    ents=[blocks[b] for b in sorted(blocks)]
    for S in [2,3,4,6,100]:
        tot.setdefault(S,0); tot[S]+=sim(ents,S)
    tot.setdefault('bar',0); tot['bar']+=barrier_sim(ents)
    tot.setdefault('U',0); tot['U']+=len(ents)
    tot.setdefault('row',0); tot['row']+=sum(len(s) for s in ents)/4
for k,v in tot.items(): print(k, v/200)

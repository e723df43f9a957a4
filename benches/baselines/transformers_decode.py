#!/usr/bin/env python3
"""Decode-step timing of Hugging Face transformers on the NOSA-8B shape, the
baselines of `sparda report` (runtime.md §5: "What users run today").

Two caches, both with PyTorch SDPA full attention:
  --cache gpu       DynamicCache, all KV on the GPU
  --cache offload   DynamicCache(offloading=True): KV in host memory, each
                    layer's KV brought to the GPU for its attention
A Llama config of the NOSA-8B shape (32 layers, hidden 4096, 32 heads, 2 KV
heads, head dim 128, FFN 16384, vocab 73448) with random bf16 weights, built
on the GPU; no network, no checkpoint. The cache is filled with random bf16
K/V of L tokens per sequence (as `sparda bench --prefill synthetic`: the
model is not run over the context; attention cost does not depend on the
values), then `--warmup` untimed and `--steps` timed greedy decode steps,
a CUDA event after each. tokens/s = B·steps / timed time.

Writes JSON that `sparda report` reads as extra rows:
  {"baseline": NAME, "what", "gpu", "torch", "transformers", "date_utc", "commit",
   "model_shape", "protocol", "rows": [{"mode", "batch", "context",
   "equivalent_batch"?, "steps", "step_ms_all", "step_ms_median",
   "step_ms_p99", "tokens_per_s", "gpu_mem_used_bytes", "host_mem_bytes",
   "skipped"?}]}

Usage (on the GPU machine; PyTorch and transformers installed):
  python3 benches/baselines/transformers_decode.py --cache gpu \
      --context 32K --batch 16 --json out/transformers_sdpa.json
  python3 benches/baselines/transformers_decode.py --cache offload \
      --context 16K,32K --equivalent-batch 64 --json out/transformers_offload.json
With --equivalent-batch EB the batch follows runtime.md §5 as in `sparda
bench`: the GPU-resident cache runs EB·S·64/L sequences (S = 64 attended
blocks), the offloaded one EB.
"""

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

def commit_of_tree():
    """The commit the comparison belongs to, as sparda's git_commit() gives it:
    $SPARDA_COMMIT (set by the device scripts, where the working tree travels
    without .git), else this tree's `git rev-parse HEAD` with "+dirty" when
    `git status --porcelain` lists changes, else None."""
    c = os.environ.get("SPARDA_COMMIT")
    if c:
        return c
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=here)
        dirty = status.returncode == 0 and status.stdout.strip() != ""
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return None


NOSA_8B = dict(
    num_hidden_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=16384,
    vocab_size=73448,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
BUDGET_BLOCKS = 64
BLOCK_SIZE = 64


def parse_tokens(s):
    """`4K` → 4096, `32768` → 32768 (as `sparda bench --context`)."""
    t = s.strip()
    mul = 1
    if t[-1:] in ("k", "K"):
        t, mul = t[:-1], 1024
    elif t[-1:] in ("m", "M"):
        t, mul = t[:-1], 1024 * 1024
    if not t.isdigit():
        raise SystemExit(f"bad token count `{s}` (e.g. 4096, 4K, 32K)")
    return int(t) * mul


def batch_for(cache, eb, context):
    """The real batch under the equivalent-batch protocol (runtime.md §5)."""
    if cache == "offload":
        return eb
    return max(1, eb * BUDGET_BLOCKS * BLOCK_SIZE // max(1, context))


def host_rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build_model(torch, seed):
    """(config, model): a Llama of the NOSA-8B shape with random bf16 weights
    on the GPU, PyTorch SDPA attention, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**NOSA_8B, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device("cuda"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(prev)
    model.eval()
    return cfg, model


def write_json(path, obj):
    """Writes `obj` to `path` through a temporary file, so a reader sees a
    complete report or the previous one (reports are rewritten after every cell)."""
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def percentile(v, p):
    """Nearest-rank percentile p (0–100), as src/bench.rs."""
    s = sorted(v)
    i = int(round(p / 100.0 * (len(s) - 1)))
    return s[min(i, len(s) - 1)]


def run_cell(torch, model, cfg, cache_kind, batch, context, steps, warmup, seed):
    from transformers import DynamicCache

    dev = torch.device("cuda")
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * batch * context
    free, _ = torch.cuda.mem_get_info()
    if cache_kind == "gpu" and kv_bytes + (8 << 30) > free:
        return {"skipped": f"KV of {kv_bytes / 2**30:.1f} GiB + 8 GiB margin exceeds {free / 2**30:.1f} GiB free on the GPU"}
    if cache_kind == "offload":
        avail = None
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        if avail is not None and kv_bytes + (16 << 30) > avail:
            return {"skipped": f"KV of {kv_bytes / 2**30:.1f} GiB + 16 GiB margin exceeds {avail / 2**30:.1f} GiB MemAvailable"}
    gen = torch.Generator(device=dev).manual_seed(seed)
    cache = DynamicCache(config=cfg, offloading=(cache_kind == "offload"))
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    # Fill layer by layer in order, as a forward pass would: with offloading
    # the cache moves each layer to the host after its update.
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        cache.update(k, v, layer)
        del k, v
    torch.cuda.synchronize()
    tok = torch.randint(3, cfg.vocab_size, (batch, 1), generator=gen, device=dev)
    pos = context
    times = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(
                input_ids=tok,
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((batch, 1), pos, device=dev, dtype=torch.long),
                cache_position=torch.tensor([pos], device=dev, dtype=torch.long),
            )
            tok = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
            pos += 1
            del out
    gpu_used = torch.cuda.mem_get_info()
    total_ms = sum(times)
    res = {
        "steps": steps,
        "warmup_steps": warmup,
        "step_ms_all": times,
        "step_ms_mean": total_ms / steps,
        "step_ms_median": percentile(times, 50),
        "step_ms_p99": percentile(times, 99),
        "tokens_per_s": batch * steps / (total_ms / 1e3),
        "gpu_mem_used_bytes": gpu_used[1] - gpu_used[0],
        "host_mem_bytes": kv_bytes if cache_kind == "offload" else 0,
        "host_rss_bytes": host_rss_bytes(),
        "kv_bytes": kv_bytes,
    }
    del cache
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", choices=["gpu", "offload"], required=True)
    ap.add_argument("--context", default="32K", help="context lengths, comma-separated (e.g. 16K,32K)")
    ap.add_argument("--batch", default="16", help="batch sizes, comma-separated (ignored with --equivalent-batch)")
    ap.add_argument("--equivalent-batch", default="", help="equivalent batch sizes, comma-separated (runtime.md §5)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True, help="output JSON (rewritten after every cell)")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 1:
        raise SystemExit("--steps and --warmup must be ≥ 1")

    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this baseline times GPU decode")
    cfg, model = build_model(torch, a.seed)
    contexts = [parse_tokens(c) for c in a.context.split(",") if c]
    ebs = [int(x) for x in a.equivalent_batch.split(",") if x]
    cells = []
    for l in contexts:
        if ebs:
            cells += [(eb, batch_for(a.cache, eb, l), l) for eb in ebs]
        else:
            cells += [(None, int(b), l) for b in a.batch.split(",") if b]
    name = "transformers-sdpa" if a.cache == "gpu" else "transformers-offloaded-cache"
    mode = (
        "transformers SDPA, KV on GPU"
        if a.cache == "gpu"
        else "transformers SDPA, DynamicCache(offloading=True)"
    )
    report = {
        "baseline": name,
        "what": f"transformers {transformers.__version__}, PyTorch SDPA full attention, "
        + ("DynamicCache on the GPU" if a.cache == "gpu" else "DynamicCache(offloading=True): KV in host memory, each layer's KV moved to the GPU for its attention")
        + ", NOSA-8B shape with random bf16 weights, cache filled with random K/V",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit_of_tree(),
        "model_shape": NOSA_8B,
        "protocol": f"{a.warmup} warm-up decode steps excluded, then {a.steps} timed greedy steps; CUDA events around each step; tokens/s = B·steps / timed time; random K/V fill, no prefill",
        "rows": [],
    }
    for eb, b, l in cells:
        print(f"{name}: B {b}, L {l}" + (f" (EB {eb})" if eb else ""), file=sys.stderr, flush=True)
        try:
            r = run_cell(torch, model, cfg, a.cache, b, l, a.steps, a.warmup, a.seed)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            r = {"skipped": f"CUDA out of memory: {str(e).splitlines()[0]}"}
        row = {"mode": mode, "batch": b, "context": l, **r}
        if eb is not None:
            row["equivalent_batch"] = eb
        report["rows"].append(row)
        if "skipped" in r:
            print(f"  skipped: {r['skipped']}", file=sys.stderr)
        else:
            print(f"  {r['step_ms_median']:.2f} ms/step (median), {r['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
        write_json(a.json, report)
    print(f"baseline: {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()

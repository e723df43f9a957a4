#!/usr/bin/env python3
"""Prefill timing of Hugging Face transformers on the NOSA-8B shape: the
baseline beside `sparda bench --steps 0 --prefill dense|sparse` (prefill
tokens/s and time to first token).

A Llama config of the NOSA-8B shape (transformers_decode.py's NOSA_8B) with
random bf16 weights, built on the GPU; PyTorch SDPA full causal attention;
no network, no checkpoint. Each cell prefills B sequences of L random token
ids (one forward over the whole prompt, as `model.generate` does for its
first token; `logits_to_keep=1` so only the last position's logits are
made), after one untimed warm-up forward of 2,048 tokens. Sequences are
prefilled one at a time (`--together` prefills the batch in one forward).
Time to first token = the forward plus the argmax of the last logits,
CUDA events around it. tokens/s = B·L / the sum of the timed forwards.

Writes JSON (rewritten after every cell):
  {"baseline": "transformers-sdpa-prefill", "what", "gpu", "torch",
   "transformers", "date_utc", "commit", "model_shape", "protocol",
   "rows": [{"mode", "batch", "context", "prefill_ms_per_sequence",
   "ttft_ms_per_sequence", "ttft_ms_median", "prefill_tokens_per_s",
   "gpu_mem_peak_bytes", "skipped"?}]}

Usage (on the GPU machine; PyTorch and transformers installed):
  python3 benches/baselines/transformers_prefill.py \
      --context 4K,16K,32K,64K,128K --batch 1,4 --json out/transformers_prefill.json
"""

import argparse
import datetime
import sys

from transformers_decode import NOSA_8B, build_model, commit_of_tree, parse_tokens, percentile, write_json

WARMUP_TOKENS = 2048


def forward_last(model, ids):
    """One prefill forward; returns the argmax of the last position's logits."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].argmax(dim=-1)


def run_cell(torch, model, cfg, batch, context, together, seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    groups = [batch] if together else [1] * batch
    prefill_ms, ttft_ms = [], []
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        for n in groups:
            ids = torch.randint(3, cfg.vocab_size, (n, context), generator=gen, device=dev)
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            mid = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            mid.record()
            tok = out.logits[:, -1, :].argmax(dim=-1)
            tok.cpu()
            end.record()
            end.synchronize()
            prefill_ms.append(start.elapsed_time(mid))
            ttft_ms.append(start.elapsed_time(end))
            del out, ids, tok
            torch.cuda.empty_cache()
    total_ms = sum(prefill_ms)
    return {
        "prefill_ms_per_sequence" if not together else "prefill_ms_per_batch": prefill_ms,
        "ttft_ms_per_sequence" if not together else "ttft_ms_per_batch": ttft_ms,
        "ttft_ms_median": percentile(ttft_ms, 50),
        "prefill_tokens_per_s": batch * context / (total_ms / 1e3),
        "gpu_mem_peak_bytes": torch.cuda.max_memory_allocated(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="4K,16K,32K", help="prompt lengths, comma-separated (e.g. 4K,32K,128K)")
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    ap.add_argument("--together", action="store_true", help="prefill a batch in one forward (default: one sequence at a time, as sparda bench)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True, help="output JSON (rewritten after every cell)")
    a = ap.parse_args()

    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this baseline times GPU prefill")
    cfg, model = build_model(torch, a.seed)
    with torch.inference_mode():
        warm = torch.randint(3, cfg.vocab_size, (1, WARMUP_TOKENS), device="cuda")
        forward_last(model, warm)
        torch.cuda.synchronize()
        del warm
    contexts = [parse_tokens(c) for c in a.context.split(",") if c]
    batches = [int(b) for b in a.batch.split(",") if b]
    mode = "transformers SDPA prefill" + (" (batch in one forward)" if a.together else "")
    report = {
        "baseline": "transformers-sdpa-prefill",
        "what": f"transformers {transformers.__version__}, PyTorch SDPA full causal attention, one forward over the prompt per sequence"
        + (" (whole batch per forward)" if a.together else "")
        + ", NOSA-8B shape with random bf16 weights, random token ids",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit_of_tree(),
        "model_shape": NOSA_8B,
        "protocol": f"one untimed {WARMUP_TOKENS}-token warm-up forward; per sequence one timed forward (logits_to_keep=1), CUDA events; the forward grows its DynamicCache inside the timed region (sparda allocates a sequence's KV before its clock starts); time to first token adds the argmax and its copy to the host; tokens/s = B·L / the timed forwards",
        "rows": [],
    }
    for l in contexts:
        for b in batches:
            print(f"transformers prefill: B {b}, L {l}", file=sys.stderr, flush=True)
            try:
                r = run_cell(torch, model, cfg, b, l, a.together, a.seed)
            except torch.cuda.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                r = {"skipped": f"CUDA out of memory: {str(e).splitlines()[0]}"}
            report["rows"].append({"mode": mode, "batch": b, "context": l, **r})
            if "skipped" in r:
                print(f"  skipped: {r['skipped']}", file=sys.stderr)
            else:
                print(f"  {r['prefill_tokens_per_s']:.0f} tokens/s, time to first token {r['ttft_ms_median']:.1f} ms (median)", file=sys.stderr)
            write_json(a.json, report)
    print(f"baseline: {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()

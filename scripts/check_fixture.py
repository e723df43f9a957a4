#!/usr/bin/env python3
"""Check the converted fixture against transformers' own reading of the GGUF (developer tool, not CI).

    bash scripts/fixture.sh                       # build the fixture first
    .venv-golden/bin/python scripts/check_fixture.py   # venv: see scripts/golden.py's header

1. Tokenizer: our tokenizer.json (read by the `tokenizers` package) encodes exactly as
   `AutoTokenizer.from_pretrained(cache, gguf_file=...)` on the five books in shared/data/texts
   (full texts) and on tricky strings; decoding gives the text back.
2. Weights: every tensor of `LlamaForCausalLM.from_pretrained(fixture_dir)` equals, bit for bit,
   the one transformers makes from the GGUF at torch_dtype=bfloat16 (proves the q/k un-permute
   and the bf16 rounding).
3. Logits: both models in f32 on a short prompt; relative L2 error of the logits (want < 1e-5).
Exits non-zero on any failure.
"""

import os
import sys
import time

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.environ.get("SPARDA_FIXTURE_DIR", os.path.join(ROOT, ".fixtures/smollm2-135m-instruct"))
CACHE = os.environ.get("SPARDA_FIXTURE_CACHE", os.path.join(ROOT, ".fixtures/cache"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_texts():
    for base in (os.path.join(ROOT, "shared"), os.path.join(os.path.dirname(ROOT), "shared"), "/work/shared"):
        d = os.path.join(base, "data/texts")
        if os.path.isdir(d):
            return d
    sys.exit("check_fixture.py: shared/data/texts not found")


TRICKY = [
    "",
    " ",
    "Hello world",
    " Hello  world ",
    "2024 1,234,567.89 3.14159 x1 x12 $100 50% 0x1F 007",
    "a  1",
    "a   12\t3\n4",
    "In 1603,  1604 and   99 bottles",
    "\n\n\nline1\r\nline2\n \n\t\tindented\n",
    "trailing spaces   ",
    "   leading spaces",
    "unicode: café naïve résumé Ünïcødé — “quotes” ‘single’ … 日本語 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👨‍👩‍👧",
    "²³¹ ½ ① Ⅻ ٣ ६",
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<jupyter_code>z<empty_output>",
    "text<|im_start|>glued<|im_end|>end",
    " <|im_start|> spaced <|im_end|> ",
    "<|im_start|<|im_end|>>",
    "don't won't I'm you're they've we'll he'd IT'S DON'T",
    "def f(x):\n    return x**2  # comment\n\n\nclass A:\n\tpass\n",
    "https://example.com/path?q=1&r=2#frag",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
    "\x00\x01\x7f control chars",
]


def check_tokenizer():
    t0 = time.time()
    ref = AutoTokenizer.from_pretrained(CACHE, gguf_file=GGUF)
    ours = Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    texts_dir = find_texts()
    cases = []
    for name in sorted(os.listdir(texts_dir)):
        if name.endswith(".txt") and name != "README.md":
            with open(os.path.join(texts_dir, name), encoding="utf-8") as f:
                cases.append((name, f.read()))
    cases += [(f"tricky[{i}]", s) for i, s in enumerate(TRICKY)]
    bad = 0
    for name, text in cases:
        a = ref(text)["input_ids"]
        b = ours.encode(text).ids
        if a != b:
            bad += 1
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"  MISMATCH {name}: {len(a)} vs {len(b)} tokens, first diff at {k}: "
                  f"{a[k:k + 5]} vs {b[k:k + 5]}")
            continue
        back = ours.decode(b, skip_special_tokens=False)
        rt = "ok" if back == text else "DIFFERS"
        if back != text:
            bad += 1
        if name.endswith(".txt"):
            print(f"  {name}: {len(text)} chars -> {len(a)} tokens, identical; decode round-trip {rt}")
        elif back != text:
            print(f"  {name}: ids identical; decode round-trip {rt}: {back!r} vs {text!r}")
    print(f"tokenizer: {len(cases) - bad}/{len(cases)} cases identical ({time.time() - t0:.1f} s)")
    return bad == 0


def load_models():
    ref = AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=GGUF, dtype=torch.bfloat16)
    ours = LlamaForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16)
    return ref.eval(), ours.eval()


def check_weights(ref, ours):
    a, b = ref.state_dict(), ours.state_dict()
    if set(a) != set(b):
        print(f"weights: key sets differ: {sorted(set(a) ^ set(b))[:10]}")
        return False
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    print(f"weights: {len(a) - len(bad)}/{len(a)} tensors bitwise equal (bf16)")
    for k in bad[:10]:
        print(f"  differs: {k} {tuple(a[k].shape)} {tuple(b[k].shape)}")
    return not bad


@torch.no_grad()
def check_logits(ref, ours, tok):
    # transformers refuses `.float()` on a GGUF-loaded model ("quantized"); its weights are plain
    # bf16 tensors here, so nn.Module's own cast does what we mean.
    ref, ours = torch.nn.Module.float(ref), ours.float()
    assert all(p.dtype == torch.float32 for p in ref.parameters())
    text = "The quick brown fox jumps over the lazy dog. In 1603, Hamlet"
    ids = torch.tensor([tok(text)["input_ids"]])
    la = ref(ids).logits[0]
    lb = ours(ids).logits[0]
    rel = ((la - lb).norm() / la.norm()).item()
    per_step = ((la - lb).norm(dim=-1) / la.norm(dim=-1)).max().item()
    print(f"logits: {ids.shape[1]} tokens, rel L2 (all positions) {rel:.3e}, worst position {per_step:.3e}")
    return rel < 1e-5


def main():
    torch.manual_seed(0)
    ok = check_tokenizer()
    ref, ours = load_models()
    ok &= check_weights(ref, ours)
    tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=GGUF)
    ok &= check_logits(ref, ours, tok)
    print("check_fixture: " + ("OK" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

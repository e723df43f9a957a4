#!/usr/bin/env python3
"""Build the real-weights fixture (SmolLM2-135M-Instruct) in Hugging Face layout from its GGUF.

Run through scripts/fixture.sh, which downloads the GGUF and makes the venv. Direct use:

    .venv/bin/python scripts/fixture.py --gguf PATH.gguf --out DIR

Writes into DIR:
  model.safetensors       bf16 tensors under HF Llama names (q/k rows un-permuted from llama.cpp's
                          RoPE layout, exactly as transformers' GGUF loader does)
  config.json             LlamaForCausalLM config from the GGUF metadata
  generation_config.json  bos/eos ids
  tokenizer.json          byte-level BPE (HF `tokenizers` format), built as transformers builds the
                          tokenizer of a GGUF (so ids match `AutoTokenizer.from_pretrained(gguf_file=)`)
  tokenizer_config.json   special tokens and the chat template, for transformers' AutoTokenizer
  fixture.sha256          manifest: sha256 of every file above, of the GGUF and of this script

Dequantization: gguf.quants.dequantize (f32), then f32 -> bf16 with round-to-nearest-even, which is
what torch's `.to(torch.bfloat16)` does, so the weights equal those transformers gets from
`from_pretrained(..., gguf_file=..., torch_dtype=torch.bfloat16)`.
"""

import argparse
import hashlib
import json
import os
import struct
import sys

import numpy as np
import gguf

# -------------------------------------------------------------------------------------------------
# GGUF metadata


def field_value(reader, key, default=None):
    """A GGUF metadata value as a Python scalar, string or list."""
    f = reader.fields.get(key)
    if f is None:
        return default
    main = f.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if main == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    v = f.parts[f.data[0]].tolist()[0]
    if main == gguf.GGUFValueType.BOOL:
        return bool(v)
    return v


def f32_shortest(x):
    """The shortest decimal that reads back as the same f32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def read_hparams(reader):
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        sys.exit(f"fixture.py: GGUF architecture {arch!r}, expected 'llama'")
    g = lambda k, d=None: field_value(reader, f"{arch}.{k}", d)  # noqa: E731
    d = g("embedding_length")
    n_head = g("attention.head_count")
    n_kv = g("attention.head_count_kv", n_head)
    head_dim = g("attention.key_length", d // n_head)
    rope_dim = g("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        sys.exit(f"fixture.py: partial RoPE (dimension_count {rope_dim} != head_dim {head_dim}) not supported")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    return {
        "arch": arch,
        "name": field_value(reader, "general.name"),
        "n_layer": g("block_count"),
        "d": d,
        "ff": g("feed_forward_length"),
        "n_head": n_head,
        "n_kv": n_kv,
        "head_dim": head_dim,
        "vocab": g("vocab_size", len(tokens)),
        "ctx": g("context_length"),
        "rope_theta": f32_shortest(g("rope.freq_base", 10000.0)),
        "eps": f32_shortest(g("attention.layer_norm_rms_epsilon")),
        "rope_scaling_type": g("rope.scaling.type"),
        "bos": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad": field_value(reader, "tokenizer.ggml.padding_token_id"),
        "unk": field_value(reader, "tokenizer.ggml.unknown_token_id"),
        "add_bos": bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)),
        "tied": "output.weight" not in tensor_names,
    }


# -------------------------------------------------------------------------------------------------
# Tensors


def hf_name(gguf_name):
    """GGUF tensor name -> HF Llama name (None: not a weight we carry)."""
    glob = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in glob:
        return glob[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    i, kind, suffix = parts[1], parts[2], parts[3]
    sub = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }.get(kind)
    if sub is None:
        return None
    return f"model.layers.{i}.{sub}.{suffix}"


def unpermute_rows(w, n_head):
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf's `permute`).

    llama.cpp stores each head's rows as [pairs-interleaved]; HF keeps the rotate-half layout:
    rows viewed as (n_head, 2, D/2) on the HF side became (n_head, D/2, 2) in the GGUF. Same as
    transformers' `_reverse_permute_weights`.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def f32_to_bf16_bits(a):
    """f32 -> bf16 bit patterns, round to nearest even (torch's `.to(torch.bfloat16)`); NaN -> 0x7FC0."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def convert_tensors(reader, hp):
    """[(hf_name, shape, bf16-bits ndarray)] sorted by name."""
    out = []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            sys.exit(f"fixture.py: unexpected GGUF tensor {t.name}")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32)
        # GGUF lists shapes innermost-first; numpy's (and HF's [out, in]) is the reverse.
        want = tuple(int(x) for x in reversed(t.shape.tolist()))
        if w.shape != want:
            w = w.reshape(want)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, hp["n_head"])
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, hp["n_kv"])
        out.append((name, w.shape, f32_to_bf16_bits(w)))
    out.sort(key=lambda x: x[0])
    return out


def check_shapes(tensors, hp):
    d, H, Hkv, D, I, V = hp["d"], hp["n_head"], hp["n_kv"], hp["head_dim"], hp["ff"], hp["vocab"]
    want = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    if not hp["tied"]:
        want["lm_head.weight"] = (V, d)
    for i in range(hp["n_layer"]):
        p = f"model.layers.{i}."
        want.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (H * D, d),
            p + "self_attn.k_proj.weight": (Hkv * D, d),
            p + "self_attn.v_proj.weight": (Hkv * D, d),
            p + "self_attn.o_proj.weight": (d, H * D),
            p + "mlp.gate_proj.weight": (I, d),
            p + "mlp.up_proj.weight": (I, d),
            p + "mlp.down_proj.weight": (d, I),
        })
    got = {n: tuple(s) for n, s, _ in tensors}
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        bad = sorted(n for n in set(got) & set(want) if got[n] != want[n])
        sys.exit(f"fixture.py: tensor set mismatch: missing {missing[:5]} extra {extra[:5]} "
                 f"bad shapes {[(n, got[n], want[n]) for n in bad[:5]]}")


def write_safetensors(path, tensors):
    """safetensors file: u64 LE header length, JSON header (space-padded to 8 bytes), raw LE data."""
    header = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, bits in tensors:
        n = bits.nbytes
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((8 - len(hb) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, _, bits in tensors:
            f.write(bits.astype("<u2", copy=False).tobytes())
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------------
# Tokenizer


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


CONTROL, USER_DEFINED = 3, 4


def build_tokenizer(reader, hp):
    """tokenizer.json for a GGUF `gpt2` (byte-level BPE) vocabulary.

    Built the way transformers builds the tokenizer of a GGUF file (so that ids match
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, the project's oracle): BPE over the file's
    tokens and merges, GPT-2's ByteLevel pre-tokenizer (its regex) unless transformers knows a split
    regex for `tokenizer.ggml.pre`, ByteLevel decoder, control tokens (type 3) as special added
    tokens, user-defined (type 4) as plain added tokens, BOS added only if add_bos_token.

    Note: for pre 'smollm' llama.cpp (and the original SmolLM2 tokenizer.json) also split digits
    one by one before the regex; transformers' GGUF tokenizer does not, and we follow transformers.
    This vocabulary has no multi-digit token, so the two differ only on whitespace runs right
    before a digit ("a  1": transformers 'a','Ġ','Ġ','1'; original 'a','ĠĠ','1').
    """
    model = field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"fixture.py: tokenizer.ggml.model {model!r}: only 'gpt2' (byte-level BPE) is supported")
    pre = field_value(reader, "tokenizer.ggml.pre")
    if pre not in (None, "default", "gpt2", "smollm", "starcoder"):
        # transformers swaps in its own split regex for some pre types (llama3, qwen2, ...): not needed here.
        sys.exit(f"fixture.py: tokenizer.ggml.pre {pre!r} not handled")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = field_value(reader, "tokenizer.ggml.merges")
    add_prefix_space = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", False))

    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
        vocab[key] = i  # a later duplicate wins, as in a dict comprehension

    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == CONTROL and set(t) <= alphabet:
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True})
        elif ty == USER_DEFINED and t in vocab:
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": False})

    single = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    specials = {}
    if hp["add_bos"]:
        bos = tokens[hp["bos"]]
        single = [{"SpecialToken": {"id": bos, "type_id": 0}}] + single
        pair = [{"SpecialToken": {"id": bos, "type_id": 0}}, pair[0],
                {"SpecialToken": {"id": bos, "type_id": 1}}, pair[1]]
        specials[bos] = {"id": bos, "ids": [hp["bos"]], "tokens": [bos]}
    if hp["add_eos"]:
        eos = tokens[hp["eos"]]
        single = single + [{"SpecialToken": {"id": eos, "type_id": 0}}]
        pair = pair[:-1] + [{"SpecialToken": {"id": eos, "type_id": 0}}, pair[-1],
                            {"SpecialToken": {"id": eos, "type_id": 1}}]
        specials[eos] = {"id": eos, "ids": [hp["eos"]], "tokens": [eos]}

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
                           "special_tokens": specials},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [m.split(" ") for m in merges],
        },
    }


# -------------------------------------------------------------------------------------------------
# Configs


def build_config(hp):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hp["d"],
        "intermediate_size": hp["ff"],
        "num_hidden_layers": hp["n_layer"],
        "num_attention_heads": hp["n_head"],
        "num_key_value_heads": hp["n_kv"],
        "head_dim": hp["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": hp["eps"],
        "vocab_size": hp["vocab"],
        "max_position_embeddings": hp["ctx"],
        "rope_theta": hp["rope_theta"],
        "rope_scaling": None,
        "tie_word_embeddings": hp["tied"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": hp["bos"],
        "eos_token_id": hp["eos"],
        "pad_token_id": hp["pad"],
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if hp["rope_scaling_type"] not in (None, "none"):
        sys.exit(f"fixture.py: rope scaling {hp['rope_scaling_type']!r} not handled")
    return cfg


def build_tokenizer_config(reader, hp):
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    tok = lambda i: tokens[i] if i is not None else None  # noqa: E731
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": hp["add_bos"],
        "add_eos_token": hp["add_eos"],
        "bos_token": tok(hp["bos"]),
        "eos_token": tok(hp["eos"]),
        "unk_token": tok(hp["unk"]),
        "pad_token": tok(hp["pad"]),
        "model_max_length": hp["ctx"],
        "clean_up_tokenization_spaces": False,
    }
    tmpl = field_value(reader, "tokenizer.chat_template")
    if tmpl is not None:
        cfg["chat_template"] = tmpl
    return cfg


# -------------------------------------------------------------------------------------------------


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path, obj, indent=2):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


OUTPUTS = ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
           "tokenizer_config.json"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf-sha256", help="sha256 of the GGUF if already known")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    manifest = os.path.join(args.out, "fixture.sha256")
    if os.path.exists(manifest):
        os.remove(manifest)  # only a finished build has a manifest

    reader = gguf.GGUFReader(args.gguf)
    hp = read_hparams(reader)

    tensors = convert_tensors(reader, hp)
    check_shapes(tensors, hp)
    write_safetensors(os.path.join(args.out, "model.safetensors"), tensors)
    del tensors

    write_json(os.path.join(args.out, "config.json"), build_config(hp))
    gen = {"bos_token_id": hp["bos"], "eos_token_id": hp["eos"], "pad_token_id": hp["pad"],
           "do_sample": False}
    write_json(os.path.join(args.out, "generation_config.json"), gen)
    write_json(os.path.join(args.out, "tokenizer.json"), build_tokenizer(reader, hp), indent=None)
    write_json(os.path.join(args.out, "tokenizer_config.json"), build_tokenizer_config(reader, hp))

    gguf_sha = args.gguf_sha256 or sha256_file(args.gguf)
    lines = [f"{sha256_file(os.path.join(args.out, n))}  {n}" for n in OUTPUTS]
    lines.append(f"# gguf {gguf_sha}  {os.path.basename(args.gguf)}")
    lines.append(f"# script {sha256_file(os.path.abspath(__file__))}  scripts/fixture.py")
    tmp = manifest + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, manifest)

    print(f"fixture.py: {hp['name']}: L={hp['n_layer']} d={hp['d']} H={hp['n_head']} Hkv={hp['n_kv']} "
          f"D={hp['head_dim']} I={hp['ff']} V={hp['vocab']} theta={hp['rope_theta']} eps={hp['eps']} "
          f"max_pos={hp['ctx']} bos={hp['bos']} eos={hp['eos']} add_bos={hp['add_bos']} tied={hp['tied']}",
          file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the starting inputs of every fuzz target to fuzz/seeds/<target>/.

Real inputs, kept small (< 100 KB each): the SmolLM2 fixture's config.json,
the header of its model.safetensors and a trimmed tokenizer.json
(scripts/fixture.sh builds the fixture; SPARDA_FIXTURE_DIR overrides its
place), trimmed traces from traces/, and inputs written here in the formats
the runtime reads (configs with every RoPE type and a sparse_config, small
safetensors files and shard indexes, torch.save-style .pt archives written
without torch, as SparDA's trainer writes them). Python 3 standard library
only. Run from anywhere: python3 fuzz/make_seeds.py
"""
import io
import json
import os
import pickle
import struct
import sys
import types
import zipfile

FUZZ = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(FUZZ)
FIXTURE = os.environ.get(
    "SPARDA_FIXTURE_DIR", os.path.join(ROOT, ".fixtures", "smollm2-135m-instruct")
)
LIMIT = 100_000


def out(target, name, data):
    if isinstance(data, str):
        data = data.encode()
    assert len(data) < LIMIT, f"{target}/{name}: {len(data)} bytes"
    d = os.path.join(FUZZ, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- config.json
SMALL = {
    "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
    "num_hidden_layers": 2, "intermediate_size": 16, "vocab_size": 16,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
}


def configs():
    with open(os.path.join(FIXTURE, "config.json"), "rb") as f:
        out("config_json", "smollm2.json", f.read())
    base = dict(SMALL)
    out("config_json", "small.json", json.dumps(base))
    nosa = dict(base, model_type="minicpm", architectures=["MiniCPMForCausalLM"],
                scale_emb=12, scale_depth=1.4, dim_model_base=256, eos_token_id=[2, 3],
                bos_token_id=1,
                sparse_config={"kernel_size": 32, "kernel_stride": 16, "block_size": 64,
                               "init_blocks": 1, "window_size": 1024, "topk": 48,
                               "select_blocks": 16, "dense_len": 2048})
    out("config_json", "minicpm_sparse.json", json.dumps(nosa, indent=1))
    half = 2  # head_dim 4
    ropes = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "longrope": {"rope_type": "longrope", "short_factor": [1.0] * half,
                     "long_factor": [1.5] * half, "original_max_position_embeddings": 64},
    }
    for name, r in ropes.items():
        out("config_json", f"rope_{name}.json", json.dumps(dict(base, rope_scaling=r)))
    out("config_json", "rope_parameters.json",
        json.dumps(dict(base, rope_parameters={"rope_type": "su", "rope_theta": 5e5,
                                               "short_factor": [1.0, 1.1],
                                               "long_factor": [2.0, 2.5]},
                        original_max_position_embeddings=64, sliding_window=None,
                        use_sliding_window=False, head_dim=4, hidden_act="silu",
                        partial_rotary_factor=1.0, tie_word_embeddings=True,
                        attention_bias=True, mlp_bias=True)))


# ---------------------------------------------------------------- safetensors
def safetensors_bytes(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def small_model_tensors(eviction=False):
    """Every tensor of the SMALL config (d 8, H 2, Hkv 1, D 4, I 16, V 16, L 2), bf16."""
    d, q, kv, i, v = 8, 8, 4, 16, 16
    shapes = {"model.embed_tokens.weight": [v, d], "model.norm.weight": [d],
              "lm_head.weight": [v, d]}
    for l in range(2):
        p = f"model.layers.{l}."
        shapes.update({
            p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d],
            p + "self_attn.q_proj.weight": [q, d], p + "self_attn.k_proj.weight": [kv, d],
            p + "self_attn.v_proj.weight": [kv, d], p + "self_attn.o_proj.weight": [d, q],
            p + "mlp.gate_proj.weight": [i, d], p + "mlp.up_proj.weight": [i, d],
            p + "mlp.down_proj.weight": [d, i],
        })
        if eviction:
            shapes[p + "self_attn.A"] = [1]
            shapes[p + "self_attn.delta.weight"] = [1, kv]
    out_t = []
    for k, (name, shape) in enumerate(sorted(shapes.items())):
        n = 1
        for x in shape:
            n *= x
        out_t.append((name, "BF16", shape, bytes([(k + j) % 251 for j in range(2 * n)])))
    return out_t


def weights():
    with open(os.path.join(FIXTURE, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(0)
        head = f.read(8 + n + 4096)
    # the real header with the first 4 KB of data: a truncated file
    out("safetensors", "smollm2_head.safetensors", head)
    out("safetensors", "small_model.safetensors",
        safetensors_bytes(small_model_tensors(), {"format": "pt"}))
    out("safetensors", "small_nosa.safetensors",
        safetensors_bytes(small_model_tensors(eviction=True)))
    mixed = [("a", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
             ("b", "F16", [3], b"\x00\x3c\x00\x40\x00\xc0"),
             ("c", "BF16", [], b"\x80\x3f"), ("d", "I64", [1], b"\x01" + b"\x00" * 7),
             ("e", "F32", [0, 5], b"")]
    out("safetensors", "dtypes.safetensors", safetensors_bytes(mixed))
    out("safetensors", "dtypes_supported.safetensors",
        safetensors_bytes([t for t in mixed if t[1] != "I64"]))
    out("safetensors", "lfs_pointer.safetensors",
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 269060552\n")
    # the shard index of the small model in two shards
    names = [t[0] for t in small_model_tensors(eviction=True)]
    wm = {n: f"model-0000{1 + (k % 2)}-of-00002.safetensors" for k, n in enumerate(names)}
    out("shard_index", "small_two_shards.json",
        json.dumps({"metadata": {"total_size": 4096}, "weight_map": wm}, indent=2))
    # the fixture's tensor names in three shards, as transformers writes them
    h = json.loads(head[8:8 + n])
    real = sorted(k for k in h if k != "__metadata__")
    wm = {k: f"model-0000{1 + i * 3 // len(real)}-of-00003.safetensors"
          for i, k in enumerate(real)}
    out("shard_index", "smollm2_three_shards.json",
        json.dumps({"metadata": {"total_size": 269060552}, "weight_map": wm}, indent=2))


# ---------------------------------------------------------------- tokenizer.json
def tokenizers():
    with open(os.path.join(FIXTURE, "tokenizer.json"), encoding="utf-8") as f:
        t = json.load(f)
    keep = 600
    vocab = {k: v for k, v in t["model"]["vocab"].items() if v < keep}
    merges = []
    for m in t["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    t["model"]["vocab"], t["model"]["merges"] = vocab, merges
    trimmed = json.dumps(t, ensure_ascii=False, separators=(",", ":"))
    out("tokenizer_json", "smollm2_trimmed.json", trimmed)
    # the same with merges in the older "a b" string form
    t["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges[:80]]
    t["model"]["vocab"] = {k: v for k, v in vocab.items() if v < 400}
    t["model"]["merges"] = [m for m in t["model"]["merges"]
                            if all(p in t["model"]["vocab"] for p in m.split(" ", 1))
                            and m.replace(" ", "", 1) in t["model"]["vocab"]]
    out("tokenizer_json", "smollm2_string_merges.json",
        json.dumps(t, ensure_ascii=False, separators=(",", ":")))
    # SentencePiece-style (Llama 2): byte fallback, Metaspace, decoder sequence
    sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        sp_vocab[f"<0x{b:02X}>"] = len(sp_vocab)
    for piece in ["▁", "▁t", "▁the", "e", "h", "t", "a", "w", "▁a", "▁w", "o", "r", "l", "d"]:
        sp_vocab.setdefault(piece, len(sp_vocab))
    sp = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for c, i in [("<unk>", 0), ("<s>", 1), ("</s>", 2)]],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace",
                                                  "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                                      "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": sp_vocab, "merges": ["▁ t", "▁t h", "▁th e", "▁ a", "▁ w"]},
    }
    sp_vocab["▁th"] = len(sp_vocab)
    out("tokenizer_json", "sentencepiece_bpe.json", json.dumps(sp, ensure_ascii=False))
    unigram = {
        "version": "1.0", "added_tokens": [], "normalizer": {"type": "NFKC"},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                          "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                    "split": True},
        "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": False,
                  "vocab": [["<unk>", 0.0], ["▁", -2.0], ["▁hello", -3.0], ["l", -4.0],
                            ["o", -4.5], ["▁wor", -5.0], ["d", -5.5], ["h", -6.0], ["e", -6.0]]},
    }
    out("tokenizer_json", "unigram.json", json.dumps(unigram, ensure_ascii=False))
    wordpiece = {
        "version": "1.0", "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": False,
                                            "lstrip": False, "rstrip": False,
                                            "normalized": False, "special": True}],
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100,
                  "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3, "!": 4, ",": 5}},
    }
    out("tokenizer_json", "wordpiece.json", json.dumps(wordpiece))
    wordlevel = {
        "version": "1.0", "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+|(?=[!?])"},
                          "behavior": "Removed", "invert": False},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "unk_token": "<unk>",
                  "vocab": {"<unk>": 0, "Hello,": 1, "world": 2, "!": 3}},
    }
    out("tokenizer_json", "wordlevel.json", json.dumps(wordlevel))


# ---------------------------------------------------------------- SparDA .pt
def fake_torch():
    """Modules `torch`, `torch._utils` with the names torch.save pickles, so
    that the standard pickler writes the same GLOBAL opcodes without torch."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise RuntimeError("never called")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    for cls in ["BFloat16Storage", "HalfStorage", "FloatStorage", "LongStorage"]:
        setattr(torch, cls, type(cls, (), {"__module__": "torch", "__qualname__": cls}))
    sys.modules["torch"], sys.modules["torch._utils"] = torch, utils
    return torch


class Storage:
    def __init__(self, cls, key, raw, numel):
        self.cls, self.key, self.raw, self.numel = cls, key, raw, numel


class Tensor:
    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce__(self):
        import collections
        import torch._utils
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, self.offset, tuple(self.size), tuple(self.stride), False,
                 collections.OrderedDict()))


def torch_save(obj, storages, name="archive"):
    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, Storage):
                return ("storage", o.cls, o.key, "cpu", o.numel)
            return None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(obj)
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{name}/data.pkl", buf.getvalue())
        zf.writestr(f"{name}/byteorder", "little")
        for s in storages:
            zf.writestr(f"{name}/data/{s.key}", s.raw)
        zf.writestr(f"{name}/version", "3\n")
    return z.getvalue()


def torch_pts():
    import collections
    torch = fake_torch()
    rows, d = 4, 8  # the fuzz target's small model: [Hkv*D, d]
    storages, sd = [], collections.OrderedDict()

    def bf16(key, n, seed):
        s = Storage(torch.BFloat16Storage, key, bytes((seed * 7 + j) % 256 for j in range(2 * n)), n)
        storages.append(s)
        return s

    for l in range(2):
        s = bf16(str(l), rows * d, l)
        sd[f"model.layers.{l}.self_attn.q_future_proj.weight"] = Tensor(s, 0, [rows, d], [d, 1])
    base = bf16("2", d * rows, 2)  # q_curr_proj saved as a transposed view
    sd["model.layers.0.self_attn.q_curr_proj.weight"] = Tensor(base, 0, [rows, d], [1, rows])
    f32 = Storage(torch.FloatStorage, "3", struct.pack("<13f", *range(13)), 13)
    storages.append(f32)
    opt = {"state": {0: {"exp_avg": Tensor(f32, 1, [4, 3], [3, 1]), "step": 3.0}},
           "param_groups": [{"lr": 1e-3, "params": [0], "betas": (0.9, 0.95),
                             "name": "forecast"}]}
    ckpt = {"model_state_dict": sd, "optimizer_state_dict": opt, "step": 3}
    out("torch_pt", "sparda_small_forecast.pt", torch_save(ckpt, storages, "ckpt-3"))
    # the state dict alone under the `module.` prefix, f16 storage
    half = Storage(torch.HalfStorage, "0", bytes(2 * rows * d), rows * d)
    sd2 = {f"module.layers.{l}.self_attn.q_future_proj.weight": Tensor(half, 0, [rows, d], [d, 1])
           for l in range(2)}
    sd2["module.layers.0.self_attn.q_curr_proj.weight"] = Tensor(half, 0, [rows, d], [d, 1])
    out("torch_pt", "state_dict_f16.pt", torch_save(sd2, [half], "archive"))
    # the pickle programs alone, for the torch_pickle target (its storages
    # 0 … 3 hold 256 bytes each, enough for every view above)
    for name in ["sparda_small_forecast.pt", "state_dict_f16.pt"]:
        with open(os.path.join(FUZZ, "seeds", "torch_pt", name), "rb") as f:
            z = zipfile.ZipFile(f)
            pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
            out("torch_pickle", name.replace(".pt", ".pkl"), z.read(pkl))


# ---------------------------------------------------------------- traces
def traces():
    tdir = os.path.join(ROOT, "traces")
    for fname in sorted(os.listdir(tdir)):
        if not fname.startswith("example_") or fname.endswith("_summary.json") \
                or not fname.endswith(".json"):
            continue
        with open(os.path.join(tdir, fname)) as f:
            t = json.load(f)
        ev = t["traceEvents"]
        meta = [e for e in ev if e.get("ph") in ("M", "i", "B", "E")]
        spans = [e for e in ev if e.get("ph") == "X"][:60]
        stem = fname[len("example_"):].split("_")[0]
        small = {"displayTimeUnit": "ms", "traceEvents": meta + spans}
        out("trace_summarize", f"{stem}.json", json.dumps(small, separators=(",", ":")))
        # the array form an interrupted run leaves: no closing bracket, a cut event
        text = "[\n" + ",\n".join(json.dumps(e) for e in meta + spans[:20]) + ",\n"
        out("trace_summarize", f"{stem}_unclosed.json", text + '{"ph":"X","name":"fet')
    host = [{"ph": "B", "pid": 1, "tid": 0, "name": "decode step", "ts": 10.0,
             "args": {"step": "0"}},
            {"ph": "E", "pid": 1, "tid": 0, "name": "decode step", "ts": 25.5},
            {"ph": "B", "pid": 1, "tid": 0, "name": "decode step", "ts": 30.0},
            {"ph": "E", "pid": 1, "tid": 0, "name": "decode step", "ts": 41.0}]
    out("trace_summarize", "host_only.json", json.dumps(host))


if __name__ == "__main__":
    configs()
    weights()
    tokenizers()
    torch_pts()
    traces()
    for t in sorted(os.listdir(os.path.join(FUZZ, "seeds"))):
        files = os.listdir(os.path.join(FUZZ, "seeds", t))
        print(f"{t}: {len(files)} seeds")

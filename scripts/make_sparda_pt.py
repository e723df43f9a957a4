"""Writes a small SparDA-style forecast checkpoint for tests/forecast_pt.rs.

SparDA's trainer saves `ckpt-N.pt` with torch.save: a dict whose
`model_state_dict` holds `...layers.{l}.self_attn.q_future_proj.weight` and
layer 0's `q_curr_proj`, beside optimizer state (other tensors). This script
makes one for the tiny preset's shapes ([Hkv*D, d] = [128, 192], L = 2), bf16,
plus the same tensors as safetensors for comparison.

Run with the golden venv (torch): .venv-golden/bin/python scripts/make_sparda_pt.py
"""
import torch
from safetensors.torch import save_file

torch.manual_seed(0)
L, rows, d = 2, 128, 192
sd = {}
for l in range(L):  # a last-layer q_future_proj exists in SparDA's files and is unused
    sd[f"model.layers.{l}.self_attn.q_future_proj.weight"] = torch.randn(rows, d).to(torch.bfloat16)
sd["model.layers.0.self_attn.q_curr_proj.weight"] = torch.randn(rows, d).to(torch.bfloat16)
# a non-contiguous view saved as such (stride != row-major), to exercise strides
base = torch.randn(d, rows).to(torch.bfloat16)
sd["model.layers.0.self_attn.q_curr_proj.weight"] = base.t()
opt = {"state": {0: {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
torch.save({"model_state_dict": sd, "optimizer_state_dict": opt, "step": 3}, "tests/data/sparda_tiny_forecast.pt")
save_file({k: v.contiguous() for k, v in sd.items()}, "tests/data/sparda_tiny_forecast.safetensors")
print("wrote tests/data/sparda_tiny_forecast.{pt,safetensors}")

"""Replacement trap: a module swapped for a vLLM-forward module after the optimizer was built.

Per rank: a bf16 two-layer model and its AdamW; then layer 0 (``nn.Linear``) is replaced by
:class:`VllmDenseLinear` (vLLM's own linear in forward; its master weight is a new parameter).
The identity check, run with a forward, must name the new parameter and the stale optimizer
tensors; before the swap it must find nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megatron_vllm_align.guards import check_optimizer_identity
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
    "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


def run(out: Path) -> dict:
    (out / f"engine_rank{dist.get_rank()}").mkdir()
    model_dir = out / f"engine_rank{dist.get_rank()}"
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    context = vllm_context(EngineSpec(str(model_dir)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    result = {"before": [str(f) for f in check_optimizer_identity(model, optimizer, forward=lambda: model(x))]}
    model[0] = VllmDenseLinear(64, 64, vllm_context=context)
    findings = check_optimizer_identity(model, optimizer, forward=lambda: model(x))
    result["after"] = [{"name": f.name, "kind": f.kind, "reason": f.reason} for f in findings]
    if dist.get_rank() == 0:
        print("[replacement] " + " | ".join(str(f) for f in findings), flush=True)
    return result

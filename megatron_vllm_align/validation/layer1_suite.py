"""The layer-1 suite: every case of the op registry (``ops.registry``) against its independent float64
reference, with the tolerances of its gradient contract, across seeds, token counts and dY kinds.

Token counts: M = 1 (decode), an unaligned M (37) and a prefill-sized M (300) at tiny widths; M = 1 and
37 at real widths (``Widths.real``). Each case x token count x seed returns one ``ComparisonReport``.
:func:`case_contexts` writes the ``config.json`` files of the engines the cases build their modules in.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case
from megatron_vllm_align.utils.quantization_names import Quantization

from .report import ComparisonReport
from .tolerances import contract_tolerances
from .vjp import DY_KINDS, compare_vjp

# The engines' model configurations (config.json only: no weights, no engine started).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 1, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}
TINY_QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
}


def write_model_config(directory: str | os.PathLike, config: dict) -> str:
    """Write ``config`` as ``directory/config.json`` (directory created); returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(path)


def case_contexts(directory: str | os.PathLike, dense_model_dir: str | os.PathLike | None = None) -> CaseContexts:
    """The bf16, FP8 (per-channel) and MoE engine contexts of the layer-1 cases.

    ``dense_model_dir``: a dense model directory to take the bf16 / FP8 engines from (the main job's
    tiny Llama); default a tiny Llama ``config.json`` written under ``directory``. The MoE engine is a
    tiny Qwen3-MoE ``config.json`` written there."""
    from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

    if dense_model_dir:
        dense = str(dense_model_dir)
    else:
        dense = write_model_config(Path(directory) / "dense", TINY_LLAMA_CONFIG)
    moe = write_model_config(Path(directory) / "moe", TINY_QWEN3_MOE_CONFIG)
    return CaseContexts(bf16=vllm_context(EngineSpec(dense)),
                        fp8=vllm_context(EngineSpec(dense, quantization=Quantization.FP8_PER_CHANNEL.value)),
                        moe=vllm_context(EngineSpec(moe)))


def run_layer1_suite(cases: Iterable[Layer1Case], seeds: Iterable[int] = range(5),
                     dy_kinds: Iterable[str] = DY_KINDS) -> list[ComparisonReport]:
    """``compare_vjp`` for every case x token count x seed, each over all ``dy_kinds``."""
    reports = []
    dy_kinds = tuple(dy_kinds)
    seeds = tuple(seeds)
    for case in cases:
        tolerances = contract_tolerances(case.contract, case.variables)
        for m in case.token_counts:
            for seed in seeds:
                candidate, reference, inputs = case.build(seed, m)
                reports.append(compare_vjp(
                    candidate, reference, inputs, tolerances=tolerances, dy_kinds=dy_kinds, seed=seed,
                    declared_unused=case.declared_unused, name=f"{case.name} M={m} seed={seed}",
                    tolerance_reasoning=case.contract.reference.reasoning.strip()))
    return reports

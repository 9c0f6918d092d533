"""Layer-1 cases of ``rms_norm``: the plain norm and the fused residual add."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16
from megatron_vllm_align.ops.rms_norm.module import FusedAddRMSNormFunction, RMSNormFunction, VllmRMSNorm
from megatron_vllm_align.ops.rms_norm.reference import ReferenceRMSNorm

EPS = 1e-6
ITEMS = {"input[0]": "input", "weight": "norm_weight"}
FUSED_ITEMS = {**ITEMS, "input[1]": "residual"}


def rms_norm_builder(context, hidden: int, fused: bool, candidate_cls: type[VllmRMSNorm] = VllmRMSNorm):
    """``build(seed, tokens)``: weight ``1 + 0.3 N(0, 1)``, x (and residual) ``N(0, 1)``, all bf16."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = candidate_cls(hidden, EPS, vllm_context=context)
        with torch.no_grad():
            candidate.weight.copy_((1 + 0.3 * torch.randn(hidden, generator=gen)).bfloat16())
        inputs = [seeded_bf16(gen, tokens, hidden).requires_grad_()]
        if fused:
            inputs.append(seeded_bf16(gen, tokens, hidden).requires_grad_())
        return candidate, ReferenceRMSNorm(candidate.weight, EPS), inputs
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    contract = get_default_contract("rms_norm")
    return [
        Layer1Case(f"rms_norm[hidden={widths.hidden}]", contract, ITEMS,
                   rms_norm_builder(contexts.bf16, widths.hidden, False), RMSNormFunction, widths.token_counts),
        Layer1Case(f"rms_norm[fused_residual, hidden={widths.hidden}]", contract, FUSED_ITEMS,
                   rms_norm_builder(contexts.bf16, widths.hidden, True), FusedAddRMSNormFunction,
                   widths.token_counts),
    ]


OP = Op("rms_norm", ("rms_norm",), cases)

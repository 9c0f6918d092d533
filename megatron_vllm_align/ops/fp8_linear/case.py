"""Layer-1 cases of the FP8 linear: vLLM's W8A8 per-channel linear (``VllmFP8Linear``) with either
dX reference weight, and the contract-configured ``FP8Linear`` under each of the three FP8 contracts.

Input features are unaligned (200 at tiny widths: partial activation groups and weight blocks); output
features stay small where vLLM's CPU FP8 GEMM runs (``torch._scaled_mm`` emulates FP8 on this CPU), with
two block rows, the second partial, for 128x128 weight blocks.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_vllm_align.contracts import GradientContract, get_default_contract
from megatron_vllm_align.ops.fp8_linear.emulated import FP8Linear, FP8LinearConfig, FP8LinearFunction
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear, VllmFP8LinearFunction
from megatron_vllm_align.ops.fp8_linear.reference import FP8_LINEAR_VARIABLES, ReferenceFP8Linear
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seed_parameters, seeded_bf16

CONTRACTS = ("fp8_linear_per_channel", "fp8_linear_per_tensor", "fp8_linear_block128")
TINY_IN_FEATURES = 200
OUT_FEATURES = {"fp8_linear_per_channel": 32, "fp8_linear_per_tensor": 32, "fp8_linear_block128": 160}


def in_features(widths: Widths) -> int:
    """The reduction width: 200 at tiny widths (not a multiple of 128), else the model's hidden."""
    return TINY_IN_FEATURES if widths.hidden == Widths().hidden else widths.hidden


def vllm_fp8_builder(context, contract: GradientContract, dx_weight: str, k: int, n: int):
    """``build(seed, tokens)`` of :class:`VllmFP8Linear` (vLLM's per-channel method), x ``N(0, 1)`` bf16."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = VllmFP8Linear(k, n, bias=True, vllm_context=context, dx_weight=dx_weight)
        seed_parameters(candidate, gen)
        reference = ReferenceFP8Linear.like(candidate, contract, visible=lambda x, w, b: candidate.kernel(x))
        return candidate, reference, [seeded_bf16(gen, tokens, k).requires_grad_()]
    return build


def fp8_linear_builder(contract: GradientContract, k: int, n: int, config: FP8LinearConfig | None = None,
                       candidate_cls: type[FP8Linear] = FP8Linear,
                       static_scales: dict[str, torch.Tensor] | None = None):
    """``build(seed, tokens)`` of :class:`FP8Linear` under ``config`` (default: from ``contract``):
    weight ``0.05 N(0, 1)``, bias ``N(0, 1)``, x ``2 N(0, 1)`` in bf16."""
    config = config or FP8LinearConfig.from_contract(contract, static_scales=static_scales)

    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = candidate_cls(k, n, config=config, dtype=torch.bfloat16)
        with torch.no_grad():
            candidate.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
            candidate.bias.copy_(torch.randn(n, generator=gen))
        reference = ReferenceFP8Linear.like(candidate, contract, static_scales=static_scales)
        return candidate, reference, [(torch.randn(tokens, k, generator=gen) * 2).to(torch.bfloat16).requires_grad_()]
    return build


def with_dx_weight(contract: GradientContract, dx_weight: str) -> GradientContract:
    """``contract`` with its surrogate's ``dx_weight`` replaced."""
    return dataclasses.replace(contract, surrogate=dataclasses.replace(contract.surrogate, dx_weight=dx_weight))


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    k = in_features(widths)
    per_channel = get_default_contract("fp8_linear_per_channel")
    result = []
    for dx_weight in ("dequantized", "master"):
        contract = with_dx_weight(per_channel, dx_weight)
        result.append(Layer1Case(f"fp8_linear_per_channel[vLLM, dx={dx_weight}, K={k}]", contract,
                                 FP8_LINEAR_VARIABLES, vllm_fp8_builder(contexts.fp8, contract, dx_weight, k, 32),
                                 VllmFP8LinearFunction, widths.token_counts))
    for name in CONTRACTS:
        contract = get_default_contract(name)
        result.append(Layer1Case(f"{name}[FP8Linear, K={k}]", contract, FP8_LINEAR_VARIABLES,
                                 fp8_linear_builder(contract, k, OUT_FEATURES[name]), FP8LinearFunction,
                                 widths.token_counts))
    return result


OP = Op("fp8_linear", CONTRACTS, cases)

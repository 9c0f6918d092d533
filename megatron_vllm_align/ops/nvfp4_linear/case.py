"""Layer-1 cases of the NVFP4 linear: vLLM's W4A4 NVFP4 linear (``VllmNVFP4Linear``) with either dX
reference weight, against ``ReferenceNVFP4Linear`` built from the contract (with ``dx_weight``
replaced for the master variant).

Input features: 272 at tiny widths (17 blocks of 16: a multiple of 16, not of 32 or 128), else the
model's hidden. The input scale is fixed at ``g = 2^-10`` (calibrated amax 2.625 = 2688 g, exact in
bf16), below the N(0, 1) activations' range, so about 0.9 % of them lie beyond the clipped STE's
threshold and 18 % between half of it and it. Every row also holds (:func:`threshold_input`) the
threshold itself (+-2.625: derivative 1), its bf16 neighbours below and above, a block whose E2M1
values are exactly the rounding ties 0.25 ... 5 (block amax 1.5: block scale 256, unit 0.25) and,
where K >= 64, a block of zeros.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_vllm_align.contracts import GradientContract, get_default_contract
from megatron_vllm_align.ops.nvfp4_linear.module import CONTRACT_NAME, VllmNVFP4Linear, VllmNVFP4LinearFunction
from megatron_vllm_align.ops.nvfp4_linear.reference import NVFP4_LINEAR_VARIABLES, ReferenceNVFP4Linear
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seed_parameters, seeded_bf16
from megatron_vllm_align.quant.nvfp4 import E2M1_MAX, E4M3_MAX

TINY_IN_FEATURES = 272
INPUT_SCALE = 2.0 ** -10
#: A block (16 values) whose E2M1 values (unit 0.25) are 6 and the ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.
TIE_BLOCK = (1.5, 0.0625, 0.1875, 0.3125, 0.4375, 0.625, 0.875, 1.25,
             0.0, -0.0625, -0.1875, -0.3125, -0.4375, -0.625, -0.875, -1.25)


def in_features(widths: Widths) -> int:
    """The reduction width: 272 at tiny widths, else the model's hidden."""
    return TINY_IN_FEATURES if widths.hidden == Widths().hidden else widths.hidden


def threshold_values(input_scale: float = INPUT_SCALE) -> tuple[float, float, float]:
    """(the clipped STE's threshold 2688 g, its bf16 neighbour below, above); the threshold must be a
    bf16 value."""
    threshold = torch.tensor(E2M1_MAX * E4M3_MAX * input_scale, dtype=torch.float64)
    at = threshold.to(torch.bfloat16)
    if at.double() != threshold:
        raise ValueError(f"2688 * input_scale = {float(threshold)!r} is not a bf16 value")
    below = torch.nextafter(at, torch.tensor(0.0, dtype=torch.bfloat16))
    above = torch.nextafter(at, torch.tensor(float("inf"), dtype=torch.bfloat16))
    return float(at), float(below), float(above)


def threshold_input(gen: torch.Generator, tokens: int, k: int, input_scale: float = INPUT_SCALE) -> torch.Tensor:
    """``[tokens, k]`` bf16: N(0, 1), with the planted values of the module docstring in every row."""
    x = seeded_bf16(gen, tokens, k)
    at, below, above = threshold_values(input_scale)
    x[:, 16:32] = torch.tensor(TIE_BLOCK, dtype=torch.bfloat16)
    if k >= 64:
        x[:, 32:48] = 0.0
    planted = torch.tensor([at, -at, below, -below, above, -above], dtype=torch.bfloat16)
    start = 48 if k >= 64 else 0
    x[:, start:start + planted.numel()] = planted
    return x


def with_dx_weight(contract: GradientContract, dx_weight: str) -> GradientContract:
    """``contract`` with its surrogate's ``dx_weight`` replaced."""
    return dataclasses.replace(contract, surrogate=dataclasses.replace(contract.surrogate, dx_weight=dx_weight))


def nvfp4_linear_builder(context, contract: GradientContract, k: int, n: int, **module_kwargs):
    """``build(seed, tokens)`` of :class:`VllmNVFP4Linear` (``module_kwargs`` passed on, e.g.
    ``dx_weight``), seeded parameters, input scale :data:`INPUT_SCALE`, x from :func:`threshold_input`;
    the reference is the contract's, valued by the candidate's vLLM kernel."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = VllmNVFP4Linear(k, n, bias=True, vllm_context=context, input_scale=INPUT_SCALE, **module_kwargs)
        seed_parameters(candidate, gen)
        reference = ReferenceNVFP4Linear.like(candidate, contract, visible=lambda x, w, b: candidate.kernel(x))
        return candidate, reference, [threshold_input(gen, tokens, k).requires_grad_()]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    k = in_features(widths)
    base = get_default_contract(CONTRACT_NAME)
    result = []
    for dx_weight in ("dequantized", "master"):
        contract = with_dx_weight(base, dx_weight)
        result.append(Layer1Case(f"nvfp4_linear[vLLM emulation, dx={dx_weight}, K={k}]", contract,
                                 NVFP4_LINEAR_VARIABLES,
                                 nvfp4_linear_builder(contexts.bf16, contract, k, widths.linear_out,
                                                      dx_weight=dx_weight),
                                 VllmNVFP4LinearFunction, widths.token_counts))
    return result


OP = Op(CONTRACT_NAME, (CONTRACT_NAME,), cases)

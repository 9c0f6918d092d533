"""The layer-1 suite: every visible module against its independent reference, with the tolerances of
its gradient contract, across seeds, token counts and upstream-gradient kinds.

Token counts: M = 1 (decode), an unaligned M (37) and a prefill-sized M (300); attention packs
several sequences of unaligned lengths. Each case returns one ``ComparisonReport``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from megatron_vllm_align.contracts import GradientContract, get_default_contract

from .references import (
    ReferenceAttention, ReferenceDenseLinear, ReferenceFP8Linear, ReferenceRMSNorm, ReferenceRotary,
    ReferenceSelectedLogprob, ReferenceSiluAndMul,
)
from .report import ComparisonReport
from .tolerances import contract_tolerances
from .vjp import DY_KINDS, compare_vjp

TOKEN_COUNTS = (1, 37, 300)
# Packed sequence lengths per token count for attention (the engine packs prompts the same way).
# A lone one-token sequence is not a case of its own: there dq = dk = 0 exactly (softmax over one
# key), only an absolute bound applies, and the contract's atol = 0 cannot absorb the fp32
# cancellation noise (~1e-7) of dS = P (dP - rowsum(dO O)); one-token sequences are covered inside
# the packed batches, where the global bounds apply. (Open: derive an absolute floor in the contract.)
ATTENTION_PACKING = {37: [1, 7, 29], 300: [1, 16, 283]}
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EPS = 256, 512, 4, 2, 64, 512, 1e-6
FP8_IN, FP8_OUT = 200, 32   # unaligned K; vLLM's CPU FP8 GEMM is slow, so N stays small


@dataclass(frozen=True)
class Layer1Case:
    """One module class in one configuration: ``build(seed, tokens)`` returns
    (candidate, reference, inputs); ``variables`` maps harness items to contract variables."""

    name: str
    contract: GradientContract
    variables: Mapping[str, str]
    build: Callable[[int, int], tuple[nn.Module, nn.Module, list[Any]]]
    token_counts: tuple[int, ...] = TOKEN_COUNTS
    declared_unused: tuple[str, ...] = ()


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


def _copy_params(module: nn.Module, gen: torch.Generator) -> None:
    """Seeded parameter values (bf16), so every seed tests different weights."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(_randn(gen, *p.shape, scale=p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0))
    refresh = getattr(module, "refresh_deployed", None)
    if refresh is not None:
        refresh()


def visible_module_cases(bf16_context: Any, fp8_context: Any) -> list[Layer1Case]:
    """The cases for the dense Llama-style visible modules (``megatron_vllm_align.modules``)."""
    from megatron_vllm_align.modules import (
        VllmRMSNorm, VllmRotaryEmbedding, VllmSelectedLogprob, VllmSiluAndMul,
    )
    from megatron_vllm_align.modules.attention import VllmCausalAttentionFunction
    from megatron_vllm_align.modules.linear import VllmDenseLinear, VllmFP8Linear

    linear_items = {"input[0]": "input", "weight": "master_weight", "bias": "bias"}

    def dense(seed, m):
        gen = torch.Generator().manual_seed(seed)
        cand = VllmDenseLinear(HIDDEN, FFN, bias=True, vllm_context=bf16_context)
        _copy_params(cand, gen)
        return cand, ReferenceDenseLinear(cand.weight, cand.bias), [_randn(gen, m, HIDDEN).requires_grad_()]

    def fp8(dx_weight):
        contract = get_default_contract("fp8_linear_per_channel")
        contract = dataclasses.replace(contract, surrogate=dataclasses.replace(contract.surrogate,
                                                                               dx_weight=dx_weight))

        def build(seed, m):
            gen = torch.Generator().manual_seed(seed)
            cand = VllmFP8Linear(FP8_IN, FP8_OUT, bias=True, vllm_context=fp8_context, dx_weight=dx_weight)
            _copy_params(cand, gen)
            ref = ReferenceFP8Linear.like(cand, contract, visible=lambda x, w, b: cand.kernel(x))
            return cand, ref, [_randn(gen, m, FP8_IN).requires_grad_()]
        return contract, build

    def rms_norm(fused):
        def build(seed, m):
            gen = torch.Generator().manual_seed(seed)
            cand = VllmRMSNorm(HIDDEN, EPS, vllm_context=bf16_context)
            with torch.no_grad():
                cand.weight.copy_((1 + 0.3 * torch.randn(HIDDEN, generator=gen)).bfloat16())
            inputs = [_randn(gen, m, HIDDEN).requires_grad_()]
            if fused:
                inputs.append(_randn(gen, m, HIDDEN).requires_grad_())
            return cand, ReferenceRMSNorm(cand.weight, EPS), inputs
        return build

    def silu(seed, m):
        gen = torch.Generator().manual_seed(seed)
        return VllmSiluAndMul(vllm_context=bf16_context), ReferenceSiluAndMul(), \
            [_randn(gen, m, 2 * FFN, scale=3.0).requires_grad_()]

    def rotary(seed, m):
        gen = torch.Generator().manual_seed(seed)
        cand = VllmRotaryEmbedding(HEAD_DIM, 4096, {"rope_theta": 10000.0}, vllm_context=bf16_context)
        positions = torch.arange(seed, seed + m)
        return cand, ReferenceRotary(cand.kernel.cos_sin_cache, HEAD_DIM), \
            [positions, _randn(gen, m, HEADS * HEAD_DIM).requires_grad_(),
             _randn(gen, m, KV_HEADS * HEAD_DIM).requires_grad_()]

    class PackedAttention(nn.Module):
        def __init__(self, seq_lens):
            super().__init__()
            self.seq_lens = seq_lens

        def forward(self, q, k, v):
            return VllmCausalAttentionFunction.apply(q, k, v, self.seq_lens, HEAD_DIM ** -0.5)

    def attention(seed, m):
        gen = torch.Generator().manual_seed(seed)
        lens = ATTENTION_PACKING[m]
        qkv = [_randn(gen, m, heads, HEAD_DIM).requires_grad_() for heads in (HEADS, KV_HEADS, KV_HEADS)]
        return PackedAttention(lens), ReferenceAttention(lens, HEAD_DIM ** -0.5), qkv

    def logprob(seed, m):
        gen = torch.Generator().manual_seed(seed)
        logits = _randn(gen, m, VOCAB, scale=4.0).requires_grad_()
        targets = torch.randint(0, VOCAB, (m,), generator=gen)
        return VllmSelectedLogprob(), ReferenceSelectedLogprob(), [logits, targets]

    fp8_deq, build_deq = fp8("dequantized")
    fp8_master, build_master = fp8("master")
    return [
        Layer1Case("dense_linear", get_default_contract("dense_linear"), linear_items, dense),
        Layer1Case("fp8_linear_per_channel[dx=dequantized]", fp8_deq, linear_items, build_deq),
        Layer1Case("fp8_linear_per_channel[dx=master]", fp8_master, linear_items, build_master),
        Layer1Case("rms_norm", get_default_contract("rms_norm"), {"input[0]": "input", "weight": "norm_weight"},
                   rms_norm(False)),
        Layer1Case("rms_norm[fused_residual]", get_default_contract("rms_norm"),
                   {"input[0]": "input", "input[1]": "residual", "weight": "norm_weight"}, rms_norm(True)),
        Layer1Case("silu_and_mul", get_default_contract("silu_and_mul"), {"input[0]": "input"}, silu),
        Layer1Case("rotary_embedding", get_default_contract("rotary_embedding"),
                   {"input[1]": "q", "input[2]": "k"}, rotary),
        Layer1Case("attention", get_default_contract("attention"),
                   {"input[0]": "q", "input[1]": "k", "input[2]": "v"}, attention, token_counts=(37, 300)),
        Layer1Case("selected_logprob", get_default_contract("selected_logprob"), {"input[0]": "logits"}, logprob),
    ]


def run_layer1_suite(cases: Iterable[Layer1Case], seeds: Iterable[int] = range(5),
                     dy_kinds: Iterable[str] = DY_KINDS) -> list[ComparisonReport]:
    """``compare_vjp`` for every case x token count x seed, each over all ``dy_kinds``."""
    reports = []
    dy_kinds = tuple(dy_kinds)
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

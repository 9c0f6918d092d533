"""Layer-1 cases of ``output_layer``: packed sequences (the engine's row sets differ per sequence),
a vocabulary the shadow pads, logit_scale 1 and 0.5."""
from __future__ import annotations

import torch
from torch import nn

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel, engine_logit_calls
from megatron_vllm_align.ops.output_layer.module import OutputLogitsFunction
from megatron_vllm_align.ops.output_layer.reference import ReferenceOutputLogits
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seed_parameters, seeded_bf16

PACKING = {1: (1,), 37: (1, 7, 29), 300: (1, 16, 283)}   # sequence lengths per token count
ITEMS = {"input[0]": "hidden", "weight": "output_weight"}


class PackedOutputLogits(nn.Module):
    """``forward(hidden [T, h]) -> logits [T, V]`` = :class:`OutputLogitsFunction` on fixed packed
    ``seq_lens``; owns the output ``weight`` [V, h]; ``refresh_deployed()`` loads it into the shadow."""

    def __init__(self, context, vocab: int, hidden: int, seq_lens: tuple[int, ...], logit_scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=context.model_dtype))
        self.kernel = VllmLMHeadKernel(context, vocab, hidden, logit_scale)
        self.seq_lens = seq_lens

    def refresh_deployed(self) -> None:
        self.kernel.load(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return OutputLogitsFunction.apply(hidden, self.weight, self.kernel, engine_logit_calls(self.seq_lens))


def output_layer_builder(context, hidden: int, vocab: int, logit_scale: float = 1.0):
    """``build(seed, tokens)``: seeded output weight, hidden states ``N(0, 1)`` in bf16, packed as
    :data:`PACKING`."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        candidate = PackedOutputLogits(context, vocab, hidden, PACKING[tokens], logit_scale)
        seed_parameters(candidate, gen)
        return candidate, ReferenceOutputLogits(candidate.weight, logit_scale), \
            [seeded_bf16(gen, tokens, hidden).requires_grad_()]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    contract = get_default_contract("output_layer")
    return [Layer1Case(f"output_layer[vocab={widths.output_vocab}, hidden={widths.hidden}, logit_scale={scale}]",
                       contract, ITEMS, output_layer_builder(contexts.bf16, widths.hidden, widths.output_vocab, scale),
                       OutputLogitsFunction, widths.token_counts)
            for scale in (1.0, 0.5)]


OP = Op("output_layer", ("output_layer",), cases)

"""Layer-1 case of ``selected_logprob``: logits ``4 N(0, 1)`` in bf16, uniform random targets."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16
from megatron_vllm_align.ops.selected_logprob.module import SelectedLogprobFunction, VllmSelectedLogprob
from megatron_vllm_align.ops.selected_logprob.reference import ReferenceSelectedLogprob


def selected_logprob_builder(vocab: int):
    """``build(seed, tokens)``: logits [tokens, vocab] and target IDs [tokens]."""
    def build(seed, tokens):
        gen = torch.Generator().manual_seed(seed)
        logits = seeded_bf16(gen, tokens, vocab, scale=4.0).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), generator=gen)
        return VllmSelectedLogprob(), ReferenceSelectedLogprob(), [logits, targets]
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    return [Layer1Case(f"selected_logprob[vocab={widths.vocab}]", get_default_contract("selected_logprob"),
                       {"input[0]": "logits"}, selected_logprob_builder(widths.vocab), SelectedLogprobFunction,
                       widths.token_counts)]


OP = Op("selected_logprob", ("selected_logprob",), cases)

"""Layer-1 cases of ``processed_logprob``: logits ``2 N(0, 1)`` in bf16, targets drawn from the processed
distribution, at temperature 1.3 with top-p 0.9 and with every filter combined."""
from __future__ import annotations

import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.processed_logprob.kernel import vllm_processed_logprobs
from megatron_vllm_align.ops.processed_logprob.module import ProcessedLogprobFunction, VllmProcessedLogprob
from megatron_vllm_align.ops.processed_logprob.reference import ReferenceProcessedLogprob
from megatron_vllm_align.ops.registry import CaseContexts, Layer1Case, Op, Widths, seeded_bf16

SAMPLING = {"temperature=1.3,top_p=0.9": dict(temperature=1.3, top_p=0.9),
            "combined": dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05)}


def processed_logprob_builder(vocab: int, sampling: dict):
    """``build(seed, tokens)``: logits [tokens, vocab] and target IDs [tokens] inside the support."""
    def build(seed, tokens):
        from vllm import SamplingParams

        params = SamplingParams(**sampling)
        gen = torch.Generator().manual_seed(seed)
        logits = seeded_bf16(gen, tokens, vocab, scale=2.0)
        targets = torch.multinomial(vllm_processed_logprobs(logits, params).exp(), 1, generator=gen)[:, 0]
        return (VllmProcessedLogprob(params), ReferenceProcessedLogprob(params),
                [logits.requires_grad_(), targets])
    return build


def cases(contexts: CaseContexts, widths: Widths) -> list[Layer1Case]:
    return [Layer1Case(f"processed_logprob[{name},vocab={widths.vocab}]", get_default_contract("processed_logprob"),
                       {"input[0]": "logits"}, processed_logprob_builder(widths.vocab, sampling),
                       ProcessedLogprobFunction, widths.token_counts)
            for name, sampling in SAMPLING.items()]


OP = Op("processed_logprob", ("processed_logprob",), cases)

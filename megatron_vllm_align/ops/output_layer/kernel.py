"""The engine's output layer: vLLM's ``LogitsProcessor(lm_head, hidden_states)`` on a shadow of the
master weight, called on the row sets the engine uses.

``lm_head`` is a ``ParallelLMHead`` (vocabulary padded to a multiple of 64 rows with zeros, its
weight processed by ``UnquantizedEmbeddingMethod``, i.e. the same CPU GEMM dispatch as the linear
layers), the GEMM output is bf16 and the padded columns are cut off. :class:`VllmLMHeadKernel`
builds exactly those two vLLM objects (in the engine's config context) as the shadow of the
master weight.

The engine runs that GEMM on particular row sets of one step's hidden states, and GEMM bytes can
depend on the row count M. For prompt logprobs (``GPUModelRunner._get_prompt_logprobs_dict``)
each request's positions ``0..n-2`` form one call; the last position of every request is in one
call for the sampler (M = number of requests): :func:`engine_logit_calls`.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.vllm_context import VllmContext


class VllmLMHeadKernel:
    """Shadow vLLM ``ParallelLMHead(vocab_size, hidden_size)`` + ``LogitsProcessor(vocab_size,
    scale=logit_scale)``; ``kernel(x [M, h]) -> logits [M, vocab_size]`` in the model dtype."""

    def __init__(self, context: VllmContext, vocab_size: int, hidden_size: int, logit_scale: float = 1.0) -> None:
        self.context = context
        self.vocab_size, self.hidden_size, self.logit_scale = vocab_size, hidden_size, logit_scale
        self.lm_head: Any = None
        with context.active(parallel_state=True, building=True):
            from vllm.model_executor.layers.logits_processor import LogitsProcessor

            self.logits_processor: Any = LogitsProcessor(vocab_size, scale=logit_scale)

    def fresh(self) -> VllmLMHeadKernel:
        """An unloaded kernel configured like this one."""
        return VllmLMHeadKernel(self.context, self.vocab_size, self.hidden_size, self.logit_scale)

    def load(self, weight: torch.Tensor) -> None:
        """Rebuild the shadow from master ``weight`` [vocab_size, hidden_size] (cast to the model dtype)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"output weight must be {(self.vocab_size, self.hidden_size)}, got {tuple(weight.shape)}")
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            lm_head = ParallelLMHead(self.vocab_size, self.hidden_size, params_dtype=self.context.model_dtype,
                                     prefix="lm_head")
            lm_head.weight_loader(lm_head.weight, weight.detach().to(self.context.model_dtype))
            lm_head.quant_method.process_weights_after_loading(lm_head)
        self.lm_head = lm_head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("the shadow lm_head has no deployed value yet: call load(weight)")
        if x.dtype != self.context.model_dtype or x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be {self.context.model_dtype} [M, {self.hidden_size}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        with torch.no_grad(), self.context.active(parallel_state=True):
            return self.logits_processor(self.lm_head, x.detach())


def engine_logit_calls(seq_lens: tuple[int, ...]) -> list[torch.Tensor]:
    """Row index sets of the engine's lm_head calls for one prefill step of sequences packed in
    order: per sequence its positions 0..n-2 (prompt logprobs), then all last positions (sampler)."""
    calls, start = [], 0
    for n in seq_lens:
        if n > 1:
            calls.append(torch.arange(start, start + n - 1))
        start += n
    calls.append(torch.tensor([end - 1 for end in torch.tensor(seq_lens).cumsum(0).tolist()]))
    return calls

"""Selected-token logprobs whose forward is vLLM's and whose backward is the log-softmax/gather VJP.

Gradient contract ``selected_logprob`` (case A, docs/method.md#backward-reuse):
- visible forward: :func:`~megatron_vllm_align.ops.selected_logprob.kernel.vllm_selected_logprob`
  (``Sampler.compute_logprobs`` + gather): fp32 logprob [T] of target ids [T] under logits [T, V];
- trainable: the logits; discrete state: the target ids (fixed);
- save: the logits (by reference), the target ids and the fp32 ``lse = logsumexp(logits)``;
- backward, fp32: ``dlogits = g (onehot(target) - p)`` with ``p = exp(z - lse)``; the target's
  entry ``g (1 - p_t)`` is computed as ``g * sum_{j != t} p_j``, which keeps its relative accuracy
  when ``p_t`` rounds to 1 in fp32 (a confident token, where ``1 - p_t`` would cancel to 0).
  Computed in blocks of ``_TOKENS_PER_BLOCK`` tokens (no [T, V] fp32 copy outlives a block), cast
  to the logits' dtype.
  Token masks and loss normalisation belong to the caller and arrive through g.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.selected_logprob.kernel import vllm_selected_logprob

_TOKENS_PER_BLOCK = 1024


class SelectedLogprobFunction(torch.autograd.Function):
    """``apply(logits [T, V], target_ids [T]) -> logprob [T]`` (fp32)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        logprob = vllm_selected_logprob(logits, target_ids)
        lse = torch.logsumexp(logits.detach().float(), dim=-1)
        ctx.save_for_backward(logits, target_ids, lse)
        return logprob

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, target_ids, lse = ctx.saved_tensors
        grad = grad_out.float()
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], _TOKENS_PER_BLOCK):
            rows = slice(start, start + _TOKENS_PER_BLOCK)
            targets, g = target_ids[rows, None], grad[rows, None]
            probs = torch.exp(logits[rows].float() - lse[rows, None]).scatter_(-1, targets, 0.0)
            others = probs.sum(dim=-1, keepdim=True)
            block = probs.mul_(-g).scatter_(-1, targets, others * g)
            grad_logits[rows] = block.to(logits.dtype)
        return grad_logits, None


class VllmSelectedLogprob(nn.Module):
    """``forward(logits [..., V'], target_ids [...]) -> logprob [...]`` (fp32); no parameters.

    ``vocab_size``: the model's real vocabulary; logits columns past it (Megatron's padding)
    are dropped before the softmax, as vLLM drops its own padding. None keeps all columns.
    """

    contract_name = "selected_logprob"

    def __init__(self, vocab_size: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                       or vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
            raise TypeError(f"logits must be a tensor [..., V], got {type(logits).__name__}")
        if self.vocab_size is not None:
            if logits.shape[-1] < self.vocab_size:
                raise ValueError(f"logits has {logits.shape[-1]} columns, fewer than vocab_size {self.vocab_size}")
            logits = logits[..., : self.vocab_size]
        if not isinstance(target_ids, torch.Tensor) or tuple(target_ids.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"target_ids must have shape {tuple(logits.shape[:-1])} (the logits' leading dims), "
                             f"got {tuple(getattr(target_ids, 'shape', ()))}")
        flat = SelectedLogprobFunction.apply(logits.reshape(-1, logits.shape[-1]), target_ids.reshape(-1))
        return flat.reshape(target_ids.shape)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}"

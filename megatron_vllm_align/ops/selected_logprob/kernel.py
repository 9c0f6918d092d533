"""Selected-token logprobs exactly as vLLM computes prompt logprobs, and their native reference.

vLLM V1 (``GPUModelRunner._get_prompt_logprobs_dict``, which the CPU runner inherits): the
logits of the prompt positions (``LogitsProcessor``: LM head output, no scale or soft cap for
Llama / Qwen, padded vocabulary cut off) go through ``Sampler.compute_logprobs`` =
``logits.log_softmax(dim=-1, dtype=torch.float32)`` (logprobs mode ``raw_logprobs``, no
temperature), then ``Sampler.gather_logprobs`` takes ``logprobs.gather(-1, token_ids)``.
:func:`vllm_selected_logprob` calls vLLM's ``compute_logprobs`` and the same gather (the top-k
and rank parts of ``gather_logprobs`` do not change the selected value).

Native reference: :func:`selected_logprob_native`, ``z[y] - logsumexp(z)`` with z the fp32 logits.
Both are fp32 from the same values; they differ only in the order of fp32 operations:
``|visible - native| <= 8 * 2^-24 * (max|z| + |lse|)`` per token (a handful of fp32 roundings
of quantities of that size).
"""
from __future__ import annotations

import torch


def check_logprob_inputs(logits: torch.Tensor, target_ids: torch.Tensor) -> None:
    """Raise a clear error unless logits [T, V] (float) and target_ids [T] int64 in [0, V)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise TypeError(f"logits must be a floating tensor [T, V], got "
                        f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}")
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"logits must not be empty, got shape {tuple(logits.shape)}")
    if not isinstance(target_ids, torch.Tensor) or target_ids.dtype != torch.int64 or target_ids.dim() != 1:
        raise TypeError(f"target_ids must be a 1-D int64 tensor [T], got "
                        f"{getattr(target_ids, 'dtype', type(target_ids))} {tuple(getattr(target_ids, 'shape', ()))}")
    if target_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"target_ids has {target_ids.shape[0]} tokens but logits has {logits.shape[0]}")
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= logits.shape[1]:
        raise ValueError(f"target_ids must lie in [0, {logits.shape[1]}) (the vocabulary), got [{low}, {high}]")


def vllm_selected_logprob(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logprob [T] of ``target_ids`` under ``logits`` [T, V], by vLLM's sampler."""
    from vllm.v1.sample.sampler import Sampler

    check_logprob_inputs(logits, target_ids)
    with torch.no_grad():
        logprobs = Sampler.compute_logprobs(logits.detach())
        return logprobs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def selected_logprob_native(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """``z[t, y_t] - logsumexp(z[t])`` with ``z = logits.float()``; fp32 [T]."""
    z = logits.float()
    return z.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)

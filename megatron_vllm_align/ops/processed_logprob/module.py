"""Processed logprobs of selected tokens: vLLM's sampler steps forward, a closed-form backward.

Gradient contract (docs/sampling.md#the-gradient; docs/method.md#backward-reuse: only rounding differs):
- visible forward: :func:`~megatron_vllm_align.ops.processed_logprob.kernel.vllm_processed_logprobs`
  gathered at the targets: the fp32 logprob of each target under the engine's processed distribution
  (temperature, min-p, top-k, top-p, renormalised over the kept support S), once per row segment with
  that segment's ``vllm.SamplingParams``;
- trainable: the logits; discrete state: the target ids and the support S (fixed, as rounding is);
- save: the logits (by reference) and the target ids; nothing of size [T, V] beyond the logits;
- backward (:func:`~megatron_vllm_align.ops.processed_logprob.vjp.processed_logprob_vjp`), fp32, per
  block of rows (as ``selected_logprob``): the processed logprobs are recomputed by the same vLLM
  steps, ``p = exp(processed)`` (0 off S), ``dlogits = (g / T) (onehot(target) - p)`` on S and 0 off S,
  the target's entry ``(g / T) sum_{j in S, j != t} p_j`` (no cancellation when ``p_t`` rounds to 1);
  cast to the logits' dtype. Token masks and loss normalisation arrive through g.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.processed_logprob.kernel import check_sampling_params, vllm_processed_selected_logprob
from megatron_vllm_align.ops.processed_logprob.vjp import processed_logprob_vjp
from megatron_vllm_align.ops.selected_logprob.module import _check_inputs, _check_vocab_size, _segments


class ProcessedLogprobFunction(torch.autograd.Function):
    """``apply(logits [T, V'], target_ids [T], params, vocab_size=None, segments=None,
    outside_support="raise") -> logprob [R]`` (fp32): the processed logprobs of rows ``start:stop`` of
    each segment (None: all rows) over the first ``vocab_size`` columns (None: all) under ``params[i]``
    for segment i (a tuple of checked ``vllm.SamplingParams``, one per segment), concatenated in segment
    order (R rows in all); a target outside the support raises, or with ``"neg_inf"`` gives -inf and a
    zero gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target_ids: torch.Tensor, params: tuple,
                vocab_size: int | None = None, segments: Sequence[tuple[int, int]] | None = None,
                outside_support: str = "raise") -> torch.Tensor:
        vocab = logits.shape[-1] if vocab_size is None else vocab_size
        ctx.segments = _segments(logits.shape[0], segments)
        if len(params) != len(ctx.segments):
            raise ValueError(f"need one SamplingParams per segment, got {len(params)} for {len(ctx.segments)}")
        ctx.vocab, ctx.params = vocab, tuple(params)
        out = [vllm_processed_selected_logprob(logits[start:stop, :vocab], target_ids[start:stop], sampling,
                                               outside_support)
               for (start, stop), sampling in zip(ctx.segments, ctx.params)]
        out = out[0] if len(out) == 1 else torch.cat(out)
        ctx.save_for_backward(logits, target_ids, torch.isneginf(out))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, target_ids, outside = ctx.saved_tensors
        grad_out = grad_out.masked_fill(outside, 0.0)   # log 0 is a constant: no gradient
        grad = processed_logprob_vjp(grad_out, logits, target_ids, ctx.vocab, ctx.segments, ctx.params)
        return grad, None, None, None, None, None


class VllmProcessedLogprob(nn.Module):
    """``forward(logits [..., V'], target_ids [...]) -> logprob [...]`` (fp32): the targets' logprobs
    under the distribution the engine samples from with ``sampling_params`` (a ``vllm.SamplingParams``,
    the one object that also configures the engine; refused fields: ``check_sampling_params``).
    ``vocab_size``: the model's real vocabulary (columns past it are dropped and get a zero gradient).
    ``outside_support``: a target outside the kept support raises (``"raise"``) or gets -inf and a zero
    gradient (``"neg_inf"``).
    :meth:`packed` takes several row segments of one logits tensor, each with its own parameters."""

    contract_name = "processed_logprob"

    def __init__(self, sampling_params, vocab_size: int | None = None, outside_support: str = "raise") -> None:
        super().__init__()
        check_sampling_params(sampling_params)
        _check_vocab_size(vocab_size)
        if outside_support not in ("raise", "neg_inf"):
            raise ValueError(f"outside_support must be 'raise' or 'neg_inf', got {outside_support!r}")
        self.sampling_params, self.vocab_size, self.outside_support = sampling_params, vocab_size, outside_support

    def forward(self, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        _check_inputs(logits, target_ids, self.vocab_size)
        flat = ProcessedLogprobFunction.apply(logits.reshape(-1, logits.shape[-1]), target_ids.reshape(-1),
                                              (self.sampling_params,), self.vocab_size, None, self.outside_support)
        return flat.reshape(target_ids.shape)

    def packed(self, logits: torch.Tensor, target_ids: torch.Tensor, segments: Sequence[tuple[int, int]],
               sampling_params: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """Per segment ``(start, stop)`` the fp32 processed logprobs [stop - start] of
        ``target_ids[start:stop]`` under ``logits[start:stop]`` (logits [T, V'], target_ids int64 [T])
        and ``sampling_params[i]`` (one ``vllm.SamplingParams`` per segment; None: this module's for
        all). One gradient tensor [T, V'] for all segments."""
        _check_inputs(logits, target_ids, self.vocab_size, packed=True)
        segments = _segments(logits.shape[0], segments)
        params = (self.sampling_params,) * len(segments) if sampling_params is None else tuple(sampling_params)
        for sampling in params:
            check_sampling_params(sampling)
        flat = ProcessedLogprobFunction.apply(logits, target_ids, params, self.vocab_size, segments,
                                              self.outside_support)
        return list(flat.split([stop - start for start, stop in segments]))

    def extra_repr(self) -> str:
        return f"sampling_params={self.sampling_params!r}, vocab_size={self.vocab_size}"

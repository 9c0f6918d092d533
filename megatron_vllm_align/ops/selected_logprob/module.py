"""Selected-token logprobs whose forward is vLLM's and whose backward is the log-softmax/gather VJP.

Gradient contract ``selected_logprob`` (docs/method.md#backward-reuse: only rounding differs):
- visible forward: :func:`~megatron_vllm_align.ops.selected_logprob.kernel.vllm_selected_logprob`
  (``Sampler.compute_logprobs`` + gather): fp32 logprob of target ids under logits [T, V], called
  once per row segment (the engine's call per request in a packed step);
- trainable: the logits; discrete state: the target ids (fixed);
- save: the logits (by reference) and the target ids; nothing of size [T, V] beyond the logits;
- backward (:func:`~megatron_vllm_align.ops.selected_logprob.vjp.selected_logprob_vjp`), fp32, per block
  of rows: ``p = softmax(z)`` recomputed from the logits (torch's fused
  softmax with an fp32 result), ``dlogits = g (onehot(target) - p)``; the target's entry ``g (1 - p_t)``
  is computed as ``g * sum_{j != t} p_j``, which keeps its relative accuracy when ``p_t`` rounds to
  1 in fp32 (a confident token, where ``1 - p_t`` would cancel to 0). A block holds about
  ``_BLOCK_ELEMENTS`` fp32 values (a few rows at a 150k vocabulary; at most ``_TOKENS_PER_BLOCK``
  rows), so no fp32 copy of [T, V] exists and each block's temporaries stay small; each block is
  cast to the logits' dtype into the one gradient tensor [T, V'] (rows outside every segment and
  columns past the vocabulary get 0). Token masks and loss normalisation arrive through g.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.selected_logprob.kernel import vllm_selected_logprob
from megatron_vllm_align.ops.selected_logprob.vjp import selected_logprob_vjp


def _segments(rows: int, segments: Sequence[tuple[int, int]] | None) -> tuple[tuple[int, int], ...]:
    """``segments`` checked (ordered, disjoint, non-empty ranges inside [0, rows)); None: all rows."""
    if segments is None:
        return ((0, rows),)
    checked, previous_stop = [], 0
    for start, stop in segments:
        if not previous_stop <= start < stop <= rows:
            raise ValueError(f"segments must be ordered, disjoint, non-empty row ranges inside [0, {rows}), "
                             f"got {tuple(segments)}")
        checked.append((int(start), int(stop)))
        previous_stop = stop
    return tuple(checked)


class SelectedLogprobFunction(torch.autograd.Function):
    """``apply(logits [T, V'], target_ids [T], vocab_size=None, segments=None) -> logprob [R]`` (fp32):
    the logprobs of rows ``start:stop`` of each segment (None: all rows) over the first
    ``vocab_size`` columns (None: all), concatenated in segment order (R rows in all)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int | None = None,
                segments: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
        vocab = logits.shape[-1] if vocab_size is None else vocab_size
        ctx.segments = _segments(logits.shape[0], segments)
        ctx.vocab = vocab
        out = [vllm_selected_logprob(logits[start:stop, :vocab], target_ids[start:stop])
               for start, stop in ctx.segments]
        ctx.save_for_backward(logits, target_ids)
        return out[0] if len(out) == 1 else torch.cat(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, target_ids = ctx.saved_tensors
        return selected_logprob_vjp(grad_out, logits, target_ids, ctx.vocab, ctx.segments), None, None, None


def _check_vocab_size(vocab_size: int | None) -> None:
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")


def _check_inputs(logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int | None,
                  packed: bool = False) -> None:
    """TypeError / ValueError unless ``logits`` is a tensor [..., V'] with V' >= ``vocab_size`` and
    ``target_ids`` a tensor of the logits' leading shape (``packed``: logits [T, V'], target_ids [T])."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise TypeError(f"logits must be a tensor [..., V], got {type(logits).__name__}")
    if vocab_size is not None and logits.shape[-1] < vocab_size:
        raise ValueError(f"logits has {logits.shape[-1]} columns, fewer than vocab_size {vocab_size}")
    shape = tuple(getattr(target_ids, "shape", ()))
    if packed and (logits.dim() != 2 or not isinstance(target_ids, torch.Tensor) or shape != logits.shape[:1]):
        raise ValueError(f"packed needs logits [T, V] and target_ids [T], got {tuple(logits.shape)} and {shape}")
    if not isinstance(target_ids, torch.Tensor) or shape != tuple(logits.shape[:-1]):
        raise ValueError(f"target_ids must have shape {tuple(logits.shape[:-1])} (the logits' leading dims), "
                         f"got {shape}")


class VllmSelectedLogprob(nn.Module):
    """``forward(logits [..., V'], target_ids [...]) -> logprob [...]`` (fp32); no parameters.

    ``vocab_size``: the model's real vocabulary; logits columns past it (Megatron's padding)
    are dropped before the softmax, as vLLM drops its own padding (and get a zero gradient).
    None keeps all columns. :meth:`packed` takes the logprobs of several row segments of one
    logits tensor (a packed step), with one gradient tensor for all of them.
    """

    contract_name = "selected_logprob"

    def __init__(self, vocab_size: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        _check_vocab_size(vocab_size)
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        _check_inputs(logits, target_ids, self.vocab_size)
        flat = SelectedLogprobFunction.apply(logits.reshape(-1, logits.shape[-1]), target_ids.reshape(-1),
                                             self.vocab_size)
        return flat.reshape(target_ids.shape)

    def packed(self, logits: torch.Tensor, target_ids: torch.Tensor, segments: Sequence[tuple[int, int]]
               ) -> list[torch.Tensor]:
        """Per segment ``(start, stop)`` the fp32 logprobs [stop - start] of ``target_ids[start:stop]``
        under ``logits[start:stop]`` (logits [T, V'], target_ids int64 [T]; rows outside the segments
        are not read). The forward calls vLLM's sampler once per segment, as the engine does per
        request; the backward writes one gradient [T, V'] (no per-segment copy of the logits)."""
        _check_inputs(logits, target_ids, self.vocab_size, packed=True)
        segments = _segments(logits.shape[0], segments)
        flat = SelectedLogprobFunction.apply(logits, target_ids, self.vocab_size, segments)
        return list(flat.split([stop - start for start, stop in segments]))

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}"

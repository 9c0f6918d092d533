"""The selected-token logprob backward (contract ``selected_logprob``; the formula and the blocking are
in the module docstring of :mod:`megatron_vllm_align.ops.selected_logprob.module`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_TOKENS_PER_BLOCK = 1024
_BLOCK_ELEMENTS = 1 << 22


def selected_logprob_vjp(grad_out: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor, vocab: int,
                         segments: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """d logits [T, V'] (the logits' dtype) of the fp32 logprobs [R] of ``target_ids`` under the first
    ``vocab`` columns of ``logits``, on the checked row ``segments`` (R rows in all, in segment order);
    rows outside every segment and columns past ``vocab`` get 0."""
    return blocked_logprob_vjp(grad_out, logits, target_ids, vocab, segments,
                               lambda segment, block: torch.softmax(block, dim=-1, dtype=torch.float32))


def blocked_logprob_vjp(grad_out: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor, vocab: int,
                        segments: tuple[tuple[int, int], ...],
                        probabilities: Callable[[int, torch.Tensor], torch.Tensor],
                        temperatures: Sequence[float] | None = None) -> torch.Tensor:
    """The shared blocked backward ``dlogits = (g / T_i) (onehot(target) - p)`` of a selected-token
    logprob, per block of rows of segment ``i``: ``probabilities(i, logits_block [rows, vocab])`` gives
    the fp32 probabilities ``p`` of that segment's distribution (0 off its support, which so gets 0),
    ``temperatures[i]`` divides g (None: no division). The target's entry is ``(g / T_i) sum_{j != t}
    p_j``. Returns one tensor [T, V'] in the logits' dtype; rows outside every segment and columns
    past ``vocab`` get 0."""
    grad = grad_out.float()
    grad_logits = torch.empty_like(logits)
    if vocab < logits.shape[1]:
        grad_logits[:, vocab:] = 0
    block_rows = min(_TOKENS_PER_BLOCK, max(1, _BLOCK_ELEMENTS // vocab))
    covered, done = 0, 0
    for segment, (start, stop) in enumerate(segments):
        grad_logits[covered:start, :vocab] = 0
        divisor = None if temperatures is None else torch.tensor(temperatures[segment], dtype=torch.float32)
        for first in range(start, stop, block_rows):
            last = min(first + block_rows, stop)
            targets = target_ids[first:last, None]
            g = grad[done + first - start:done + last - start, None]
            if divisor is not None:
                g = g / divisor
            probs = probabilities(segment, logits[first:last, :vocab])
            probs.scatter_(-1, targets, 0.0)
            others = probs.sum(dim=-1, keepdim=True)
            grad_logits[first:last, :vocab] = probs.mul_(-g).scatter_(-1, targets, others * g)
        done += stop - start
        covered = stop
    grad_logits[covered:, :vocab] = 0
    return grad_logits

"""The processed-logprob backward (contract in the module docstring of
:mod:`megatron_vllm_align.ops.processed_logprob.module`)."""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.processed_logprob.kernel import vllm_processed_logprobs

_TOKENS_PER_BLOCK = 1024
_BLOCK_ELEMENTS = 1 << 22


def processed_logprob_vjp(grad_out: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor, vocab: int,
                          segments: tuple[tuple[int, int], ...], params: tuple) -> torch.Tensor:
    """d logits [T, V'] (the logits' dtype) of the fp32 processed logprobs [R] of ``target_ids`` under the
    first ``vocab`` columns of ``logits``, segment ``i`` of the checked row ``segments`` under
    ``params[i]`` (R rows in all, in segment order); rows outside every segment, columns past
    ``vocab`` and the entries masked by top-k/top-p/min-p get 0."""
    grad = grad_out.float()
    grad_logits = torch.empty_like(logits)
    if vocab < logits.shape[1]:
        grad_logits[:, vocab:] = 0
    block_rows = min(_TOKENS_PER_BLOCK, max(1, _BLOCK_ELEMENTS // vocab))
    covered, done = 0, 0
    for (start, stop), sampling in zip(segments, params):
        grad_logits[covered:start, :vocab] = 0
        temperature = torch.tensor(sampling.temperature, dtype=torch.float32)
        for first in range(start, stop, block_rows):
            last = min(first + block_rows, stop)
            targets = target_ids[first:last, None]
            g = grad[done + first - start:done + last - start, None] / temperature
            probs = vllm_processed_logprobs(logits[first:last, :vocab], sampling).exp_()  # 0 where masked
            probs.scatter_(-1, targets, 0.0)
            others = probs.sum(dim=-1, keepdim=True)
            grad_logits[first:last, :vocab] = probs.mul_(-g).scatter_(-1, targets, others * g)
        done += stop - start
        covered = stop
    grad_logits[covered:, :vocab] = 0
    return grad_logits

"""The processed-logprob backward (contract in the module docstring of
:mod:`megatron_vllm_align.ops.processed_logprob.module`)."""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.processed_logprob.kernel import vllm_processed_logprobs
from megatron_vllm_align.ops.selected_logprob.vjp import blocked_logprob_vjp


def processed_logprob_vjp(grad_out: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor, vocab: int,
                          segments: tuple[tuple[int, int], ...], params: tuple) -> torch.Tensor:
    """d logits [T, V'] (the logits' dtype) of the fp32 processed logprobs [R] of ``target_ids`` under the
    first ``vocab`` columns of ``logits``, segment ``i`` of the checked row ``segments`` under
    ``params[i]`` (R rows in all, in segment order); rows outside every segment, columns past
    ``vocab`` and the entries masked by top-k/top-p/min-p get 0."""
    return blocked_logprob_vjp(grad_out, logits, target_ids, vocab, segments,
                               lambda segment, block: vllm_processed_logprobs(block, params[segment]).exp_(),
                               [sampling.temperature for sampling in params])

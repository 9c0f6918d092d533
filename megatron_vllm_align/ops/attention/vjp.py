"""The attention backward (contract ``attention``, case A; the module docstring of
:mod:`megatron_vllm_align.ops.attention.module` states the contract): the training library's SDPA
recomputed in fp32 from the saved q, k, v and differentiated by its own backward kernel."""
from __future__ import annotations

import itertools

import torch

_FLASH_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def training_attention_vjp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           grad_output: torch.Tensor, seq_lens: tuple[int, ...], scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of packed causal GQA attention at (q, k, v) for upstream ``grad_output``.

    The values of autograd through fp32 ``F.scaled_dot_product_attention(is_causal=True,
    scale=scale, enable_gqa=True)`` per sequence, cast to the dtypes of q, k, v: on CPU that
    autograd runs PyTorch's flash kernel forward (for its log-sum-exp) and that kernel's backward,
    which take GQA natively; they are called here directly, once per run of consecutive sequences
    of equal length stacked as a batch (the kernel computes each batch row and head on its own, so
    the bits are those of one call per sequence; tests/ops/attention/test_attention_module.py).
    Shapes as in ``vllm_prefill_attention`` (CPU tensors).
    """
    q32, k32, v32, grad32 = (t.detach().float() for t in (q, k, v, grad_output))
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    start = 0
    for n, run in itertools.groupby(seq_lens):
        rows = slice(start, start + n * len(list(run)))
        # [b * n, heads, D] -> [b, heads, n, D] views
        qi, ki, vi, gi = (t[rows].unflatten(0, (-1, n)).transpose(1, 2) for t in (q32, k32, v32, grad32))
        out, log_sum_exp = _FLASH_FORWARD(qi, ki, vi, is_causal=True, scale=scale)
        per_run = _FLASH_BACKWARD(gi, qi, ki, vi, out, log_sum_exp, 0.0, True, scale=scale)
        for grad, part in zip(grads, per_run):
            grad[rows].unflatten(0, (-1, n)).copy_(part.transpose(1, 2))
        start = rows.stop
    return grads

"""The output layer's backward (contract ``output_layer``; module docstring of
:mod:`megatron_vllm_align.ops.output_layer.module`): dY scaled by ``logit_scale``, then the reused
linear VJP over all rows."""
from __future__ import annotations

import torch

from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp


def output_layer_vjp(grad_logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     model_dtype: torch.dtype, logit_scale: float, needs: tuple[bool, bool]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d hidden in hidden's dtype, d weight in weight's dtype) for d logits [T, V]; ``needs`` says which.

    ``d(scale z) = scale dz`` in fp32, rounded once to the GEMMs' dtype; dX uses the master weight
    cast to ``model_dtype`` (the values the shadow packed)."""
    if logit_scale != 1.0:
        grad_logits = (grad_logits.float() * logit_scale).to(hidden.dtype)
    grad_hidden, grad_weight, _ = linear_vjp(grad_logits, hidden, weight.detach().to(model_dtype), None,
                                             hidden.dtype, weight.dtype, (*needs, False))
    return grad_hidden, grad_weight

"""The output layer's autograd function: vLLM's logits forward on the engine's row sets, one
linear backward (Megatron's local one, reused).

:class:`OutputLogitsFunction` runs the lm_head calls it is given (row index sets covering every row once:
:func:`~.kernel.engine_logit_calls` of the packed sequence lengths for a whole step) and writes every row's
logits. Its backward
(:func:`~.vjp.output_layer_vjp`) is one linear VJP over all rows (``linear_vjp``: Megatron's local
linear backward, GEMMs in the model dtype, dX from the master weight cast to the model dtype, the values
the shadow packed; no fp32 copy of the [vocab, hidden] dW), dY multiplied by ``logit_scale`` in fp32 and
rounded once to the model dtype first; contract ``output_layer``. The Megatron drop-in that owns the
weight and the packing is ``megatron.vllm_output.VllmOutputLayer``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel
from megatron_vllm_align.ops.output_layer.vjp import output_layer_vjp


class OutputLogitsFunction(torch.autograd.Function):
    """``apply(hidden [T, h], weight [V, h], kernel, calls) -> logits [T, V]``: vLLM's lm_head on each
    row set of ``calls`` (int tensors covering rows 0..T-1 once; module docstring), Megatron's linear
    backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, kernel: VllmLMHeadKernel,
                calls: Sequence[torch.Tensor]) -> torch.Tensor:
        logits = hidden.new_empty(hidden.shape[0], kernel.vocab_size)
        for rows in calls:
            logits[rows] = kernel(hidden[rows])
        ctx.save_for_backward(hidden, weight)
        ctx.model_dtype = kernel.context.model_dtype
        ctx.logit_scale = kernel.logit_scale
        return logits

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight = ctx.saved_tensors
        grad_hidden, grad_weight = output_layer_vjp(grad_logits, hidden, weight, ctx.model_dtype, ctx.logit_scale,
                                                    (ctx.needs_input_grad[0], ctx.needs_input_grad[1]))
        return grad_hidden, grad_weight, None, None

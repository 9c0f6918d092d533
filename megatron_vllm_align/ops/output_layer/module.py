"""The output layer's autograd function: vLLM's logits forward on the engine's row sets, one
linear backward (Megatron's local one, reused).

:class:`OutputLogitsFunction` runs the calls of :func:`~.kernel.engine_logit_calls` for the packed
sequence lengths it is given and writes every position's logits. Its backward
(:func:`~.vjp.output_layer_vjp`) is one linear VJP over all rows (``linear_vjp``: Megatron's local
linear backward, GEMMs in the model dtype, dX from the master weight cast to the model dtype, the values
the shadow packed; no fp32 copy of the [vocab, hidden] dW), dY multiplied by ``logit_scale`` in fp32 and
rounded once to the model dtype first; contract ``output_layer``. The Megatron drop-in that owns the
weight and the packing is ``megatron.vllm_output.VllmOutputLayer``.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel, engine_logit_calls
from megatron_vllm_align.ops.output_layer.vjp import output_layer_vjp


class OutputLogitsFunction(torch.autograd.Function):
    """``apply(hidden [T, h], weight [V, h], kernel, seq_lens) -> logits [T, V]``: vLLM's
    lm_head calls on the engine's row sets (module docstring), Megatron's linear backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, kernel: VllmLMHeadKernel,
                seq_lens: tuple[int, ...]) -> torch.Tensor:
        logits = hidden.new_empty(hidden.shape[0], kernel.vocab_size)
        for rows in engine_logit_calls(seq_lens):
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

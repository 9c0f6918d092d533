"""Rotary position embedding whose forward is vLLM's and whose backward is the transposed rotation.

Gradient contract ``rotary_embedding`` (case A, docs/method.md#backward-reuse):
- visible forward: :class:`~megatron_vllm_align.ops.rotary_embedding.kernel.VllmRotaryKernel` (vLLM's
  ``get_rope`` layer, neox style) on q / k [T, H*D] (or [T, H, D]) at absolute positions [T];
- trainable: q and k; discrete state: the positions (fixed, not differentiated); the cos/sin
  cache is a constant vLLM buffer;
- save: the positions; cos and sin are gathered again from the same cache (the rounded values
  the forward used), never recomputed;
- backward (:func:`~megatron_vllm_align.ops.rotary_embedding.vjp.rotary_embedding_vjp`): the rotation
  is linear in its input, so its VJP is the transpose (the inverse
  rotation, sin -> -sin) applied to dY in fp32: ``dx1 = dy1 cos + dy2 sin``,
  ``dx2 = dy2 cos - dy1 sin``; features past rotary_dim copy dY; cast once to the input dtype.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.rotary_embedding.kernel import VllmRotaryKernel
from megatron_vllm_align.ops.rotary_embedding.vjp import rotary_embedding_vjp
from megatron_vllm_align.ops.vllm_context import VllmContext


class RotaryFunction(torch.autograd.Function):
    """``apply(positions, x, kernel) -> x rotated``; x is q or k ([T, H*D] or [T, H, D])."""

    @staticmethod
    def forward(ctx: Any, positions: torch.Tensor, x: torch.Tensor, kernel: VllmRotaryKernel) -> torch.Tensor:
        out, _ = kernel(positions, x, None)
        ctx.save_for_backward(positions)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (positions,) = ctx.saved_tensors
        kernel: VllmRotaryKernel = ctx.kernel
        return None, rotary_embedding_vjp(grad_out, positions, kernel.cos_sin_cache, kernel.head_size,
                                          kernel.rotary_dim), None


class VllmRotaryEmbedding(nn.Module):
    """``forward(positions [T], q, k=None) -> (q_rot, k_rot)``; no parameters.

    Built by vLLM's ``get_rope(head_size, max_position, is_neox_style=True, rope_parameters)``
    in the engine's context (``rope_parameters`` as in the HF config, e.g. ``{"rope_theta": ...,
    "rope_type": "llama3", ...}``). The vLLM layer is the plain attribute ``kernel``.
    """

    contract_name = "rotary_embedding"

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any] | None = None,
                 *, vllm_context: VllmContext, **kwargs: Any) -> None:
        super().__init__()
        self.kernel = VllmRotaryKernel(vllm_context, head_size, max_position, rope_parameters)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_rot = RotaryFunction.apply(positions, q, self.kernel)
        return q_rot, None if k is None else RotaryFunction.apply(positions, k, self.kernel)

    def extra_repr(self) -> str:
        return (f"head_size={self.kernel.head_size}, rotary_dim={self.kernel.rotary_dim}, "
                f"max_position={self.kernel.max_position}")

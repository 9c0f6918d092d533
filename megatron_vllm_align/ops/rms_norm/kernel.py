"""RMSNorm (and the fused residual add) exactly as the vLLM engine runs it, and its native reference.

Visible: :class:`VllmRMSNormKernel` calls vLLM's own ``RMSNorm`` layer, built and run in the engine's
config context with the deployed weight bound per call; vLLM routes it through its IR ops ``rms_norm`` /
``fused_add_rms_norm`` with the engine's provider priority, so the layer, not a chosen kernel, decides
the arithmetic (on a GPU the same code runs vLLM's CUDA kernel). Native reference
:func:`rms_norm_native`: the formula in fp32 rounded once. Bound, elementwise: ``|visible - native| <=
3 u |native|`` (``u`` = 2^-8 for bf16; the CPU provider rounds the normalised value and the product);
the residual sum of the fused path is the same fp32 add and cast on both sides, bitwise. Which provider
the CPU engine resolves and its arithmetic: docs/engine_facts.md#op-by-op-bitwise-facts-on-the-engines-tensors.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.vllm_context import VllmContext


def check_norm_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                      dtype: torch.dtype) -> None:
    """Raise a clear error unless x [..., H], weight [H] and residual (like x) are ``dtype``."""
    for name, tensor in (("x", x), ("weight", weight), ("residual", residual)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} (the engine's dtype), got {tensor.dtype}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x must be [..., H] with H = weight size {tuple(weight.shape)}, got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")


class VllmRMSNormKernel:
    """vLLM's ``RMSNorm(hidden_size, eps)`` layer in the engine's context; no trainable state.

    ``kernel(x, weight)`` -> y; ``kernel(x, weight, residual)`` -> (y, x + residual). Inputs are
    never modified (vLLM's fused path may work in place, so it gets copies). All tensors must be
    the engine's model dtype.
    """

    def __init__(self, context: VllmContext, hidden_size: int, eps: float) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm

        self.context = context
        self.hidden_size = hidden_size
        self.eps = eps
        with context.active(building=True):
            self.layer: Any = RMSNorm(hidden_size, eps=eps, dtype=context.model_dtype)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        check_norm_inputs(x, weight, residual, self.context.model_dtype)
        self.layer.weight.data = weight.detach()
        with torch.no_grad(), self.context.active():
            if residual is None:
                return self.layer(x.detach())
            normed, new_residual = self.layer(x.detach().clone(), residual.detach().clone())
            return normed, new_residual


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, one cast to x's dtype.

    With ``residual``: ``s = x + residual`` in fp32; returns (norm(s) * weight, s cast to x's dtype).
    """
    total = x.float() if residual is None else x.float() + residual.float()
    normed = total * torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    if residual is None:
        return normed.to(x.dtype)
    return normed.to(x.dtype), total.to(x.dtype)

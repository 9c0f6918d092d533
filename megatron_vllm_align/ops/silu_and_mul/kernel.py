"""SiLU-and-mul (SwiGLU gate) exactly as the vLLM engine runs it, and its native reference.

Layout (vLLM's ``SiluAndMul``): x [..., 2d] = [gate | up] along the last dimension (gate first, as
vLLM's merged ``gate_up_proj`` writes it); y [..., d] = silu(gate) * up. Visible:
:class:`VllmSiluAndMulKernel` calls vLLM's own ``SiluAndMul`` layer built in the engine's config
context; the layer picks its implementation (on x86 CPUs ``forward_native``, two bf16 roundings:
docs/engine_facts.md#op-by-op-bitwise-facts-on-the-engines-tensors). Native reference
:func:`silu_and_mul_native`: the formula in fp32 rounded once. Bound, elementwise:
``|visible - native| <= 3 u |native|`` (``u`` = 2^-8 for bf16).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.vllm_context import VllmContext


def check_gated_input(x: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise a clear error unless x is a non-empty ``dtype`` tensor [..., 2d] with d >= 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"x must be {dtype} (the engine's dtype), got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2d] = [gate | up] with an even last dimension, got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")


class VllmSiluAndMulKernel:
    """vLLM's ``SiluAndMul`` layer in the engine's context: ``kernel(x [..., 2d]) -> y [..., d]``."""

    def __init__(self, context: VllmContext) -> None:
        from vllm.model_executor.layers.activation import SiluAndMul

        self.context = context
        with context.active(building=True):
            self.layer: Any = SiluAndMul()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_gated_input(x, self.context.model_dtype)
        with torch.no_grad(), self.context.active():
            return self.layer(x.detach())


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for x = [gate | up], in fp32, one cast to x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)

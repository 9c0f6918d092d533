"""The gated shared expert of a Qwen2-MoE block: vLLM's forward, a closed-form backward that
chains the reused linear and SwiGLU VJPs.

Gradient contract ``shared_expert`` (variables input, fc1_weight, fc2_weight, gate_weight).
- visible forward: :class:`~megatron_vllm_align.ops.shared_expert.kernel.VllmSharedExpertKernel`
  (vLLM's ``Qwen2MoeMLP`` with its ``shared_expert_gate``) on x [M, H] bf16:
  ``out = sigmoid(x Wg^T) * W2 (silu(gate) * up)``, ``[gate; up] = W1 x``, every step in bf16;
- trainable: x and the masters ``fc1_weight`` [2F, H] ([gate; up] rows, HF ``gate_proj`` /
  ``up_proj``), ``fc2_weight`` [H, F] (``down_proj``) and ``gate_weight`` [1, H] (HF
  ``shared_expert_gate``); no discrete state;
- save: x, the visible bf16 intermediates ``gate_up``, ``act``, ``down``, ``gate_logit`` (so
  nothing is recomputed) and the three weight parameters (by reference);
- backward (:func:`~megatron_vllm_align.ops.shared_expert.vjp.shared_expert_vjp`), with
  ``s = sigmoid(gate_logit)`` in fp32:
  ``d gate_logit = <dY, down> s (1 - s)`` in fp32 on the visible ``down`` (the exact derivative of
  the visible product ``s * down``), cast to bf16, and
  ``(dx_gate, dWg) = linear_vjp(d gate_logit, x, Wg)``; ``d down = s dY`` cast to bf16,
  ``(d act, dW2) = linear_vjp(d down, act, W2)``; ``d gate_up = silu_and_mul_vjp(gate_up, d act)``;
  ``(dx_mlp, dW1) = linear_vjp(d gate_up, x, W1)``; ``dX = dx_mlp + dx_gate`` summed in fp32,
  cast once. ``linear_vjp`` and ``silu_and_mul_vjp`` are the dense modules' VJPs, reused.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.refresh import ProbedDeployedValue, master_stamp, probe_input
from megatron_vllm_align.ops.shared_expert.kernel import VllmSharedExpertKernel
from megatron_vllm_align.ops.shared_expert.vjp import shared_expert_vjp
from megatron_vllm_align.ops.vllm_context import VllmContext


class SharedExpertFunction(torch.autograd.Function):
    """``apply(x [M, H], fc1_weight, fc2_weight, gate_weight, kernel) -> [M, H]`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
                gate_weight: torch.Tensor, kernel: VllmSharedExpertKernel) -> torch.Tensor:
        parts = kernel.parts(x)
        ctx.save_for_backward(x, parts.gate_up, parts.act, parts.down, parts.gate_logit,
                              fc1_weight, fc2_weight, gate_weight)
        ctx.model_dtype = kernel.context.model_dtype
        return parts.out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate_up, act, down, gate_logit, fc1, fc2, gate = ctx.saved_tensors
        need = ctx.needs_input_grad
        weights = tuple(w.detach().to(ctx.model_dtype) for w in (fc1, fc2, gate))
        grads = shared_expert_vjp(grad_out, x, gate_up, act, down, gate_logit, weights, tuple(need[:4]),
                                  (x.dtype, fc1.dtype, fc2.dtype, gate.dtype))
        return (*grads, None)


class VllmSharedExpert(ProbedDeployedValue, nn.Module):
    """``forward(x [T, H]) -> [T, H]``: vLLM's gated shared expert (module docstring). Master
    parameters ``fc1_weight`` [2F, H], ``fc2_weight`` [H, F], ``gate_weight`` [1, H]; the vLLM layer
    is the plain attribute ``kernel``; ``refresh_deployed()`` after every change of the masters."""

    contract_name = "shared_expert"

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, vllm_context: VllmContext, prefix: str = "",
                 params_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.kernel = VllmSharedExpertKernel(vllm_context, hidden_size, ffn_hidden_size, prefix)
        dtype = params_dtype or vllm_context.model_dtype
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn_hidden_size, hidden_size, dtype=dtype))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=dtype))
        self.gate_weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self._deployed_stamp: tuple[tuple[int, int], ...] | None = None
        self.reset_parameters()

    def _params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.fc1_weight, self.fc2_weight, self.gate_weight

    def reset_parameters(self) -> None:
        """Each matrix initialised like an ``nn.Linear`` weight, then a refresh."""
        with torch.no_grad():
            for weight in self._params():
                bound = 1.0 / math.sqrt(weight.shape[-1])
                nn.init.uniform_(weight, -bound, bound)
        self.refresh_deployed()

    def _new_kernel(self) -> VllmSharedExpertKernel:
        k = self.kernel
        return VllmSharedExpertKernel(k.context, k.hidden_size, k.ffn_hidden_size, k.prefix)

    def _load_deployed(self, kernel: VllmSharedExpertKernel) -> None:
        kernel.load(*self._params())

    def _probe(self, kernel: VllmSharedExpertKernel) -> torch.Tensor:
        return kernel(probe_input(kernel.hidden_size, kernel.context.model_dtype))

    def refresh_deployed(self) -> None:
        """Rebuild vLLM's shared expert (the deployed value) from the current masters."""
        self._load_deployed(self.kernel)
        self._deployed_stamp = master_stamp(*self._params())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._deployed_stamp != master_stamp(*self._params()):
            raise RuntimeError("VllmSharedExpert: the master weights changed since the deployed value was "
                               "built; call refresh_deployed() (or register_deployed_refresh(optimizer, model))")
        return SharedExpertFunction.apply(x, *self._params(), self.kernel)

    def extra_repr(self) -> str:
        return f"hidden_size={self.kernel.hidden_size}, ffn_hidden_size={self.kernel.ffn_hidden_size}"

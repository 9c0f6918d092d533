"""Routed experts whose forward is vLLM's fused-experts kernel and whose backward is glue (case C,
docs/method.md#backward-reuse) around the reused linear VJP.

Gradient contract ``routed_experts``:
- visible forward: :class:`~megatron_vllm_align.ops.routed_experts.kernel.VllmRoutedExpertsKernel` on x [M, H]
  bf16, fp32 ``topk_weights`` [M, k] and int32 ``topk_ids`` [M, k] from the router;
  ``out = sum_k w_k W2_e (silu(gate) * up)``, ``[gate; up] = W1_e x``;
- trainable: x, ``topk_weights`` (to the router), the masters ``fc1_weight`` [E, 2F, H] (per expert
  [gate rows; up rows] = Megatron's per-expert ``linear_fc1.weight`` = vLLM ``w13``) and
  ``fc2_weight`` [E, H, F] (Megatron's ``linear_fc2.weight`` = vLLM ``w2``);
- discrete state: ``topk_ids`` (never re-selected) and the dispatch order sorted by them;
- save: x, topk_weights, topk_ids and the two weight parameters (by reference). vLLM's kernel
  exposes neither the FC1 output nor the activation, so the backward recomputes FC1 per expert
  in fp32 (as the kernel keeps it) and the activation rounded to bf16 (as the kernel rounds it);
- backward (:func:`~megatron_vllm_align.ops.routed_experts.vjp.routed_experts_vjp`), per expert over its sorted tokens:
  ``y = a W2^T`` (fp32) gives ``d w_slot = <y, dY_token>``; ``dy = w_slot dY`` cast to bf16;
  ``(da, dW2) = linear_vjp(dy, a, W2)``; the SwiGLU VJP in closed form (reused from
  :func:`~megatron_vllm_align.ops.silu_and_mul.vjp.silu_and_mul_vjp`) on the fp32 FC1 output,
  cast to bf16; ``(dx_slot, dW1) = linear_vjp(d_gate_up, x, W1)`` with dx_slot kept in fp32. Then
  the inverse dispatch permutation puts the slots back in (token, slot) order, each token's k
  copies are summed in fp32 and cast to bf16 once. Experts that receive no token get zero
  weight gradients. ``linear_vjp`` is the dense modules' VJP (TE GEMMs on CUDA when importable).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.refresh import PROBE_ROWS, ProbedDeployedValue, master_stamp, probe_input
from megatron_vllm_align.ops.routed_experts.kernel import VllmRoutedExpertsKernel
from megatron_vllm_align.ops.routed_experts.vjp import routed_experts_vjp
from megatron_vllm_align.ops.vllm_context import VllmContext


class RoutedExpertsFunction(torch.autograd.Function):
    """``apply(x [M, H], topk_weights [M, k], topk_ids [M, k], fc1_weight, fc2_weight, kernel) -> [M, H]``
    (contract ``routed_experts``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, kernel: VllmRoutedExpertsKernel) -> torch.Tensor:
        out = kernel(x, topk_weights, topk_ids)
        ctx.save_for_backward(x, topk_weights, topk_ids, fc1_weight, fc2_weight)
        ctx.model_dtype = kernel.context.model_dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, topk_weights, topk_ids, fc1, fc2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = routed_experts_vjp(grad_out, x, topk_weights, topk_ids, fc1.detach().to(ctx.model_dtype),
                                   fc2.detach().to(ctx.model_dtype), (need[0], need[1], need[3], need[4]),
                                   (x.dtype, topk_weights.dtype, fc1.dtype, fc2.dtype))
        grad_x, grad_w, grad_fc1, grad_fc2 = grads
        return grad_x, grad_w, None, grad_fc1, grad_fc2, None


class VllmRoutedExperts(ProbedDeployedValue, nn.Module):
    """``forward(x [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H]`` through vLLM's fused
    experts (``routed_experts``). Master parameters ``fc1_weight`` [E, 2F, H] and ``fc2_weight``
    [E, H, F]; the vLLM layer built from them is the plain attribute ``kernel`` (not a submodule);
    ``refresh_deployed()`` after every change of the masters. ``prefix``: the layer's name in the
    vLLM model (e.g. ``model.layers.0.mlp.experts``); unique per context, generated when empty.
    """

    contract_name = "routed_experts"

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, top_k: int,
                 renormalize: bool = True, *, vllm_context: VllmContext, prefix: str = "",
                 params_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.kernel = VllmRoutedExpertsKernel(vllm_context, hidden_size, ffn_hidden_size, num_experts, top_k,
                                              renormalize, prefix)
        dtype = params_dtype or vllm_context.model_dtype
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size, dtype=dtype))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, dtype=dtype))
        self._deployed_stamp: tuple[tuple[int, int], ...] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices initialised like ``nn.Linear`` weights, then a refresh."""
        with torch.no_grad():
            for weight in (self.fc1_weight, self.fc2_weight):
                bound = 1.0 / math.sqrt(weight.shape[-1])
                nn.init.uniform_(weight, -bound, bound)
        self.refresh_deployed()

    def _new_kernel(self) -> VllmRoutedExpertsKernel:
        k = self.kernel
        return VllmRoutedExpertsKernel(k.context, k.hidden_size, k.ffn_hidden_size, k.num_experts, k.top_k,
                                       k.renormalize)

    def _load_deployed(self, kernel: VllmRoutedExpertsKernel) -> None:
        kernel.load(self.fc1_weight, self.fc2_weight)

    def _probe(self, kernel: VllmRoutedExpertsKernel) -> torch.Tensor:
        """The experts on the probe input, token i routed to experts ``(i k + j) mod E``, weights ``1 / k``:
        every expert is used once the probe has ``E / k`` rows."""
        k, experts = kernel.top_k, kernel.num_experts
        rows = max(PROBE_ROWS, -(-experts // k))
        ids = (torch.arange(rows * k) % experts).reshape(rows, k).to(torch.int32)
        weights = torch.full((rows, k), 1.0 / k, dtype=torch.float32)
        return kernel(probe_input(kernel.hidden_size, kernel.context.model_dtype, rows), weights, ids)

    def refresh_deployed(self) -> None:
        """Rebuild vLLM's experts layer (the deployed value) from the current masters."""
        self._load_deployed(self.kernel)
        self._deployed_stamp = master_stamp(self.fc1_weight, self.fc2_weight)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self._deployed_stamp != master_stamp(self.fc1_weight, self.fc2_weight):
            raise RuntimeError("VllmRoutedExperts: the master weights changed since the deployed value was "
                               "built; call refresh_deployed() (or register_deployed_refresh(optimizer, model))")
        return RoutedExpertsFunction.apply(x, topk_weights, topk_ids, self.fc1_weight, self.fc2_weight, self.kernel)

    def extra_repr(self) -> str:
        k = self.kernel
        return (f"num_experts={k.num_experts}, hidden_size={k.hidden_size}, ffn_hidden_size={k.ffn_hidden_size}, "
                f"top_k={k.top_k}, prefix={k.prefix!r}")

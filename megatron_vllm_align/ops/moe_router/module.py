"""MoE router whose forward is vLLM's (gate GEMM, top-k, routing weights) and whose backward
differentiates only the continuous scores at the expert IDs chosen in forward.

Gradient contract ``moe_router`` (case A with the IDs fixed, docs/method.md#backward-reuse):
- visible forward: :class:`~megatron_vllm_align.ops.moe_router.kernel.VllmRouterKernel`: bf16 logits
  [M, E] from vLLM's gate GEMM, vLLM's top-k IDs [M, k] int32 and fp32 weights [M, k] (softmax
  over the k selected logits with ``renormalize``, else the full-softmax probabilities);
- trainable: the input and the master router weight ``weight`` [E, H] (Megatron ``TopKRouter.weight``);
- discrete state: ``topk_ids``, chosen once in forward, saved, never re-selected; with router
  replay they are given from outside and only validated (:func:`check_replay_ids`);
- continuous: ``topk_weights`` and ``logits`` (both outputs take upstream gradients, so auxiliary
  losses on the logits differentiate too);
- save: x, the weight parameter (by reference), the bf16 logits and the IDs;
- backward (:func:`~megatron_vllm_align.ops.moe_router.vjp.routing_weights_vjp`, fp32 replay at the
  saved IDs from the saved logits):
  renormalised, with ``p = softmax(logits[IDs])``: ``dl[IDs] = p (dw - <p, dw>)``, 0 elsewhere;
  otherwise, with ``P = softmax(logits)``: ``dl = scatter(IDs, P[IDs] dw) - P <P[IDs], dw>``.
  The logits' own upstream gradient is added in fp32, the sum is cast once to bf16 and the gate
  GEMM's VJP is the dense linear one (:func:`~megatron_vllm_align.ops.dense_linear.vjp.linear_vjp`,
  reused): ``dX = dl W``, ``dW = dl^T X``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.ops.moe_router.kernel import VllmRouterKernel
from megatron_vllm_align.ops.moe_router.vjp import routing_weights_vjp
from megatron_vllm_align.ops.refresh import ProbedDeployedValue, master_stamp, probe_input
from megatron_vllm_align.ops.vllm_context import VllmContext


def check_replay_ids(topk_ids: Any, tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Validate replayed expert IDs [tokens, top_k]: integer, in [0, num_experts), distinct within a
    token. Returns them as contiguous int32; raises TypeError / ValueError naming the problem."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool \
            or topk_ids.is_complex():
        raise TypeError(f"replay_ids must be an integer tensor, got {getattr(topk_ids, 'dtype', type(topk_ids))}")
    if tuple(topk_ids.shape) != (tokens, top_k):
        raise ValueError(f"replay_ids must have shape {(tokens, top_k)} (tokens, top_k), got {tuple(topk_ids.shape)}")
    if topk_ids.numel() == 0:
        return topk_ids.to(torch.int32).contiguous()
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"replay_ids must lie in [0, {num_experts}); got values in [{low}, {high}]")
    ordered = topk_ids.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    if bool(repeated.any()):
        token = int(repeated.nonzero()[0])
        raise ValueError(f"replay_ids repeat an expert within a token's top-k: token {token} has "
                         f"{topk_ids[token].tolist()}")
    return topk_ids.to(torch.int32).contiguous()


class MoERouterFunction(torch.autograd.Function):
    """``apply(x [M, H], weight [E, H], kernel, replay_ids or None) -> (topk_weights [M, k] fp32,
    topk_ids [M, k] int32, logits [M, E])`` (contract ``moe_router``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, kernel: VllmRouterKernel,
                replay_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = kernel.logits(x)
        if replay_ids is None:
            topk_weights, topk_ids = kernel.select(x, logits)
        else:
            topk_ids = replay_ids
            topk_weights = kernel.weights_at(logits, topk_ids)
        ctx.save_for_backward(x, weight, logits, topk_ids)
        ctx.renormalize = kernel.renormalize
        ctx.model_dtype = kernel.context.model_dtype
        ctx.mark_non_differentiable(topk_ids)
        return topk_weights, topk_ids, logits

    @staticmethod
    def backward(ctx: Any, grad_weights: torch.Tensor, _grad_ids: Any,
                 grad_logits: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, logits, topk_ids = ctx.saved_tensors
        d_logits = routing_weights_vjp(grad_weights, logits, topk_ids, ctx.renormalize) + grad_logits.float()
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False)
        grad_x, grad_w, _ = linear_vjp(d_logits.to(logits.dtype), x, weight.detach().to(ctx.model_dtype), None,
                                       x.dtype, weight.dtype, needs)
        return grad_x, grad_w, None, None


class VllmMoERouter(ProbedDeployedValue, nn.Module):
    """``forward(x [..., H], replay_ids=None) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32,
    logits [T, E])`` over the T = prod(x.shape[:-1]) tokens, through vLLM's router.

    ``replay_ids`` [T, k]: rollout-recorded expert IDs used instead of the router's own choice
    (router replay); the weights are then vLLM's formula at those IDs. Master parameter ``weight``
    [E, H]; the vLLM gate built from it is the plain attribute ``kernel`` (not a submodule);
    ``refresh_deployed()`` after every change of the master.
    """

    contract_name = "moe_router"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool = True, *,
                 vllm_context: VllmContext, prefix: str = "", params_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.kernel = VllmRouterKernel(vllm_context, hidden_size, num_experts, top_k, renormalize, prefix)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size,
                                               dtype=params_dtype or vllm_context.model_dtype))
        self._deployed_stamp: tuple[tuple[int, int], ...] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s weight initialisation, then a refresh of the deployed value."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.refresh_deployed()

    def _new_kernel(self) -> VllmRouterKernel:
        k = self.kernel
        return VllmRouterKernel(k.context, k.hidden_size, k.num_experts, k.top_k, k.renormalize, k.prefix)

    def _load_deployed(self, kernel: VllmRouterKernel) -> None:
        kernel.load(self.weight)

    def _probe(self, kernel: VllmRouterKernel) -> torch.Tensor:
        return kernel.logits(probe_input(kernel.hidden_size, kernel.context.model_dtype))

    def refresh_deployed(self) -> None:
        """Rebuild vLLM's gate from the current master weight."""
        self._load_deployed(self.kernel)
        self._deployed_stamp = master_stamp(self.weight)

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._deployed_stamp != master_stamp(self.weight):
            raise RuntimeError("VllmMoERouter: the master weight changed since the deployed value was built; "
                               "call refresh_deployed() (or register_deployed_refresh(optimizer, model))")
        hidden = self.kernel.hidden_size
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != hidden:
            raise ValueError(f"x must be [..., hidden_size={hidden}], got {tuple(getattr(x, 'shape', ()))}")
        flat = x.reshape(-1, hidden)
        if replay_ids is not None:
            replay_ids = check_replay_ids(replay_ids, flat.shape[0], self.kernel.top_k, self.kernel.num_experts)
        return MoERouterFunction.apply(flat, self.weight, self.kernel, replay_ids)

    def extra_repr(self) -> str:
        k = self.kernel
        return (f"hidden_size={k.hidden_size}, num_experts={k.num_experts}, top_k={k.top_k}, "
                f"renormalize={k.renormalize}")

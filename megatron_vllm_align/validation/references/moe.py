"""Layer-1 references of the MoE router (``moe_router``), routed experts and the gated shared
expert (both ``routed_experts``).

Both return the visible values (bridged, seed 000 ``VisibleWithSurrogate``) and take their
gradients from plain float64 autograd of the same math at the SAME fixed expert IDs; neither
calls the backward under test, sorts tokens or permutes them:

* :class:`ReferenceMoERouter`: float64 gate GEMM on the bf16 x and weight, its value bridged to
  the visible bf16 logits; the routing weights are float64 softmax of those logits (over the k
  selected ones, or over all experts when not renormalised) gathered at the fixed IDs.
* :class:`ReferenceRoutedExperts`: dense float64 evaluation of every expert on every token,
  combined with a [M, E] weight matrix scattered from ``topk_weights`` at the IDs (zeros
  elsewhere): no dispatch, no inverse permutation, no per-token accumulation code.
* :class:`ReferenceSharedExpert`: float64 ``sigmoid(x Wg^T) * (silu(gate) * up) W2^T`` on the bf16
  x and weights, no saved intermediates, no hand-written VJP.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.validation.bridges import visible_with_surrogate

VisibleRouter = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
VisibleExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
VisibleSharedExpert = Callable[[torch.Tensor], torch.Tensor]


class ReferenceMoERouter(nn.Module):
    """``module(x [M, H], replay_ids=None) -> (topk_weights, topk_ids, logits)`` like the candidate.

    weight: the router master [E, H] (copied). visible: ``(x, replay_ids) -> (weights, ids, logits)``
    from the inference implementation, run without gradients; the IDs it returns are the fixed
    discrete state, never re-selected here.
    """

    def __init__(self, weight: torch.Tensor, renormalize: bool, visible: VisibleRouter) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.renormalize = renormalize
        self.visible = visible

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            weights_vis, ids, logits_vis = self.visible(x.detach(), replay_ids)
        surrogate = F.linear(x.double(), self.weight.double()).to(logits_vis.dtype)
        logits = visible_with_surrogate(logits_vis, surrogate, "router logits")
        logits64 = logits.double()
        selected = logits64.gather(1, ids.long())
        if self.renormalize:
            weights = torch.softmax(selected, dim=-1)
        else:
            weights = (selected - torch.logsumexp(logits64, dim=-1, keepdim=True)).exp()
        return visible_with_surrogate(weights_vis, weights.to(weights_vis.dtype), "routing weights"), ids, logits


class ReferenceRoutedExperts(nn.Module):
    """``module(x [M, H], topk_weights [M, k], topk_ids [M, k]) -> [M, H]`` like the candidate.

    fc1_weight [E, 2F, H] ([gate; up] rows) and fc2_weight [E, H, F] are copied; visible:
    ``(x, topk_weights, topk_ids) -> out`` from the inference implementation. Costs
    M E (3 F H) float64 multiply-adds per pass: meant for small test shapes.
    """

    def __init__(self, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, visible: VisibleExperts) -> None:
        super().__init__()
        self.fc1_weight = nn.Parameter(fc1_weight.detach().clone())
        self.fc2_weight = nn.Parameter(fc2_weight.detach().clone())
        self.visible = visible

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out_vis = self.visible(x.detach(), topk_weights.detach(), topk_ids)
        gate, up = torch.einsum("mh,efh->mef", x.double(), self.fc1_weight.double()).chunk(2, dim=-1)
        y = torch.einsum("mef,ehf->meh", F.silu(gate) * up, self.fc2_weight.double())
        combine = torch.zeros(y.shape[:2], dtype=torch.float64, device=x.device)
        combine = combine.scatter(1, topk_ids.long(), topk_weights.double())
        surrogate = torch.einsum("me,meh->mh", combine, y).to(out_vis.dtype)
        return visible_with_surrogate(out_vis, surrogate, "routed experts output")


class ReferenceSharedExpert(nn.Module):
    """``module(x [M, H]) -> [M, H]`` like the candidate. fc1_weight [2F, H] ([gate; up] rows),
    fc2_weight [H, F] and gate_weight [1, H] are copied; visible: ``x -> out`` from the inference
    implementation."""

    def __init__(self, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, gate_weight: torch.Tensor,
                 visible: VisibleSharedExpert) -> None:
        super().__init__()
        self.fc1_weight = nn.Parameter(fc1_weight.detach().clone())
        self.fc2_weight = nn.Parameter(fc2_weight.detach().clone())
        self.gate_weight = nn.Parameter(gate_weight.detach().clone())
        self.visible = visible

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out_vis = self.visible(x.detach())
        x64 = x.double()
        gate, up = F.linear(x64, self.fc1_weight.double()).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, self.fc2_weight.double())
        surrogate = (torch.sigmoid(F.linear(x64, self.gate_weight.double())) * down).to(out_vis.dtype)
        return visible_with_surrogate(out_vis, surrogate, "shared expert output")

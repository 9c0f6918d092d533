"""Layer-1 reference of the MoE router (``moe_router``): the visible values bridged
(``VisibleWithSurrogate``, docs/method.md#layer-1-module-vjp), gradients from plain float64 autograd of
the same math at the SAME fixed expert IDs (never re-selected, never the backward under test).

:class:`ReferenceMoERouter`: float64 gate GEMM on the bf16 x and weight, its value bridged to the
visible bf16 logits; the routing weights are float64 softmax of those logits (over the k selected
ones, or over all experts when not renormalised) gathered at the fixed IDs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.ops.reference_bridge import visible_with_surrogate

VisibleRouter = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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

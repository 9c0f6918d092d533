"""Layer-1 reference of the routed experts (``routed_experts``): the visible output bridged (seed
000 ``VisibleWithSurrogate``), gradients from plain float64 autograd at the SAME fixed expert IDs.

:class:`ReferenceRoutedExperts`: dense float64 evaluation of every expert on every token, combined
with a [M, E] weight matrix scattered from ``topk_weights`` at the IDs (zeros elsewhere): no
dispatch, no sorting, no inverse permutation, no per-token accumulation code.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.ops.reference_bridge import visible_with_surrogate

VisibleExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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

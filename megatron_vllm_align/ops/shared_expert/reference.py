"""Layer-1 reference of the gated shared expert (``shared_expert``): the visible output bridged
(``VisibleWithSurrogate``), gradients from plain float64 autograd.

:class:`ReferenceSharedExpert`: float64 ``sigmoid(x Wg^T) * (silu(gate) * up) W2^T`` on the bf16 x
and weights, no saved intermediates, no hand-written VJP.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vllm_align.ops.reference_bridge import visible_with_surrogate

VisibleSharedExpert = Callable[[torch.Tensor], torch.Tensor]


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

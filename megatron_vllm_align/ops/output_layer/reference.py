"""Layer-1 reference of the output layer (contract ``output_layer``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceOutputLogits(nn.Module):
    """Plain float64 autograd of ``logit_scale * hidden @ weight^T`` on an independent copy of the
    output ``weight`` [vocab, hidden], over all rows at once; logits in hidden's dtype."""

    def __init__(self, weight: torch.Tensor, logit_scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.logit_scale = logit_scale

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.logit_scale * F.linear(hidden.double(), self.weight.double())).to(hidden.dtype)

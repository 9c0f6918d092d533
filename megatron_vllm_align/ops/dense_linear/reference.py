"""Layer-1 reference of an unquantized linear ``Y = X W^T + b`` (contract ``dense_linear``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceDenseLinear(nn.Module):
    """Plain float64 autograd of ``F.linear`` on independent copies of ``weight`` / ``bias``; the
    output is cast to the input dtype. Called as ``module(x [..., in])``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), bias).to(x.dtype)

"""Layer-1 reference of RMSNorm, optionally with the residual add (contract ``rms_norm``)."""
from __future__ import annotations

import torch
from torch import nn


class ReferenceRMSNorm(nn.Module):
    """Plain float64 autograd of ``y = s * rsqrt(mean(s^2) + eps) * w`` with ``s = x (+ residual)``;
    returns ``y`` (and the residual sum ``s``) in the input dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        total = x.double() if residual is None else x.double() + residual.double()
        y = total * torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.double()
        y = y.to(x.dtype)
        return y if residual is None else (y, total.to(x.dtype))

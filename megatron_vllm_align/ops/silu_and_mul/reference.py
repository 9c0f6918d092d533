"""Layer-1 reference of SiLU-and-mul on ``x = [gate | up]`` (contract ``silu_and_mul``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceSiluAndMul(nn.Module):
    """Plain float64 autograd of ``silu(gate) * up``; output in the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.double().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

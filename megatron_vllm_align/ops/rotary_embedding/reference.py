"""Layer-1 reference of the neox rotary embedding (contract ``rotary_embedding``)."""
from __future__ import annotations

import torch
from torch import nn


class ReferenceRotary(nn.Module):
    """Plain float64 autograd of the neox rotation of q and k ``[tokens, heads * head_size]``.

    The angles are its own: ``positions * base^(-2i / rotary_dim)`` and their cos / sin in float64
    (never the candidate's cache, which holds them rounded to the model dtype); dimensions past
    ``rotary_dim`` pass through."""

    def __init__(self, head_size: int, rotary_dim: int, base: float) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, base

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
        angles = positions.double()[:, None] * self.base ** -exponents
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        heads = x.double().reshape(x.shape[0], -1, self.head_size)
        half = self.rotary_dim // 2
        x1, x2, rest = heads[..., :half], heads[..., half:2 * half], heads[..., 2 * half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
        return out.reshape(x.shape).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)

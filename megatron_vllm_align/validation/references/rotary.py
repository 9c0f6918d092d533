"""Layer-1 reference of the neox rotary embedding (contract ``rotary_embedding``)."""
from __future__ import annotations

import torch
from torch import nn


class ReferenceRotary(nn.Module):
    """Plain fp32 autograd of the neox rotation of q and k ``[tokens, heads * head_size]`` with the
    same cos/sin cache values as the candidate (``cache [max_position, rotary_dim]``, cos then sin);
    dimensions past ``rotary_dim`` pass through."""

    def __init__(self, cache: torch.Tensor, head_size: int) -> None:
        super().__init__()
        self.cache, self.head_size = cache, head_size

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cache[positions].float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        heads = x.float().reshape(x.shape[0], -1, self.head_size)
        half = cos.shape[-1]
        x1, x2, rest = heads[..., :half], heads[..., half:2 * half], heads[..., 2 * half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
        return out.reshape(x.shape).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)

"""Layer-1 reference of packed causal GQA attention (contract ``attention``)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class ReferenceAttention(nn.Module):
    """Plain float64 autograd of ``softmax(Q K^T * scale + causal mask) V`` per packed sequence, each
    KV head repeated for its query heads; q [T, Hq, D], k / v [T, Hkv, D]; output in q's dtype.
    Written out here (no kernel of the package is called)."""

    def __init__(self, seq_lens: Sequence[int], scale: float) -> None:
        super().__init__()
        self.seq_lens, self.scale = list(seq_lens), scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        outputs, start = [], 0
        for n in self.seq_lens:
            qs = q[start:start + n].double().transpose(0, 1)                               # [Hq, n, D]
            ks = k[start:start + n].double().repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[start:start + n].double().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) * self.scale
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            outputs.append((probs @ vs).transpose(0, 1))
            start += n
        return torch.cat(outputs).to(q.dtype)

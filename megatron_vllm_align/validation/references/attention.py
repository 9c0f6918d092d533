"""Layer-1 reference of packed causal GQA attention (contract ``attention``)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from megatron_vllm_align.kernels.attention import attention_native


class ReferenceAttention(nn.Module):
    """Plain fp32 autograd of ``attention_native`` (softmax(QKᵀ·scale + causal mask)·V per sequence,
    KV heads repeated for their query heads), cast to the query dtype."""

    def __init__(self, seq_lens: Sequence[int], scale: float) -> None:
        super().__init__()
        self.seq_lens, self.scale = list(seq_lens), scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_native(q, k, v, self.seq_lens, self.scale).to(q.dtype)

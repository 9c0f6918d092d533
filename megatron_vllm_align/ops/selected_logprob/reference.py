"""Layer-1 reference of the selected-token logprob (contract ``selected_logprob``)."""
from __future__ import annotations

import torch
from torch import nn


class ReferenceSelectedLogprob(nn.Module):
    """Plain float64 autograd of ``log_softmax(logits[..., :vocab_size])`` gathered at the targets;
    the output is cast to fp32, the candidate's output dtype."""

    def __init__(self, vocab_size: int | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        z = logits[..., : self.vocab_size].double() if self.vocab_size else logits.double()
        return torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()

"""Layer-1 reference of the processed logprob (contract ``processed_logprob``), written from the
definition (docs/sampling.md#vllms-order-of-operations) in float64; it calls none of vLLM's steps."""
from __future__ import annotations

import torch
from torch import nn


class ReferenceProcessedLogprob(nn.Module):
    """float64 autograd of the processed logprob of ``targets`` under ``logits[..., :vocab_size]``,
    cast to fp32: ``x = z / T``; min-p keeps ``softmax(x) >= min_p max softmax(x)``; top-k keeps
    ``x >=`` the k-th largest kept value (ties all kept); top-p drops, in ascending order of the
    kept values, the tokens whose cumulative probability over the kept tokens is ``<= 1 - top_p``,
    never the largest; then ``log_softmax`` over the kept support S. The support is discrete (no
    gradient); off S the gradient is 0. Equal values at the top-p boundary are ordered as
    ``torch.sort`` orders the fp32 values ``fp32(z) / fp32(T)`` after min-p (-inf where it drops),
    the array the sampler sorts (docs/sampling.md#vllms-order-of-operations: CPU sort is not stable,
    so the tie-break is the sort's, not the token index)."""

    def __init__(self, sampling_params, vocab_size: int | None = None) -> None:
        super().__init__()
        self.sampling_params, self.vocab_size = sampling_params, vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        p = self.sampling_params
        z = logits[..., : self.vocab_size] if self.vocab_size else logits
        x = z.double() / p.temperature
        with torch.no_grad():
            keep = torch.ones_like(x, dtype=torch.bool)
            if p.min_p > 0:
                probs = x.softmax(-1)
                keep &= probs >= p.min_p * probs.amax(-1, keepdim=True)
            # The sampler sorts once, after min-p and before top-k: ties are ordered within that array.
            tempered = (z.float() / torch.tensor(p.temperature, dtype=torch.float32)).masked_fill(~keep, -torch.inf)
            if 0 < p.top_k < x.shape[-1]:
                keep &= x >= x.masked_fill(~keep, -torch.inf).topk(p.top_k, dim=-1).values[..., -1:]
            if p.top_p < 1:
                order = tempered.sort(dim=-1).indices
                mass = x.masked_fill(~keep, -torch.inf).softmax(-1).gather(-1, order).cumsum(-1)
                drop = mass <= 1 - p.top_p
                drop[..., -1] = False
                keep &= ~torch.zeros_like(drop).scatter(-1, order, drop)
        logprobs = x.masked_fill(~keep, -torch.inf).log_softmax(-1)
        return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()

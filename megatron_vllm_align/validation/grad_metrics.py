"""Per-gradient figures used by every backward comparison (layer 1, 2 and dump diffs)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

EPS = 1e-30  # floor for norms in denominators (rel_l2 = ||g - g_ref|| / max(||g_ref||, EPS))


@dataclass(frozen=True)
class GradMetrics:
    """Figures for one gradient against its reference, computed in float64.

    cosine and norm_ratio are None where a norm is zero (undefined); then read max_abs_err.
    """

    max_abs_err: float
    rel_l2: float
    norm_ratio: float | None
    cosine: float | None
    ref_norm: float
    norm: float
    ref_max_abs: float

    def to_dict(self) -> dict:
        return asdict(self)


def grad_metrics(grad: torch.Tensor, ref: torch.Tensor) -> GradMetrics:
    """max|g - g_ref|, ||g - g_ref|| / max(||g_ref||, EPS), ||g|| / ||g_ref||, cos(g, g_ref)."""
    if grad.shape != ref.shape:
        raise ValueError(f"grad_metrics: shape {tuple(grad.shape)} vs reference {tuple(ref.shape)}")
    g = grad.detach().to(torch.float64).flatten()
    r = ref.detach().to(torch.float64).flatten()
    g_norm = float(torch.linalg.vector_norm(g))
    r_norm = float(torch.linalg.vector_norm(r))
    both = g_norm > 0 and r_norm > 0
    cosine = float(torch.dot(g, r)) / (g_norm * r_norm) if both else None
    diff = g - r
    empty = diff.numel() == 0
    return GradMetrics(   # the infinity norm is max |x|, without an |x| copy of a large gradient
        max_abs_err=0.0 if empty else float(torch.linalg.vector_norm(diff, float("inf"))),
        rel_l2=float(torch.linalg.vector_norm(diff)) / max(r_norm, EPS),
        norm_ratio=g_norm / r_norm if r_norm > 0 else None,
        cosine=cosine,
        ref_norm=r_norm,
        norm=g_norm,
        ref_max_abs=0.0 if empty else float(torch.linalg.vector_norm(r, float("inf"))),
    )

"""Trainer-vs-engine logprob mismatch, in the figures RL users already read.

All figures are over the tokens of every sequence, with
``delta = lp_train - lp_gen`` (trainer minus inference engine, natural-log probabilities):

* ``max_abs_delta_logprob`` / ``mean_abs_delta_logprob``: max / mean of ``|delta|``.
* ``token_mult_prob_error``: mean of ``exp(|delta|)`` (1.0 when identical).
* ``gen_kl_error``: mean of ``-delta``, the plain (k1) Monte-Carlo estimate of
  KL(P_gen || P_train) on tokens the engine produced; signed, unbiased, noisy.
* ``k3_kl``: mean of ``exp(delta) - delta - 1``, Schulman's k3 estimate of the same KL;
  never negative, 0.0 when identical.

A trainer logprob of -inf (a processed logprob of a token outside the trainer's kept support, which
the engine sampled: docs/sampling.md) makes every figure but ``num_tokens`` infinite.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class LogprobMismatch:
    max_abs_delta_logprob: float
    mean_abs_delta_logprob: float
    token_mult_prob_error: float
    gen_kl_error: float
    k3_kl: float
    num_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def logprob_mismatch(trainer: Sequence[torch.Tensor], engine: Sequence[torch.Tensor]) -> LogprobMismatch:
    """Mismatch figures between per-sequence trainer and engine logprobs (1-D tensors, same lengths)."""
    if len(trainer) != len(engine):
        raise ValueError(f"trainer has {len(trainer)} sequences, engine has {len(engine)}")
    for i, (t, e) in enumerate(zip(trainer, engine)):
        if t.shape != e.shape or t.dim() != 1:
            raise ValueError(f"sequence {i}: trainer logprobs {tuple(t.shape)} vs engine {tuple(e.shape)}; "
                             "expected equal 1-D shapes")
    delta = torch.cat([t.double() - e.double() for t, e in zip(trainer, engine)])
    if delta.numel() == 0:
        raise ValueError("no tokens to compare")
    if not all(bool(torch.isfinite(e).all()) for e in engine) or bool(delta.isnan().any()) or bool(
            (delta == torch.inf).any()):
        raise ValueError("non-finite logprob difference (only a trainer logprob may be -inf)")
    return LogprobMismatch(
        max_abs_delta_logprob=float(delta.abs().max()),
        mean_abs_delta_logprob=float(delta.abs().mean()),
        token_mult_prob_error=float(delta.abs().exp().mean()),
        gen_kl_error=float((-delta).mean()),
        k3_kl=float((delta.exp() - delta - 1).mean()),
        num_tokens=int(delta.numel()),
    )


@dataclass(frozen=True)
class ControlDelta:
    """A control rollout (the same requests sampled without the invariance layer) against reference
    logprobs: ``max_abs_delta_logprob`` over ``tokens`` compared tokens (0.0 when none were compared).
    ``exercised``: the control differs, so the workload exercised batch dependence."""

    max_abs_delta_logprob: float
    tokens: int

    @property
    def exercised(self) -> bool:
        return self.max_abs_delta_logprob > 0.0


def control_delta(reference_tokens: Sequence[Sequence[int]], reference_logprobs: Sequence[torch.Tensor],
                  control_tokens: Sequence[Sequence[int]], control_logprobs: Sequence[torch.Tensor]) -> ControlDelta:
    """Compare a control rollout with a reference one request by request, over each request's tokens up
    to the first one the control sampled differently (from there on the two continue different
    sequences): ``reference_logprobs[i]`` are logprobs of ``reference_tokens[i]`` (e.g. the trainer's
    recompute of what the invariant engine sampled), ``control_logprobs[i]`` the control engine's of
    ``control_tokens[i]``. ValueError when the request counts or a request's tokens and logprobs differ
    in length."""
    counts = {len(reference_tokens), len(reference_logprobs), len(control_tokens), len(control_logprobs)}
    if len(counts) != 1:
        raise ValueError(f"control_delta: request counts differ (reference {len(reference_tokens)} tokens / "
                         f"{len(reference_logprobs)} logprobs, control {len(control_tokens)} / "
                         f"{len(control_logprobs)})")
    deltas = [torch.zeros(0, dtype=torch.float64)]
    for i, (tokens, ours, control, theirs) in enumerate(zip(reference_tokens, reference_logprobs, control_tokens,
                                                             control_logprobs)):
        if len(tokens) != ours.numel() or len(control) != theirs.numel():
            raise ValueError(f"control_delta: request {i}: {len(tokens)} reference tokens with {ours.numel()} "
                             f"logprobs, {len(control)} control tokens with {theirs.numel()} logprobs")
        same = next((j for j, (a, b) in enumerate(zip(control, tokens)) if a != b), min(len(control), len(tokens)))
        deltas.append((theirs[:same].double() - ours[:same].double()).abs())
    compared = torch.cat(deltas)
    return ControlDelta(float(compared.max()) if compared.numel() else 0.0, int(compared.numel()))

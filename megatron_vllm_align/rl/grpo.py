"""The GRPO objective on sampled tokens and the step's on-policy figures.

Objective (per sampled token t of rollout i, advantage ``A_i``, ``r = exp(lp_trainer - lp_engine)``,
the engine's logprob being the behaviour policy's): ``-min(r A_i, clip(r, 1 - eps, 1 + eps) A_i)``,
summed over the global batch's sampled tokens and divided by their count (token-level mean, as the
SFT loss is normalised). With one optimizer step per batch, ``r`` is exactly 1 at the step when
trainer and engine agree, and the gradient is ``-A_i d lp_trainer``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from megatron_vllm_align.rl.rollout import Rollout


@dataclasses.dataclass
class RatioStats:
    """Importance ratios of the sampled tokens seen so far: min, max, sum, count, clipped count."""

    minimum: float = math.inf
    maximum: float = -math.inf
    total: float = 0.0
    count: int = 0
    clipped: int = 0

    def merge(self, other: RatioStats) -> RatioStats:
        return RatioStats(min(self.minimum, other.minimum), max(self.maximum, other.maximum),
                          self.total + other.total, self.count + other.count, self.clipped + other.clipped)

    def figures(self) -> dict[str, float]:
        """``ratio_min`` / ``ratio_mean`` / ``ratio_max`` and ``clipped_fraction``."""
        return {"ratio_min": self.minimum, "ratio_mean": self.total / self.count, "ratio_max": self.maximum,
                "clipped_fraction": self.clipped / self.count}


def grpo_loss_sum(logprobs: Sequence[torch.Tensor], rollouts: Sequence[Rollout], clip_eps: float,
                  stats: RatioStats) -> torch.Tensor:
    """Sum over the sampled tokens of ``rollouts`` of the clipped objective (module docstring);
    ``logprobs[i]`` are the trainer's logprobs of rollout i's completion tokens (autograd kept), under
    the distribution the engine sampled from, as ``engine_logprobs``. Adds
    the ratios to ``stats``; a token counts as clipped where the clipped term is the smaller one."""
    total = torch.zeros((), dtype=torch.float32)
    for i, (values, rollout) in enumerate(zip(logprobs, rollouts, strict=True)):
        if values.shape != (len(rollout.completion),):
            raise ValueError(f"rollout {i}: {values.numel()} trainer logprobs for a completion of "
                             f"{len(rollout.completion)} tokens")
        sampled = values.float().cpu()
        engine = rollout.engine_logprob_tensor
        ratio = torch.exp(sampled - engine)
        advantage = float(rollout.advantage)
        unclipped = ratio * advantage
        clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
        total = total - torch.minimum(unclipped, clipped).sum()
        detached = ratio.detach()
        stats.minimum = min(stats.minimum, float(detached.min()))
        stats.maximum = max(stats.maximum, float(detached.max()))
        stats.total += float(detached.double().sum())
        stats.count += detached.numel()
        stats.clipped += int((clipped.detach() < unclipped.detach()).sum())
    return total

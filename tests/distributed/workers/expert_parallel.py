"""An expert-parallel MoE on CPU (gloo) whose expert gradients get Megatron's expert-DP scaling.

Groups (Megatron's layout with TP = PP = CP = 1): the data-parallel group is the world;
expert-parallel groups are blocks of ``ep_size`` consecutive ranks, each holding a disjoint
share of the experts; the expert-data-parallel group of a rank is the ranks holding the same
experts (stride ``ep_size``). With 2 ranks and ep_size 2: DP size 2, expert-DP size 1.

Gradient finalisation follows megatron-core 0.16.1's DDP with ``average_in_collective=True``
(distributed_data_parallel.py / param_and_grad_buffer.py): before the collective, dense
gradients are multiplied by 1 and expert gradients (parameters marked ``allreduce = False``)
by ``expert_dp_size / dp_size``; then each is averaged over its group. Megatron runs that
in ``finish_grad_sync`` before ``optimizer.step()``; here it runs inside the wrapper's
``step()``, before the inner optimizer's step, the place the seed's dump-timing note describes
(after unscaling and clipping, which Megatron's optimizers also do inside ``step()``). Either
way it happens after ``backward()`` and before the inner step, where :class:`GradientDumper`
hooks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from megatron_vllm_align.guards import GradientScaling
from megatron_vllm_align.guards.scaling import megatron_clip_coefficient


@dataclass(frozen=True)
class ExpertParallelGroups:
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup
    dp_size: int
    ep_size: int
    expert_dp_size: int
    ep_rank: int


def build_expert_parallel_groups(ep_size: int) -> ExpertParallelGroups:
    """Create the groups on every rank (collective); the world size must be a multiple of ep_size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ep_size:
        raise ValueError(f"world size {world} is not a multiple of ep_size {ep_size}")
    ep_group = expert_dp_group = None
    for block in range(world // ep_size):
        ranks = list(range(block * ep_size, (block + 1) * ep_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            ep_group = group
    for ep_rank in range(ep_size):
        ranks = list(range(ep_rank, world, ep_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            expert_dp_group = group
    return ExpertParallelGroups(dp_group=dist.group.WORLD, ep_group=ep_group, expert_dp_group=expert_dp_group,
                                dp_size=world, ep_size=ep_size, expert_dp_size=world // ep_size,
                                ep_rank=rank % ep_size)


def _seeded_linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    """nn.Linear with weights drawn from its own generator (same values in every layout)."""
    linear = nn.Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    with torch.no_grad():
        linear.weight.uniform_(-bound, bound, generator=generator)
        linear.bias.uniform_(-bound, bound, generator=generator)
    return linear


class TinyMoE(nn.Module):
    """``forward(x [T, hidden]) -> [T, hidden]``: a dense projection, a top-1 router and expert MLPs.

    With ``groups`` the experts are split over the EP group (tokens are all-gathered, each rank
    runs its experts on the tokens routed to them, contributions are summed with an all-reduce);
    with ``groups=None`` every expert is local (the single-process reference). Experts are
    named by global index, so names and initial values agree between the two layouts.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, groups: ExpertParallelGroups | None,
                 seed: int = 0) -> None:
        super().__init__()
        self.groups = groups
        self.proj = _seeded_linear(hidden, hidden, seed)
        self.router = _seeded_linear(hidden, num_experts, seed + 1)
        ep_size, ep_rank = (1, 0) if groups is None else (groups.ep_size, groups.ep_rank)
        per_rank = num_experts // ep_size
        local_ids = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        self.experts = nn.ModuleDict({
            str(e): nn.Sequential(_seeded_linear(hidden, ffn, seed + 100 + 2 * e), nn.Tanh(),
                                  _seeded_linear(ffn, hidden, seed + 101 + 2 * e)) for e in local_ids})
        for param in self.experts.parameters():
            param.allreduce = False  # megatron-core's expert-parallel marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        weight, expert_id = torch.softmax(self.router(h), dim=-1).max(dim=-1)
        tokens = h.shape[0]
        if self.groups is not None:
            group = self.groups.ep_group
            h_all = torch.cat(dist_fn.all_gather(h, group=group))
            weight_all = torch.cat(dist_fn.all_gather(weight, group=group))
            ids = [torch.empty_like(expert_id) for _ in range(self.groups.ep_size)]
            dist.all_gather(ids, expert_id, group=group)
            expert_id = torch.cat(ids)
        else:
            h_all, weight_all = h, weight
        combined = torch.zeros_like(h_all)
        for key, expert in self.experts.items():
            index = (expert_id == int(key)).nonzero().flatten()
            combined = combined.index_add(0, index, weight_all[index, None] * expert(h_all[index]))
        if self.groups is not None:
            combined = dist_fn.all_reduce(combined, group=self.groups.ep_group)
            combined = combined[self.groups.ep_rank * tokens:(self.groups.ep_rank + 1) * tokens]
        return h + combined


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


class ExpertDataParallelOptimizer:
    """Wraps a torch optimizer; ``step()`` = finalise gradients (module docstring), clip by
    the global norm as Megatron does (``clip_grad > 0``), then the inner ``optimizer.step()``.

    ``gradient_scaling()`` reports the factors of the current step (the GradientDumper protocol).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups: ExpertParallelGroups,
                 clip_grad: float = 0.0) -> None:
        self.optimizer = optimizer
        self.groups = groups
        self.clip_grad = clip_grad
        self.dense_grad_factor = 1.0
        self.expert_grad_factor = groups.expert_dp_size / groups.dp_size
        self._grad_norm: float | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def finalize_grads(self) -> None:
        for param in self._params():
            expert = is_expert(param)
            factor = self.expert_grad_factor if expert else self.dense_grad_factor
            if factor != 1.0:
                param.grad.mul_(factor)
            group = self.groups.expert_dp_group if expert else self.groups.dp_group
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=group)

    @torch.no_grad()
    def clip(self) -> None:
        """Megatron's clip formula; total norm over dense (once) and experts (summed over the EP group)."""
        params = self._params()
        dense_sq = sum(float(p.grad.double().pow(2).sum()) for p in params if not is_expert(p))
        expert_sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in params if is_expert(p))],
                                 dtype=torch.float64)
        dist.all_reduce(expert_sq, group=self.groups.ep_group)
        self._grad_norm = math.sqrt(dense_sq + float(expert_sq))
        coefficient = megatron_clip_coefficient(self.clip_grad, self._grad_norm)
        if coefficient < 1.0:
            for param in params:
                param.grad.mul_(coefficient)

    def step(self) -> None:
        self.finalize_grads()
        self._grad_norm = None
        if self.clip_grad > 0.0:
            self.clip()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def gradient_scaling(self) -> GradientScaling:
        return GradientScaling(dp_size=self.groups.dp_size, expert_dp_size=self.groups.expert_dp_size,
                               dense_grad_factor=self.dense_grad_factor, expert_grad_factor=self.expert_grad_factor,
                               reduce_op="avg", loss_scale=1.0,
                               clip_coefficient=megatron_clip_coefficient(self.clip_grad, self._grad_norm),
                               grad_norm=self._grad_norm, source="optimizer")

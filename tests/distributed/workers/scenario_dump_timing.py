"""Dump-timing trap: expert gradients change inside the optimizer step (expert-DP scaling).

Per rank: one step of :class:`TinyMoE` with experts split over 2 ranks (DP 2, expert-DP 1,
expert factor 1/2). A naive dump right after ``backward()`` and the GradientDumper's pre-hook
dump are compared; the step is replayed from each; then a second step with clipping checks the
recorded clip coefficient. Rank 0 also computes the single-process reference gradient.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from expert_parallel import ExpertDataParallelOptimizer, TinyMoE, build_expert_parallel_groups, is_expert
from replay import StepSnapshot, bitwise_equal, max_abs_difference

from megatron_vllm_align.guards import GradientDumper, load_gradient_dump
from megatron_vllm_align.guards.dump_format import read_rank_dump
from megatron_vllm_align.validation.grad_metrics import grad_metrics

HIDDEN, FFN, EXPERTS, TOKENS = 8, 16, 4, 16


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1000 * step + rank))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _reference_grads(world: int) -> dict[str, torch.Tensor]:
    """Gradient of the mean over ranks of each rank's loss, all experts in one process."""
    model = TinyMoE(HIDDEN, FFN, EXPERTS, groups=None)
    loss = sum(_loss(model(_batch(rank, 0))) for rank in range(world)) / world
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def run(out: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_expert_parallel_groups(ep_size=world)
    model = TinyMoE(HIDDEN, FFN, EXPERTS, groups=groups)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    optimizer = ExpertDataParallelOptimizer(inner, groups)
    dumper = GradientDumper(optimizer, out / "prehook", every=1, model=model)
    naive = GradientDumper(optimizer, out / "naive", model=model)
    naive.remove()  # used by hand, right after backward

    _loss(model(_batch(rank, 0))).backward()
    naive.dump(0)
    snapshot = StepSnapshot(model, inner)
    optimizer.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()

    dump = load_gradient_dump(out / "prehook", 0)
    _, naive_pieces = read_rank_dump(out / "naive", 0, rank)
    local = [n for n, _ in model.named_parameters()]
    experts = [n for n, p in model.named_parameters() if is_expert(p)]
    naive_grads = {n: naive_pieces[n] for n in local}
    used_grads = {n: dump.grads[n] for n in local}
    ratios = torch.cat([(naive_grads[n].double() / used_grads[n].double())[used_grads[n] != 0] for n in experts])
    result = {
        "expert_names": experts,
        "recorded_scaling": dump.scaling.to_dict(),
        "record_is_expert": {n: dump.records[n].is_expert for n in local},
        "record_grad_factor": {n: dump.records[n].grad_factor for n in local},
        "expert_ratio_min": float(ratios.min()), "expert_ratio_max": float(ratios.max()),
        "expert_naive_is_exactly_ratio_times_used": all(
            torch.equal(naive_grads[n], used_grads[n] * (groups.dp_size / groups.expert_dp_size)) for n in experts),
        "replay_from_prehook_bitwise": bitwise_equal(snapshot.replay(used_grads), after),
        "replay_from_naive_bitwise": bitwise_equal(snapshot.replay(naive_grads), after),
        "replay_from_naive_max_abs_param_diff": max_abs_difference(snapshot.replay(naive_grads), after),
    }
    if rank == 0:
        reference = _reference_grads(world)
        result["prehook_vs_reference_rel_l2"] = max(
            grad_metrics(dump.grads[n], reference[n]).rel_l2 for n in reference)
        ratios_to_reference = [grad_metrics(naive_grads[n], reference[n]).norm_ratio for n in experts]
        result["naive_experts_vs_reference_norm_ratio"] = sorted(
            {round(r, 6) for r in ratios_to_reference if r is not None})

    # second step, clipped: the recorded coefficient is the one applied, and the replay still holds
    optimizer.clip_grad = 1e-3
    optimizer.zero_grad()
    _loss(model(_batch(rank, 1))).backward()
    snapshot = StepSnapshot(model, inner)
    optimizer.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    clipped = load_gradient_dump(out / "prehook", 1)
    result["clipped_scaling"] = clipped.scaling.to_dict()
    result["clipped_replay_bitwise"] = bitwise_equal(snapshot.replay({n: clipped.grads[n] for n in local}), after)
    result["dumped_steps"] = dumper.dumped_steps
    if rank == 0:
        print(f"[dump timing] expert grad, naive dump after backward / pre-hook dump: "
              f"min {result['expert_ratio_min']} max {result['expert_ratio_max']} "
              f"(recorded expert_grad_factor {dump.scaling.expert_grad_factor}); step replayed from pre-hook dump "
              f"bitwise equal: {result['replay_from_prehook_bitwise']}; from naive dump: "
              f"{result['replay_from_naive_bitwise']} (max |param diff| "
              f"{result['replay_from_naive_max_abs_param_diff']:.3e})", flush=True)
    return result

"""FSDP2 trap: after a forward-only pass the root module stays unsharded.

Per rank: a 2-layer MLP with ``fully_shard`` on the first layer and on the root (uneven row
shards: 7 rows over 2 ranks). After a no-grad forward, the root's parameters fetched by name
are compute copies: perturbing one does not reach the sharded master, and the identity check
reports it (and an optimizer built in that state). After ``reshard()`` the check is clean; one
training step's dump, reassembled from both ranks' shards, is compared with a single-process
reference gradient of the same model and data.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from megatron_vllm_align.guards import GradientDumper, check_optimizer_identity, load_gradient_dump
from megatron_vllm_align.validation.grad_metrics import grad_metrics

IN, HIDDEN, OUT, TOKENS = 6, 7, 5, 10


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(rank))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def _kinds(findings: list) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {}
    for finding in findings:
        kinds.setdefault(finding.kind, []).append(finding.name)
    return kinds


def run(out: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference_model = _model()
    model = copy.deepcopy(reference_model)
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    result: dict = {}

    with torch.no_grad():
        model(_batch(rank))
    by_name = dict(model.named_parameters())
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    result["by_name_is_dtensor"] = {n: isinstance(p, DTensor) for n, p in by_name.items()}
    result["by_name_in_optimizer"] = {n: id(p) in stepped for n, p in by_name.items()}
    result["findings_after_forward_only"] = _kinds(check_optimizer_identity(model, optimizer))
    late_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built from the compute copies
    result["findings_optimizer_built_unsharded"] = _kinds(check_optimizer_identity(model, late_optimizer))
    del late_optimizer

    root_weight = model[2].weight  # the sharded master lives in the optimizer
    master = next(p for p in optimizer.param_groups[0]["params"] if p.shape == root_weight.shape)
    master_before = master.to_local().clone()
    with torch.no_grad():
        by_name["2.weight"].add_(1.0)  # "perturb the parameter by name"
    model.reshard()
    result["perturbation_reached_master"] = not torch.equal(master.to_local(), master_before)
    result["findings_after_reshard"] = _kinds(check_optimizer_identity(model, optimizer))
    result["findings_with_forward"] = _kinds(check_optimizer_identity(model, optimizer,
                                                                    forward=lambda: model(_batch(rank))))
    result["resharded_after_check"] = all(isinstance(p, DTensor) for p in model.parameters())

    dumper = GradientDumper(optimizer, out / "dump", every=1, model=model)
    model(_batch(rank)).pow(2).mean().backward()
    optimizer.step()
    dist.barrier()
    dump = load_gradient_dump(out / "dump", 0)
    reference_loss = sum(reference_model(_batch(r)).pow(2).mean() for r in range(world)) / world
    reference_loss.backward()
    metrics = {n: grad_metrics(dump.grads[n], p.grad) for n, p in reference_model.named_parameters()}
    result["dump_names"] = sorted(dump.grads)
    result["dump_placements"] = {n: r.placement["kind"] for n, r in dump.records.items()}
    result["dump_vs_reference"] = {n: {"max_abs_err": m.max_abs_err, "rel_l2": m.rel_l2} for n, m in metrics.items()}
    result["dumped_steps"] = dumper.dumped_steps
    if rank == 0:
        worst = max(m.rel_l2 for m in metrics.values())
        print(f"[fsdp2] name->DTensor after forward-only: {result['by_name_is_dtensor']}; perturbation reached "
              f"master: {result['perturbation_reached_master']}; reassembled dump vs single-process reference: "
              f"worst rel_l2 {worst:.3e}", flush=True)
    return result

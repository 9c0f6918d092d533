"""Freeze trap under FSDP2 + AdamW with weight decay.

Three layers, each ``fully_shard``-ed: layer 0 "frozen" by zeroing its gradient (wrong),
layer 1 frozen with ``requires_grad_(False)`` (grad None), layer 2 left out of the optimizer.
After one ordinary step (AdamW state exists), the second step runs inside ``validate_freeze``.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from megatron_vllm_align.guards import FreezeViolation, validate_freeze

FROZEN = ["0.weight", "1.weight", "2.weight"]


def run(out: Path) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3))
    model[1].weight.requires_grad_(False)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    trained = [p for n, p in model.named_parameters() if p.requires_grad and n != "2.weight"]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))

    model(batch).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    model[0].weight.grad.zero_()
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    result: dict = {"raised": False}
    try:
        with validate_freeze(model, optimizer, FROZEN):
            optimizer.step()
    except FreezeViolation as violation:
        result["raised"] = True
        result["message"] = str(violation)
        result["reports"] = {r.name: {"max_abs_change": r.max_abs_change, "moved": r.moved, "reasons": list(r.reasons)}
                             for r in violation.reports}
    after = {n: p.to_local() for n, p in model.named_parameters()}
    result["bitwise_unchanged"] = {n: torch.equal(before[n], after[n]) for n in FROZEN}
    result["local_max_abs_change"] = {n: float((after[n] - before[n]).abs().max()) for n in FROZEN}
    if rank == 0:
        print(f"[freeze] {result.get('message', 'no violation')}".replace("\n", " "), flush=True)
    return result

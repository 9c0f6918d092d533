"""Incomplete dump: rank 1 cannot move its tensor file into place (the path is taken by a
folder), rank 0 writes normally.

Rank 1's step must fail with GradientDumpError and leave no index and no temporary file;
loading the step must then fail naming the missing rank.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megatron_vllm_align.guards import GradientDumper, GradientDumpError, load_gradient_dump
from megatron_vllm_align.guards.dump_format import index_path, tensor_path


def run(out: Path) -> dict:
    rank = dist.get_rank()
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    directory = out / "dump"
    dumper = GradientDumper(optimizer, directory, model=model)
    if rank == 1:
        tensor_path(directory, 0, rank).mkdir(parents=True)
    dist.barrier()
    model(torch.ones(3, 4)).sum().backward()
    result: dict = {"step_error": None, "load_error": None}
    try:
        optimizer.step()
    except GradientDumpError as error:
        result["step_error"] = str(error)
    dist.barrier()
    try:
        load_gradient_dump(directory, 0)
    except GradientDumpError as error:
        result["load_error"] = str(error)
    folder = index_path(directory, 0, rank).parent
    result["files"] = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    result["dumped_steps"] = dumper.dumped_steps
    return result

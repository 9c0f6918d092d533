"""Process-group setup for training runs and the data-parallel gradient reduction.

Launched by ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment): the default process
group is created from the environment, gloo on CPU and NCCL on GPU (the GPU path is code only,
not exercised on these machines), then Megatron's model-parallel state with all model-parallel
sizes 1 (every rank is a data-parallel replica). Without torchrun: a one-process gloo world
(:func:`~megatron_vllm_align.megatron.cpu_compat.init_single_process_cpu`).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_vllm_align.megatron.cpu_compat import enable_cpu_compat, init_single_process_cpu


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's rank, the world size and the torch.distributed backend."""

    rank: int
    world_size: int
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(seed: int) -> DistEnv:
    """Set up torch.distributed and Megatron's parallel state (module docstring); seed every RNG
    with `seed` when the state is created here. Idempotent."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        enable_cpu_compat()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed)
    else:
        init_single_process_cpu(seed)
    return DistEnv(dist.get_rank(), dist.get_world_size(), dist.get_backend())


def all_reduce_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """Sum every parameter's gradient over the data-parallel world, in one fp32 buffer.

    The loss is already normalised by the global token count, so the sum is the global
    gradient. A missing gradient counts as zero (and is materialised). No-op for one rank.
    """
    if world_size == 1:
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    flat = torch.cat([param.grad.reshape(-1).float() for param in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param in params:
        count = param.numel()
        param.grad.copy_(flat[offset:offset + count].view_as(param.grad))
        offset += count


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()

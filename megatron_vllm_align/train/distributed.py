"""Process-group setup for training runs and the data-parallel gradient reduction.

Launched by ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment): the default process
group is created from the environment, gloo on CPU and NCCL on GPU (the GPU path is code only,
not exercised on these machines), then Megatron's model-parallel state with the recipe's tensor
parallel size T (``parallel.tensor_model_parallel_size``; pipeline 1): ranks form T-rank tensor-parallel
groups and ``world / T`` data-parallel replicas. Expert parallel size E = T > 1
(``parallel.expert_model_parallel_size``, expert tensor parallel 1) splits the routed experts over
each tensor-parallel group; its expert-data-parallel groups are then the data-parallel groups. Without torchrun: a
one-process gloo world (:func:`~megatron_vllm_align.megatron.cpu_compat.init_single_process_cpu`).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_vllm_align.megatron.cpu_compat import enable_cpu_compat, init_single_process_cpu
from megatron_vllm_align.utils.dtensors import is_dtensor


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's rank, the world size and the torch.distributed backend."""

    rank: int
    world_size: int
    backend: str
    tensor_parallel_size: int = 1
    data_parallel_rank: int = 0
    expert_parallel_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model: world size / tensor parallel size."""
        return self.world_size // self.tensor_parallel_size

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Megatron's data-parallel group (None for one replica: nothing to reduce)."""
        return parallel_state.get_data_parallel_group() if self.data_parallel_size > 1 else None


def init_distributed(seed: int, tensor_parallel_size: int = 1, expert_parallel_size: int = 1) -> DistEnv:
    """Set up torch.distributed and Megatron's parallel state (module docstring); seed every RNG
    with `seed` when the state is created here. Idempotent. RuntimeError when the world size is not a
    multiple of `tensor_parallel_size` (or a one-process run asks for more than 1), or an existing
    parallel state has other sizes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tensor_parallel_size:
        raise RuntimeError(f"parallel.tensor_model_parallel_size={tensor_parallel_size} does not divide the world "
                           f"size {world} (launch torchrun with a multiple of it)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        enable_cpu_compat()
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        experts = {"expert_model_parallel_size": expert_parallel_size, "expert_tensor_parallel_size": 1} \
            if expert_parallel_size > 1 else {}
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                                     pipeline_model_parallel_size=1, **experts)
            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed)
        else:
            have = (parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_expert_model_parallel_world_size())
            if have != (tensor_parallel_size, expert_parallel_size):
                raise RuntimeError(f"megatron's parallel state has tensor / expert parallel sizes {have}, the "
                                   f"recipe asks for {(tensor_parallel_size, expert_parallel_size)}")
    else:
        init_single_process_cpu(seed)
    return DistEnv(dist.get_rank(), dist.get_world_size(), dist.get_backend(), tensor_parallel_size,
                   parallel_state.get_data_parallel_rank(), expert_parallel_size)


def all_reduce_gradients(params: list[torch.nn.Parameter], world_size: int,
                         group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over the `world_size` data-parallel ranks of `group` (None: the
    default group), in one fp32 buffer.

    The loss is already normalised by the global token count, so the sum is the global
    gradient. A missing gradient counts as zero (and is materialised). No-op for one rank.
    """
    if world_size == 1:
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    flat = torch.cat([param.grad.reshape(-1).float() for param in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for param in params:
        count = param.numel()
        param.grad.copy_(flat[offset:offset + count].view_as(param.grad))
        offset += count


def full_parameter_sums(sums: list[torch.Tensor], params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Per-parameter 0-d sums of one dtype (e.g. squared gradient elements), each taken over this rank's
    part of its parameter, as sums over each FULL parameter: an FSDP2-sharded parameter's (a DTensor: the
    sum was over ``to_local()``) is all-reduced over its mesh, a tensor-parallel shard's over Megatron's
    tensor-parallel group, an expert-parallel parameter's (``allreduce = False``: this rank's experts) over the
    expert-model-parallel group, a replicated parameter's is kept (each rank holds all of it). Collective;
    identity in one process."""
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return sums
    out = list(sums)
    sharded = [i for i, p in enumerate(params) if is_dtensor(p)]
    unsharded = [(i, p) for i, p in enumerate(params) if i not in sharded]
    for group, parts in ((parallel_state.get_tensor_model_parallel_group(),
                          [i for i, p in unsharded if getattr(p, "tensor_model_parallel", False)
                           and getattr(p, "allreduce", True)]),
                         (parallel_state.get_expert_model_parallel_group(),
                          [i for i, p in unsharded if getattr(p, "allreduce", True) is False]),
                         (params[sharded[0]].device_mesh.get_group() if sharded else None, sharded)):
        if parts and group.size() > 1:
            stacked = torch.stack([sums[i] for i in parts])
            dist.all_reduce(stacked, group=group)
            for j, i in enumerate(parts):
                out[i] = stacked[j]
    return out


def _alone(group: dist.ProcessGroup | None) -> bool:
    return group is None or not dist.is_initialized() or dist.get_world_size(group) == 1


def gather_to_first(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The ``group`` ranks' ``tensor`` concatenated along ``dim`` in group-rank order, on the group's first
    rank (None on the others); the sizes along ``dim`` may differ between ranks, the other sizes and the
    dtype may not. ``tensor`` itself for no group or a group of one. Collective over ``group``."""
    if _alone(group):
        return tensor
    dim %= tensor.dim()
    size = torch.tensor([tensor.shape[dim]])
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = tensor.contiguous()
    if tensor.shape[dim] < longest:
        fill = list(padded.shape)
        fill[dim] = longest - tensor.shape[dim]
        padded = torch.cat([padded, padded.new_zeros(fill)], dim)
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(padded) for _ in sizes] if first else None
    dist.gather(padded, parts, group=group, group_dst=0)
    return torch.cat([part.narrow(dim, 0, int(n)) for part, n in zip(parts, sizes)], dim) if first else None


def sum_to_first(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The sum of the ``group`` ranks' ``tensor`` (in its dtype) on the group's first rank (None on the
    others; ``tensor`` is not modified). ``tensor`` itself for no group or a group of one. Collective."""
    if _alone(group):
        return tensor
    total = tensor.detach().clone()
    dist.reduce(total, group=group, group_dst=0)
    return total if dist.get_rank(group) == 0 else None


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()

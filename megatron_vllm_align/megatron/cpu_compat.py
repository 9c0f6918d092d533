"""Run megatron-core 0.16.x forward and backward on a machine without CUDA.

megatron-core assumes a CUDA device in places a CPU-only GPTModel (local spec,
``use_cpu_initialization=True``) reaches in forward and backward. Each :class:`CpuPatch` changes one
megatron-core object at the narrowest point that removes the assumption, only while CUDA is
unavailable: :data:`PATCHES` (installed by :func:`enable_cpu_compat`'s default) and :data:`MOE_PATCHES`
(Megatron's native MoE router; ``build_gpt_from_hf`` installs them for a native MoE model). Patches are
idempotent and undoable (:func:`disable_cpu_compat`, :func:`cpu_patches`); a megatron-core outside
0.16.x is refused (:class:`UnsupportedMegatronVersion`) before anything is patched. Not patched: DDP
buffers and distributed optimizers (use ``torch.optim``, FSDP2 to shard). Each patch's target and
reason: docs/megatron_facts.md#cpu-compatibility-patches-megatroncpu_compatpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import package_info, parallel_state
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import mappings as tp_mappings
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.tensor_parallel.random import (
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import Router
from megatron.core.utils import GlobalMemoryBuffer

SUPPORTED_MEGATRON_SERIES = "0.16."


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not a version this compatibility layer was written for."""


def cpu_compat_required() -> bool:
    """True when the patches are needed, i.e. torch sees no CUDA device."""
    return not torch.cuda.is_available()


def check_megatron_version(version: str | None = None) -> str:
    """Return megatron-core's version (or `version`); raise UnsupportedMegatronVersion unless 0.16.x."""
    if version is None:
        version = package_info.__version__
    if not version.startswith(SUPPORTED_MEGATRON_SERIES):
        raise UnsupportedMegatronVersion(
            f"megatron_vllm_align.megatron.cpu_compat targets megatron-core {SUPPORTED_MEGATRON_SERIES}x "
            f"internals, found megatron-core {version}; re-check each patched function before widening"
        )
    return version


class CpuRNGStatesTracker(CudaRNGStatesTracker):
    """Megatron's RNG-states tracker with named CPU generator states (see module docstring).

    Only ``add`` and ``fork`` differ from ``CudaRNGStatesTracker``: a state is
    ``torch.Generator().manual_seed(seed).get_state()``, and ``fork`` swaps it into the
    default CPU generator for the duration of the block and saves where it ended.
    """

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"CpuRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CpuRNGStatesTracker.add: rng state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"CpuRNGStatesTracker.fork: rng state {name!r} was never added (seed it first)")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


# --- the patches: each `_apply_*` installs one patch and returns the function that undoes it ---


def _apply_global_memory_buffer() -> Callable[[], None]:
    original = GlobalMemoryBuffer.get_tensor

    @functools.wraps(original)
    def get_tensor_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = functools.reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required_len:
            self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        return original(self, tensor_shape, dtype, name, mem_alloc_context)

    GlobalMemoryBuffer.get_tensor = get_tensor_on_cpu
    return lambda: setattr(GlobalMemoryBuffer, "get_tensor", original)


def _apply_rotary_embedding() -> Callable[[], None]:
    original = RotaryEmbedding.get_emb

    @functools.wraps(original)
    def get_emb_on_own_device(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [seq, 1, 1, dim]

    RotaryEmbedding.get_emb = get_emb_on_own_device
    return lambda: setattr(RotaryEmbedding, "get_emb", original)


def _apply_causal_mask() -> Callable[[], None]:
    original = fused_softmax.get_default_causal_mask

    @functools.wraps(original)
    def causal_mask_on_cpu(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = causal_mask_on_cpu
    return lambda: setattr(fused_softmax, "get_default_causal_mask", original)


@functools.cache
def _process_cpu_rng_tracker() -> CpuRNGStatesTracker:
    """One tracker per process, so that disabling and re-enabling the patch keeps its seeded states."""
    return CpuRNGStatesTracker()


def _apply_rng_tracker() -> Callable[[], None]:
    saved = (megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    megatron_random._CUDA_RNG_STATE_TRACKER = _process_cpu_rng_tracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def undo() -> None:
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved

    return undo


def _apply_checkpoint_rng_states() -> Callable[[], None]:
    saved = (megatron_random._get_all_rng_states, megatron_random._set_all_rng_states)

    def get_all_rng_states_on_cpu() -> tuple[torch.Tensor, None, dict]:
        return torch.get_rng_state(), None, megatron_random.get_cuda_rng_tracker().get_states()

    def set_all_rng_states_on_cpu(cpu_rng_state: torch.Tensor, cuda_rng_state: None, tracker_states: dict) -> None:
        torch.set_rng_state(cpu_rng_state)
        megatron_random.get_cuda_rng_tracker().set_states(tracker_states)

    megatron_random._get_all_rng_states = get_all_rng_states_on_cpu
    megatron_random._set_all_rng_states = set_all_rng_states_on_cpu

    def undo() -> None:
        megatron_random._get_all_rng_states, megatron_random._set_all_rng_states = saved

    return undo


def _apply_tp_gather_last_dim() -> Callable[[], None]:
    original = tp_mappings._gather_along_last_dim

    @functools.wraps(original)
    def gather_along_last_dim_in_place(input_: torch.Tensor, group: Any) -> torch.Tensor:
        world_size = group.size()
        if world_size == 1:
            return input_
        output = torch.empty((input_.shape[0] * world_size, *input_.shape[1:]), dtype=input_.dtype,
                             device=input_.device)
        dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
        return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()

    tp_mappings._gather_along_last_dim = gather_along_last_dim_in_place
    return lambda: setattr(tp_mappings, "_gather_along_last_dim", original)


def _apply_moe_router_gating() -> Callable[[], None]:
    original = Router.gating

    @functools.wraps(original)
    def gating_in_place(self, input: torch.Tensor) -> torch.Tensor:
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, router_dtype)

    Router.gating = gating_in_place
    return lambda: setattr(Router, "gating", original)


def _apply_moe_router_gemm() -> Callable[[], None]:
    if hasattr(moe_utils, "te_general_gemm"):  # Transformer Engine imported: nothing to define
        return lambda: None
    moe_utils.te_general_gemm = None
    return lambda: delattr(moe_utils, "te_general_gemm")


@dataclasses.dataclass(frozen=True)
class CpuPatch:
    """One compatibility patch: its name, the megatron-core object it changes, and why."""

    name: str
    target: str
    reason: str
    apply: Callable[[], Callable[[], None]] = dataclasses.field(repr=False, compare=False)


PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch(
        "global_memory_buffer",
        "megatron.core.utils.GlobalMemoryBuffer.get_tensor",
        "allocates its buffer on torch.cuda.current_device()",
        _apply_global_memory_buffer,
    ),
    CpuPatch(
        "rotary_embedding",
        "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb",
        "moves inv_freq to torch.cuda.current_device()",
        _apply_rotary_embedding,
    ),
    CpuPatch(
        "causal_mask",
        "megatron.core.fusions.fused_softmax.get_default_causal_mask",
        'builds the causal mask with device="cuda"',
        _apply_causal_mask,
    ),
    CpuPatch(
        "rng_tracker",
        "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
        "DotProductAttention forks CUDA RNG states for dropout",
        _apply_rng_tracker,
    ),
    CpuPatch(
        "checkpoint_rng_states",
        "megatron.core.tensor_parallel.random._get_all_rng_states / _set_all_rng_states",
        "activation recompute saves and restores torch.cuda's generator state",
        _apply_checkpoint_rng_states,
    ),
    CpuPatch(
        "tp_gather_last_dim",
        "megatron.core.tensor_parallel.mappings._gather_along_last_dim",
        "allocates the all-gather output on torch.cuda.current_device()",
        _apply_tp_gather_last_dim,
    ),
)
MOE_PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch(
        "moe_router_gating",
        "megatron.core.transformer.moe.router.Router.gating",
        "moves the router weight to torch.cuda.current_device()",
        _apply_moe_router_gating,
    ),
    CpuPatch(
        "moe_router_gemm",
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        "router_gating_linear reads a name that exists only with Transformer Engine",
        _apply_moe_router_gemm,
    ),
)
_PATCHES_BY_NAME = {patch.name: patch for patch in PATCHES + MOE_PATCHES}
_undo_by_name: dict[str, Callable[[], None]] = {}


def _checked_names(names: Iterable[str] | None) -> list[str]:
    if names is None:
        return [patch.name for patch in PATCHES]
    names = list(names)
    unknown = [name for name in names if name not in _PATCHES_BY_NAME]
    if unknown:
        raise ValueError(f"cpu_compat: unknown patch names {unknown}; known: {list(_PATCHES_BY_NAME)}")
    return names


def active_patches() -> tuple[CpuPatch, ...]:
    """The patches currently installed, in PATCHES + MOE_PATCHES order."""
    return tuple(patch for patch in PATCHES + MOE_PATCHES if patch.name in _undo_by_name)


def enable_cpu_compat(names: Iterable[str] | None = None) -> tuple[CpuPatch, ...]:
    """Install the patches `names` (default: PATCHES, not MOE_PATCHES) if CUDA is unavailable;
    return the active patches.

    Idempotent: an installed patch is not installed twice. With CUDA available nothing is
    patched and () is returned. Raises UnsupportedMegatronVersion on a megatron-core other
    than 0.16.x, before patching anything.
    """
    names = _checked_names(names)
    if not cpu_compat_required():
        return ()
    check_megatron_version()
    for name in names:
        if name not in _undo_by_name:
            _undo_by_name[name] = _PATCHES_BY_NAME[name].apply()
    return active_patches()


def disable_cpu_compat(names: Iterable[str] | None = None) -> tuple[CpuPatch, ...]:
    """Undo the patches `names` (default: all, MOE_PATCHES included) that are installed; return the
    patches still active."""
    for name in reversed(list(_PATCHES_BY_NAME) if names is None else _checked_names(names)):
        undo = _undo_by_name.pop(name, None)
        if undo is not None:
            undo()
    return active_patches()


@contextlib.contextmanager
def cpu_patches(names: Iterable[str] | None = None) -> Iterator[tuple[CpuPatch, ...]]:
    """Exactly the patches `names` (default: PATCHES) are active inside the block; the previous set after."""
    names = set(_checked_names(names))
    before = {patch.name for patch in active_patches()}
    disable_cpu_compat(before - names)
    try:
        yield enable_cpu_compat(sorted(names))
    finally:
        disable_cpu_compat(names - before)
        enable_cpu_compat(sorted(before))


def seed_cpu_rng(seed: int) -> None:
    """Seed like Megatron's ``_set_random_seed`` for world size 1: CPU generator + tracker states.

    Calls ``torch.manual_seed(seed)`` and megatron-core's own ``model_parallel_cuda_manual_seed``,
    which on CPU fills the installed CpuRNGStatesTracker (needs the rng_tracker patch on CPU).
    """
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_single_process_cpu(seed: int = 1234) -> bool:
    """Prepare a one-process CPU run: gloo process group, model parallel state (all sizes 1), patches.

    Returns True when it initialised the model-parallel state now (and then seeded with
    `seed` via :func:`seed_cpu_rng`); False when that state already existed, in which case
    only the (idempotent) patches are ensured. Megatron state whose torch.distributed world was
    destroyed under it (an in-process vLLM engine's shutdown calls ``destroy_process_group``)
    is rebuilt. Raises RuntimeError if torch.distributed is already initialised with more than
    one rank: use megatron's initialize_model_parallel there.
    """
    enable_cpu_compat()
    if parallel_state.model_parallel_is_initialized() and not dist.is_initialized():
        parallel_state.destroy_model_parallel()
    if parallel_state.model_parallel_is_initialized():
        return False
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(
            f"init_single_process_cpu: torch.distributed already has world size {dist.get_world_size()}; "
            "call megatron.core.parallel_state.initialize_model_parallel yourself"
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    seed_cpu_rng(seed)
    return True

"""The one place that sets up vLLM's configuration context for the visible kernels.

vLLM picks a layer's implementation from its current ``VllmConfig`` and its worker setup, so a layer
built outside that context can run another kernel than the engine. :func:`engine_vllm_config` asks
vLLM's own ``EngineArgs(..., enforce_eager=True).create_engine_config()`` for the model the engine
serves, as ``LLM(...)`` resolves it; no engine is started (what it resolves:
docs/engine_facts.md#configuration-the-engine-resolves). :meth:`VllmContext.active` enters that context
as a vLLM worker does: the config current, the IR-op priority and torch-wrap switch installed (scoped),
the model dtype as torch's default while layers are built, and on request vLLM's distributed state at
tensor and pipeline parallel size 1. That state coexists with Megatron's ``torch.distributed`` in either
order: initialised first (any world size; every rank must activate, each rank its own replica), or not
(a one-process world on an in-memory store that Megatron then adopts). A multi-process run
(``WORLD_SIZE`` > 1) that has not initialised torch.distributed first is refused (``RuntimeError``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_vllm_align import invariance

_DTYPES = ("bfloat16", "float16", "float32")
# Per thread: the (context, parallel_state) of each VllmContext.active() entered and not yet left, innermost last.
_ENTERED = threading.local()


@dataclass(frozen=True)
class EngineSpec:
    """What the rollout engine serves; ``enforce_eager=True`` is implied (the aligned mode).

    model: a Hugging Face model directory (``config.json`` is all that is read here).
    dtype: the engine's ``dtype`` argument.
    quantization: the engine's ``quantization`` argument (e.g. ``"fp8_per_channel"``) or None.
    tensor_parallel_size: the engine's ``tensor_parallel_size`` when the trainer runs another layout
        (:mod:`megatron_vllm_align.megatron.engine_layout`); None: the trainer's own. The shadow layers
        built from this context are TP = 1 layers either way.
    """

    model: str
    dtype: str = "bfloat16"
    quantization: str | None = None
    tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"EngineSpec.model must be a model directory with a config.json, got {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineSpec.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"EngineSpec.quantization must be a string or None, got {self.quantization!r}")
        size = self.tensor_parallel_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"EngineSpec.tensor_parallel_size must be a positive int or None, got {size!r}")


def engine_vllm_config(spec: EngineSpec) -> Any:
    """The ``VllmConfig`` that ``LLM(model, dtype, quantization, enforce_eager=True)`` resolves.

    Side effect of vLLM's platform hook (as in the engine): it sets a few ``VLLM_*`` /
    thread-count environment variables of this process.
    """
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=spec.model, dtype=spec.dtype, quantization=spec.quantization,
                      enforce_eager=True, skip_tokenizer_init=True)
    return args.create_engine_config()


def ensure_vllm_parallel_state() -> None:
    """Initialise vLLM's distributed state with TP = PP = 1 (idempotent; see module docstring).

    Must run inside ``set_current_vllm_config`` (vLLM reads the config while building groups).
    """
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pp_group().world_size
        if (tp, pp) != (1, 1):
            raise RuntimeError(f"vLLM's parallel state is already initialised with TP={tp}, PP={pp}; "
                               "the visible kernels need TP = PP = 1")
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
        ensure_expert_group(model_config is not None and model_config.is_moe)
        return
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            raise RuntimeError(f"WORLD_SIZE={world}: initialise torch.distributed (e.g. Megatron) "
                               "before activating the vLLM context in a multi-process run")
        dist.init_process_group(backend=current_platform.dist_backend, store=dist.HashStore(),
                                rank=0, world_size=1)
    parallel_state.init_distributed_environment(
        world_size=dist.get_world_size(), rank=dist.get_rank(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")), backend=current_platform.dist_backend)
    parallel_state.ensure_model_parallel_initialized(1, 1)


def ensure_expert_group(is_moe: bool) -> None:
    """Add vLLM's expert-parallel group (each rank alone, as with TP = 1) when vLLM's parallel state
    already exists without it and an MoE model is about to be built (by a context or an engine in
    this process). vLLM builds that group only at first initialisation and only for MoE models, and
    has no public call to add it later, so this sets ``parallel_state._EP``. Collective: every rank
    must call it."""
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    if not is_moe or not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return
    ranks = [[rank] for rank in range(dist.get_world_size())]
    parallel_state._EP = parallel_state.init_model_parallel_group(
        ranks, parallel_state.get_world_group().local_rank, current_platform.dist_backend, group_name="ep")


class VllmContext:
    """vLLM's production configuration for one :class:`EngineSpec` (build with :func:`vllm_context`)."""

    def __init__(self, spec: EngineSpec) -> None:
        if not isinstance(spec, EngineSpec):
            raise TypeError(f"spec must be an EngineSpec, got {type(spec).__name__}")
        self.spec = spec
        if invariance.requested():
            invariance.install()
        self.vllm_config = engine_vllm_config(spec)

    @property
    def model_dtype(self) -> torch.dtype:
        """The engine's model dtype (the dtype of deployed weights and activations)."""
        return self.vllm_config.model_config.dtype

    @property
    def quant_config(self) -> Any:
        """vLLM's quantization config for the model (None when unquantized)."""
        return self.vllm_config.quant_config

    @contextlib.contextmanager
    def active(self, parallel_state: bool = False, building: bool = False) -> Iterator[None]:
        """Run vLLM layers as the engine's worker would: current config, IR-op priority and
        torch-wrap switch installed. ``parallel_state=True`` also ensures vLLM's TP=1 groups.
        ``building=True`` is for constructing layers and processing their weights: like vLLM's
        model loader it makes the model dtype torch's default dtype and the model device the
        default device (vLLM layers read both when built, e.g. the FP8 methods' output dtype).
        Directly inside an ``active()`` of this same context on this thread that already covers the call
        (not building; the parallel state ensured if asked) it enters nothing again: all of it is
        installed (a vLLM-forward layer enters once for its kernels, ``megatron.vllm_layers``)."""
        entered = _ENTERED.__dict__.setdefault("stack", [])
        if not building and entered and entered[-1][0] is self and (entered[-1][1] or not parallel_state):
            yield
            return
        import vllm.ir
        from vllm.config import set_current_vllm_config
        from vllm.utils.torch_utils import set_default_torch_dtype

        config = self.vllm_config
        if invariance.requested():
            invariance.install()
        with contextlib.ExitStack() as stack:
            stack.enter_context(set_current_vllm_config(config))
            stack.enter_context(config.kernel_config.ir_op_priority.set_priority())
            stack.enter_context(vllm.ir.enable_torch_wrap(bool(config.compilation_config.ir_enable_torch_wrap)))
            if parallel_state:
                ensure_vllm_parallel_state()
            if building:
                stack.enter_context(set_default_torch_dtype(self.model_dtype))
                stack.enter_context(torch.device(config.device_config.device))
            entered.append((self, parallel_state))
            try:
                yield
            finally:
                entered.pop()

    def describe(self) -> dict[str, Any]:
        """The resolved settings that choose kernels, for logs and reports."""
        config = self.vllm_config
        compilation = config.compilation_config
        priority = config.kernel_config.ir_op_priority
        return {
            "model": self.spec.model,
            "dtype": str(self.model_dtype).removeprefix("torch."),
            "quantization": self.spec.quantization,
            "compilation_mode": int(compilation.mode),
            "custom_ops": list(compilation.custom_ops),
            "ir_enable_torch_wrap": bool(compilation.ir_enable_torch_wrap),
            "ir_op_priority": {"rms_norm": list(priority.rms_norm),
                               "fused_add_rms_norm": list(priority.fused_add_rms_norm)},
        }


@functools.cache
def vllm_context(spec: EngineSpec) -> VllmContext:
    """The process-wide :class:`VllmContext` for ``spec`` (built once per spec)."""
    return VllmContext(spec)

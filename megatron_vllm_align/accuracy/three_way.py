"""Three-way comparison: target and dtype-reference errors, both against an FP32 baseline.

    reference error = expected - baseline_fp32   (what the dtype alone costs)
    target error    = actual   - baseline_fp32   (what the implementation under test costs)

Aggregated over all inputs (pooled): sigma ratio and Bhattacharyya coefficient (BC).
Per input, worst case: L-inf ratio and L2 ratio. Pass rule (kept exactly):

    PASS if (BC >= bc_threshold OR sigma_ratio <= 1.0)
         AND worst L-inf ratio < max_linf_ratio
         AND worst L2 ratio   < max_l2_ratio

Ratios of error sizes share one convention for a zero denominator (no reference error):
0/0 -> 1.0 (both exact: equally accurate), x/0 -> inf (target error where the dtype has none).
All metrics are computed in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from megatron_vllm_align.accuracy._validate import (
    TensorOrList,
    checked_float64,
    pooled_float64,
    tensor_list,
)


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, with 0/0 -> 1.0 and x/0 -> inf (see module docstring)."""
    if denominator > 0:
        return numerator / denominator
    return 1.0 if numerator == 0 else math.inf


def error_tensors(
    baseline_fp32: TensorOrList,
    expected: TensorOrList,
    actual: TensorOrList,
    name: str = "tensor",
) -> tuple[TensorOrList, TensorOrList]:
    """(reference errors, target errors) in float64: ``expected - baseline``, ``actual - baseline``.

    Takes three tensors, or three equal-length lists of tensors with equal shapes item by
    item; returns tensors or lists to match. Raises ValueError/TypeError naming `name` and
    the offending input index for mismatched lengths, shapes, devices, non-floating dtypes,
    empty tensors or NaN/Inf.
    """
    kinds = {isinstance(v, torch.Tensor) for v in (baseline_fp32, expected, actual)}
    if len(kinds) > 1:
        raise TypeError(f"{name}: baseline_fp32, expected and actual must be all tensors or all lists")
    baselines = tensor_list(baseline_fp32, "baseline_fp32", name)
    expecteds = tensor_list(expected, "expected", name)
    actuals = tensor_list(actual, "actual", name)
    if not len(baselines) == len(expecteds) == len(actuals):
        raise ValueError(
            f"{name}: input lists differ in length: baseline_fp32 {len(baselines)}, "
            f"expected {len(expecteds)}, actual {len(actuals)}"
        )
    single = isinstance(baseline_fp32, torch.Tensor)
    ref_errors, tgt_errors = [], []
    for i, (b, e, a) in enumerate(zip(baselines, expecteds, actuals)):
        tag = "" if single else f"[{i}]"
        b64, e64, a64 = checked_float64(
            {f"baseline_fp32{tag}": b, f"expected{tag}": e, f"actual{tag}": a}, name
        )
        ref_errors.append(e64 - b64)
        tgt_errors.append(a64 - b64)
    if single:
        return ref_errors[0], tgt_errors[0]
    return ref_errors, tgt_errors


def _root_mean_square(values: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean(values * values)))


def rms(errors: TensorOrList, name: str = "rms") -> float:
    """Root mean square of all elements of a tensor or list of tensors, pooled, in float64."""
    return _root_mean_square(pooled_float64(errors, "errors", name))


def sigma_ratio(ref_errors: TensorOrList, tgt_errors: TensorOrList) -> float:
    """RMS(all target errors) / RMS(all reference errors), each pooled over every input.

    <= 1.0 means the target is at least as accurate as the dtype reference overall.
    Zero reference RMS: 0/0 -> 1.0, x/0 -> inf.
    """
    ref = pooled_float64(ref_errors, "ref_errors", "sigma_ratio")
    tgt = pooled_float64(tgt_errors, "tgt_errors", "sigma_ratio")
    return _ratio(_root_mean_square(tgt), _root_mean_square(ref))


def bhattacharyya_coefficient(ref_errors: TensorOrList, tgt_errors: TensorOrList, bins: int = 100) -> float:
    """Overlap in [0, 1] of the two pooled error distributions: BC = sum_i sqrt(p_i * q_i).

    p and q are `bins`-bin histograms over ONE shared range [min, max] of both error sets,
    each normalised to sum to 1. A zero shared range means every error in both sets has
    the same value, so the distributions are identical and BC = 1.0; two different
    constants land in the first and last bins and give 0.0. The result is clipped to
    [0, 1] against float rounding.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bhattacharyya_coefficient: bins must be an int >= 1, got {bins!r}")
    ref = pooled_float64(ref_errors, "ref_errors", "bhattacharyya_coefficient")
    tgt = pooled_float64(tgt_errors, "tgt_errors", "bhattacharyya_coefficient")
    low = min(float(ref.min()), float(tgt.min()))
    high = max(float(ref.max()), float(tgt.max()))
    if low == high:
        return 1.0
    return bc_from_counts(histogram(ref, bins, low, high), histogram(tgt, bins, low, high))


def bc_from_counts(p: torch.Tensor, q: torch.Tensor) -> float:
    """:func:`bhattacharyya_coefficient` from the two error sets' histogram counts over one shared
    range (:func:`histogram`): sum_i sqrt(p_i q_i) of the normalised counts, clipped to [0, 1]."""
    overlap = float(torch.sqrt((p / p.sum()) * (q / q.sum())).sum())
    return min(1.0, max(0.0, overlap))


def histogram(values: torch.Tensor, bins: int, low: float, high: float) -> torch.Tensor:
    """float64 counts of ``values`` (float32 or float64, all within [low, high], low < high) in
    ``bins`` equal bins: value x goes to bin ``int((x - low) * bins / (high - low))`` (in the
    values' dtype), x == high to the last bin. The same counts as ``torch.histc(values, bins, low,
    high)`` (its CPU rule; tested), from an index computation and ``bincount``, about 3x faster."""
    return histograms([values], bins, low, high)[0]


def histograms(sets: Sequence[torch.Tensor], bins: int, low: float, high: float,
               overwrite: bool = False) -> torch.Tensor:
    """[len(sets), bins] float64: :func:`histogram` of each tensor of ``sets`` over the one shared
    range; ``overwrite``: the sets' own memory holds the bin positions (their values are lost; no
    temporary of their size)."""
    counts = torch.empty(len(sets), bins, dtype=torch.float64)
    for i, values in enumerate(sets):
        position = values.sub_(low) if overwrite else values - low
        # uint8 positions (0..bins, bins <= 255): a faster bincount; the slot `bins` holds x == high
        index = position.mul_(bins).div_(high - low).to(torch.uint8 if bins < 256 else torch.int64)
        slots = torch.bincount(index.reshape(-1), minlength=bins + 1).to(torch.float64)
        slots[bins - 1] += slots[bins]
        counts[i] = slots[:bins]
    return counts


@dataclasses.dataclass(frozen=True)
class PerInputRatios:
    """Per-input ratios max|tgt_i| / max|ref_i| (L-inf) and ||tgt_i||_2 / ||ref_i||_2 (L2), and their maxima."""

    linf_ratios: tuple[float, ...]
    l2_ratios: tuple[float, ...]

    @property
    def worst_linf(self) -> float:
        return max(self.linf_ratios)

    @property
    def worst_l2(self) -> float:
        return max(self.l2_ratios)


def per_input_ratios(ref_errors_list: TensorOrList, tgt_errors_list: TensorOrList) -> PerInputRatios:
    """L-inf and L2 error ratios of each input i (target over reference); zero reference: 0/0 -> 1, x/0 -> inf."""
    name = "per_input_ratios"
    refs = tensor_list(ref_errors_list, "ref_errors_list", name)
    tgts = tensor_list(tgt_errors_list, "tgt_errors_list", name)
    if len(refs) != len(tgts):
        raise ValueError(f"{name}: {len(refs)} reference error tensors but {len(tgts)} target error tensors")
    linf, l2 = [], []
    for i, (ref, tgt) in enumerate(zip(refs, tgts)):
        r, t = checked_float64({f"ref_errors_list[{i}]": ref, f"tgt_errors_list[{i}]": tgt}, name)
        linf.append(_ratio(float(t.abs().max()), float(r.abs().max())))
        l2.append(_ratio(float(torch.linalg.vector_norm(t)), float(torch.linalg.vector_norm(r))))
    return PerInputRatios(tuple(linf), tuple(l2))


def three_way_failures(
    sigma_ratio: float,
    bc: float,
    worst_linf_ratio: float,
    worst_l2_ratio: float,
    bc_threshold: float = 0.99,
    max_linf_ratio: float = 5.0,
    max_l2_ratio: float = 3.0,
) -> tuple[str, ...]:
    """The pass rule of the module docstring; returns the failed conditions (empty tuple = PASS)."""
    failures = []
    if not (bc >= bc_threshold or sigma_ratio <= 1.0):
        failures.append(
            f"statistical gate: BC {bc:.6g} < {bc_threshold:g} and sigma_ratio {sigma_ratio:.6g} > 1.0"
        )
    if not worst_linf_ratio < max_linf_ratio:
        failures.append(f"worst L-inf ratio {worst_linf_ratio:.6g} >= {max_linf_ratio:g}")
    if not worst_l2_ratio < max_l2_ratio:
        failures.append(f"worst L2 ratio {worst_l2_ratio:.6g} >= {max_l2_ratio:g}")
    return tuple(failures)


@dataclasses.dataclass(frozen=True)
class ThreeWayResult:
    """Metrics of one three-way comparison; `n_elements` counts elements per side over all inputs."""

    name: str
    sigma_ratio: float
    bc: float
    worst_linf_ratio: float
    worst_l2_ratio: float
    linf_ratios: tuple[float, ...]
    l2_ratios: tuple[float, ...]
    passed: bool
    n_inputs: int
    n_elements: int

    def to_dict(self) -> dict:
        """Plain dict (lists instead of tuples) for JSON / YAML reports."""
        out = dataclasses.asdict(self)
        out["linf_ratios"] = list(self.linf_ratios)
        out["l2_ratios"] = list(self.l2_ratios)
        return out

    def describe(self) -> str:
        """One line with all four figures and the inputs where the worst ratios occur."""
        worst_linf_at = self.linf_ratios.index(self.worst_linf_ratio)
        worst_l2_at = self.l2_ratios.index(self.worst_l2_ratio)
        return (
            f"{self.name}: {self.n_inputs} input(s), {self.n_elements} elements: "
            f"sigma_ratio={self.sigma_ratio:.6g}, BC={self.bc:.6g}, "
            f"worst L-inf ratio={self.worst_linf_ratio:.6g} (input {worst_linf_at}), "
            f"worst L2 ratio={self.worst_l2_ratio:.6g} (input {worst_l2_at})"
        )


def _checked_thresholds(bc_threshold: float, max_linf_ratio: float, max_l2_ratio: float, name: str) -> None:
    if not 0.0 <= bc_threshold <= 1.0:
        raise ValueError(f"{name}: bc_threshold must lie in [0, 1], got {bc_threshold}")
    for label, value in (("max_linf_ratio", max_linf_ratio), ("max_l2_ratio", max_l2_ratio)):
        if not value > 0:
            raise ValueError(f"{name}: {label} must be > 0, got {value}")


def compare_three_way(
    baseline_fp32: TensorOrList,
    expected: TensorOrList,
    actual: TensorOrList,
    name: str = "tensor",
    bc_threshold: float = 0.99,
    max_linf_ratio: float = 5.0,
    max_l2_ratio: float = 3.0,
    bins: int = 100,
) -> ThreeWayResult:
    """Three-way metrics and verdict; never raises on failure. Inputs as for :func:`error_tensors`."""
    _checked_thresholds(bc_threshold, max_linf_ratio, max_l2_ratio, name)
    ref, tgt = error_tensors(baseline_fp32, expected, actual, name=name)
    ratios = per_input_ratios(ref, tgt)
    sigma = sigma_ratio(ref, tgt)
    bc = bhattacharyya_coefficient(ref, tgt, bins=bins)
    refs = tensor_list(ref, "ref", name)
    return ThreeWayResult(
        name=name,
        sigma_ratio=sigma,
        bc=bc,
        worst_linf_ratio=ratios.worst_linf,
        worst_l2_ratio=ratios.worst_l2,
        linf_ratios=ratios.linf_ratios,
        l2_ratios=ratios.l2_ratios,
        passed=not three_way_failures(
            sigma, bc, ratios.worst_linf, ratios.worst_l2, bc_threshold, max_linf_ratio, max_l2_ratio
        ),
        n_inputs=len(refs),
        n_elements=sum(r.numel() for r in refs),
    )

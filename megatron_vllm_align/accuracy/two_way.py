"""Two-way comparison: a tensor against its reference, normalised by the reference's global max.

An element fails when

    (|actual - expected| - atol) / max|expected| > rtol

where ``max|expected|`` is the GLOBAL maximum over the whole expected tensor (not the
element's own magnitude, as in ``torch.allclose``). rtol is therefore relative to the
tensor's overall scale, and near-zero elements are not judged by their own tiny magnitude.
With equal tolerances this is never stricter than ``torch.allclose``: max|expected| >=
|expected_i| for every element. When expected is all zeros the scale is 1.0, i.e. the test
becomes absolute: ``|actual - expected| - atol > rtol``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_vllm_align.accuracy._validate import checked_float64, element_index

# rtol = _ROUNDINGS_AT_TOP * eps; see default_tolerances for the reasoning.
_ROUNDINGS_AT_TOP = 2


def default_tolerances(*dtypes: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing tensors of `dtypes`, from the least precise of them.

    ===============  =============  ========  ==================  ========================
    dtype            mantissa bits  eps       rtol = 2 * eps      atol = smallest normal
    ===============  =============  ========  ==================  ========================
    float64          52             2.2e-16   4.4e-16             2.2e-308
    float32          23             1.2e-7    2.4e-7              1.2e-38
    bfloat16         7              7.8e-3    1.6e-2              1.2e-38
    float16          10             9.8e-4    2.0e-3              6.1e-5
    float8_e4m3fn    3              0.125     0.25                1.6e-2
    float8_e5m2      2              0.25      0.5                 6.1e-5
    ===============  =============  ========  ==================  ========================

    Reasoning: eps = 2**-mantissa_bits is the spacing of the dtype at 1.0, so the spacing
    (ulp) at any normal value x is at most eps * |x| <= eps * max|expected|. One rounding
    to the dtype moves a value by at most half an ulp; rtol = 2 * eps therefore admits four
    roundings at the top of the tensor's range (the output cast plus a few upstream).
    Long reductions accumulate more and need an explicit rtol. atol is the dtype's
    smallest normal number: kernels that flush subnormals to zero differ by less than
    that, which is not an accuracy error. Any floating dtype is handled by the same rule
    via ``torch.finfo``; "least precise" means the largest eps.
    """
    if not dtypes:
        raise ValueError("default_tolerances needs at least one dtype")
    coarsest = max(dtypes, key=lambda d: (torch.finfo(d).eps, torch.finfo(d).smallest_normal))
    info = torch.finfo(coarsest)
    return _ROUNDINGS_AT_TOP * info.eps, info.smallest_normal


@dataclasses.dataclass(frozen=True)
class TwoWayResult:
    """Outcome of a two-way comparison.

    Relative errors are ``|actual - expected| / scale`` with ``scale = max|expected|`` (1.0
    when that is zero). Because the scale is global, the element with the largest relative
    error is also the one with the largest absolute error: both indices are reported, and
    they coincide by construction. Indices are tuples of ints into the compared shape.
    """

    name: str
    rtol: float
    atol: float
    scale: float
    mismatches: int
    total: int
    max_rel_error: float
    max_rel_index: tuple[int, ...]
    max_abs_error: float
    max_abs_index: tuple[int, ...]
    passed: bool

    def describe(self) -> str:
        """One-line report: mismatch count, tolerances, worst errors with their indices."""
        verdict = "ok" if self.passed else "MISMATCH"
        return (
            f"{self.name}: {verdict}: {self.mismatches}/{self.total} elements fail "
            f"(|actual - expected| - atol) / max|expected| <= rtol "
            f"(rtol={self.rtol:.3g}, atol={self.atol:.3g}, max|expected|={self.scale:.6g}); "
            f"max relative error {self.max_rel_error:.6g} at index {self.max_rel_index}, "
            f"max absolute error {self.max_abs_error:.6g} at index {self.max_abs_index}"
        )


def _checked_tolerance(value: float, label: str, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: {label} must be a finite number >= 0, got {value}")
    return value


def compare_two_way(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float | None = None,
    name: str = "tensor",
) -> TwoWayResult:
    """Compare `actual` with `expected` by the global-max rule of this module; never raises on mismatch.

    Both tensors are compared in float64. rtol/atol left as None come from
    ``default_tolerances(actual.dtype, expected.dtype)``. Raises ValueError for a shape or
    device mismatch, an empty tensor or NaN/Inf in either input; TypeError for a
    non-tensor or a non-floating dtype. Every message starts with `name`.
    """
    a, e = checked_float64({"actual": actual, "expected": expected}, name)
    default_rtol, default_atol = default_tolerances(actual.dtype, expected.dtype)
    rtol = _checked_tolerance(default_rtol if rtol is None else rtol, "rtol", name)
    atol = _checked_tolerance(default_atol if atol is None else atol, "atol", name)

    peak = float(e.abs().max())
    scale = peak if peak > 0 else 1.0
    abs_error = (a - e).abs().reshape(-1)
    mismatches = int(((abs_error - atol) / scale > rtol).sum())
    worst = int(abs_error.argmax())
    worst_index = element_index(worst, actual.shape)
    max_abs = float(abs_error[worst])
    return TwoWayResult(
        name=name,
        rtol=rtol,
        atol=atol,
        scale=scale,
        mismatches=mismatches,
        total=abs_error.numel(),
        max_rel_error=max_abs / scale,
        max_rel_index=worst_index,
        max_abs_error=max_abs,
        max_abs_index=worst_index,
        passed=mismatches == 0,
    )


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float | None = None,
    name: str = "tensor",
) -> TwoWayResult:
    """Raise AssertionError unless every element satisfies ``(|a - e| - atol) / max|e| <= rtol``.

    The normalisation is by the GLOBAL max of `expected` (see the module docstring), not
    per element as in ``torch.allclose``. Same inputs, defaults and input errors as
    :func:`compare_two_way`; the AssertionError names the tensor and gives the mismatch
    count / total and the max relative and absolute errors with their element indices.
    Returns the result when the comparison passes.
    """
    result = compare_two_way(actual, expected, rtol=rtol, atol=atol, name=name)
    if not result.passed:
        raise AssertionError(result.describe())
    return result

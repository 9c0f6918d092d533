"""The three-way pass rule (:mod:`.three_way`) as an assertion, with the plots of a failure.

Above both :mod:`.three_way` (metrics) and :mod:`.plots` (figures of those metrics), so neither
imports the other's caller.
"""

from __future__ import annotations

from megatron_vllm_align.accuracy._validate import TensorOrList
from megatron_vllm_align.accuracy.three_way import ThreeWayResult, compare_three_way, three_way_failures


def assert_close_three_way(
    baseline_fp32: TensorOrList,
    expected: TensorOrList,
    actual: TensorOrList,
    name: str = "tensor",
    bc_threshold: float = 0.99,
    max_linf_ratio: float = 5.0,
    max_l2_ratio: float = 3.0,
    bins: int = 100,
    plot_on_failure: bool = False,
    output_dir: str = "accuracy_debug",
) -> ThreeWayResult:
    """Raise AssertionError unless the pass rule of :mod:`.three_way` holds; return the result.

    Accepts tensors or equal-length lists of tensors (metrics pooled / per input as
    documented above). The message gives sigma ratio, BC, worst L-inf and L2 ratios and
    each failed condition. With `plot_on_failure`, the error histogram and QQ plot are
    written into `output_dir` first and their paths appended to the message; if writing
    them fails, the message says why instead (the accuracy failure is still raised).
    """
    result = compare_three_way(
        baseline_fp32, expected, actual, name, bc_threshold, max_linf_ratio, max_l2_ratio, bins
    )
    if result.passed:
        return result
    failures = three_way_failures(
        result.sigma_ratio, result.bc, result.worst_linf_ratio, result.worst_l2_ratio,
        bc_threshold, max_linf_ratio, max_l2_ratio,
    )
    message = f"three-way comparison FAILED: {result.describe()}; failed: " + "; ".join(failures)
    if plot_on_failure:
        from megatron_vllm_align.accuracy.plots import plot_three_way  # matplotlib only when needed

        try:
            paths = plot_three_way(baseline_fp32, expected, actual, name, output_dir)
        except OSError as exc:
            raise AssertionError(f"{message}; plots NOT written: {exc}") from exc
        message += "; plots: " + ", ".join(paths)
    raise AssertionError(message)

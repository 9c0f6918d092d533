"""Forward accuracy comparisons: two-way (global-max assert_close) and three-way (vs FP32 baseline).

The plots live in :mod:`megatron_vllm_align.accuracy.plots`, imported on demand because they
need matplotlib.
"""

from megatron_vllm_align.accuracy.three_way import (
    PerInputRatios,
    ThreeWayResult,
    bhattacharyya_coefficient,
    compare_three_way,
    error_tensors,
    per_input_ratios,
    rms,
    sigma_ratio,
    three_way_failures,
)
from megatron_vllm_align.accuracy.three_way_gate import assert_close_three_way
from megatron_vllm_align.accuracy.two_way import TwoWayResult, assert_close, compare_two_way, default_tolerances

__all__ = [
    "PerInputRatios",
    "ThreeWayResult",
    "TwoWayResult",
    "assert_close",
    "assert_close_three_way",
    "bhattacharyya_coefficient",
    "compare_three_way",
    "compare_two_way",
    "default_tolerances",
    "error_tensors",
    "per_input_ratios",
    "rms",
    "sigma_ratio",
    "three_way_failures",
]

"""Module-level forward accuracy against a Hugging Face module with the same weights
(docs/method.md#three-way-comparison).

For each of N inputs: the FP32 golden (the HF module with fp32 parameters on inputs upcast to fp32),
the dtype reference (the HF module with parameters in the target dtype, bf16) and the target (the module
under test). The per-input two-way check (target vs golden,
:func:`~megatron_vllm_align.accuracy.compare_two_way`) is informational (a ``NOTE:`` line, never a
failure); the gate is the three-way comparison over all N inputs
(:func:`~megatron_vllm_align.accuracy.compare_three_way`): is the target's error against the golden
explained by the dtype alone? A scatter plot is always written; the error histogram and QQ plot when the
gate fails. Only parameters are cast between golden and reference (buffers keep their dtype, as HF's
``from_pretrained(..., dtype=torch.bfloat16)`` keeps e.g. ``inv_freq`` in fp32); parameters should be
exactly representable in the target dtype, so golden and reference differ by arithmetic only.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.accuracy import ThreeWayResult, TwoWayResult, compare_three_way, compare_two_way
from megatron_vllm_align.accuracy.three_way import three_way_failures

logger = logging.getLogger(__name__)

DEFAULT_SAMPLES = 10


@dataclasses.dataclass(frozen=True)
class GateThresholds:
    """The three-way pass rule's thresholds (docs/method.md#three-way-comparison)."""

    bc_threshold: float = 0.99
    max_linf_ratio: float = 5.0
    max_l2_ratio: float = 3.0


@dataclasses.dataclass(frozen=True)
class ModuleAccuracyResult:
    """Outcome of :func:`run_module_accuracy`.

    ``three_way``: the gate's metrics over all inputs; ``two_way``: one informational result per
    input (target vs golden); ``failures``: the gate's failed conditions (empty = pass);
    ``plots``: paths written (scatter always, error histogram and QQ plot on failure).
    """

    name: str
    three_way: ThreeWayResult
    two_way: tuple[TwoWayResult, ...]
    failures: tuple[str, ...]
    plots: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        """One line: verdict, the four three-way figures, the two-way notes, failed conditions, plots."""
        verdict = "PASS" if self.passed else "FAIL"
        notes = sum(not r.passed for r in self.two_way)
        text = (f"{verdict} {self.three_way.describe()}; two-way (informational): "
                f"{notes}/{len(self.two_way)} sample(s) over tolerance")
        if self.failures:
            text += "; failed: " + "; ".join(self.failures)
        return text + "; plots: " + ", ".join(self.plots)


def module_in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of ``module`` in eval mode with its floating parameters cast to ``dtype``
    (buffers untouched; see the module docstring)."""
    copied = copy.deepcopy(module).eval()
    for parameter in copied.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    return copied


def _checked_inputs(inputs: Any, dtype: torch.dtype, name: str, sample: int) -> tuple[Any, ...]:
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"{name}: make_inputs must return a tuple of arguments, got {type(inputs).__name__} "
                        f"for sample {sample}")
    for i, arg in enumerate(inputs):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dtype != dtype:
            raise TypeError(f"{name}: input {i} of sample {sample} is {arg.dtype}; floating inputs must be "
                            f"{dtype} (the target dtype)")
    return tuple(inputs)


def _copies(inputs: tuple[Any, ...], dtype: torch.dtype | None) -> tuple[Any, ...]:
    """Fresh copies of the tensor arguments (floating ones cast to ``dtype`` unless None)."""
    def one(arg: Any) -> Any:
        if not isinstance(arg, torch.Tensor):
            return arg
        if dtype is not None and arg.is_floating_point():
            return arg.detach().to(dtype, copy=True)
        return arg.detach().clone()
    return tuple(one(arg) for arg in inputs)


def _checked_output(output: Any, role: str, name: str, sample: int) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{name}: the {role} returned {type(output).__name__} for sample {sample}; "
                        "a single tensor is required (wrap the callable to select one output)")
    return output.detach()


def run_module_accuracy(
    name: str,
    target: Callable[..., torch.Tensor],
    hf_module: nn.Module,
    make_inputs: Callable[[torch.Generator], Sequence[Any]],
    output_dir: str | os.PathLike,
    *,
    n_samples: int = DEFAULT_SAMPLES,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    two_way_rtol: float | None = None,
    two_way_atol: float | None = None,
    thresholds: GateThresholds = GateThresholds(),
    gate: bool = True,
) -> ModuleAccuracyResult:
    """Run the seed-003 module accuracy test of ``target`` against ``hf_module``; see the module docstring.

    ``make_inputs(generator)`` returns the positional arguments of one call, floating tensors
    in ``dtype``; sample i uses ``torch.Generator().manual_seed(seed + i)``. Non-floating
    arguments (positions, token ids, Python values) reach all three sides unchanged; each side
    gets its own copies. ``target`` and ``hf_module`` return one tensor of the same shape.
    Two-way tolerances default to ``default_tolerances`` of the compared dtypes.

    Plots go to ``output_dir``: ``<stem>_scatter.png`` always, ``<stem>_error_hist.png`` and
    ``<stem>_error_qq.png`` when the gate fails (stem from ``plots.plot_file_stem(name)``).
    With ``gate=True`` a failed gate raises AssertionError carrying :meth:`ModuleAccuracyResult.describe`;
    with ``gate=False`` the result is returned either way.
    """
    from megatron_vllm_align.accuracy.plots import plot_file_stem, plot_scatter, plot_three_way

    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"{name}: n_samples must be a positive int, got {n_samples!r}")
    if not isinstance(hf_module, nn.Module):
        raise TypeError(f"{name}: hf_module must be a torch.nn.Module, got {type(hf_module).__name__}")
    golden_module = module_in_dtype(hf_module, torch.float32)
    reference_module = module_in_dtype(hf_module, dtype)

    goldens, references, targets = [], [], []
    with torch.no_grad():
        for sample in range(n_samples):
            inputs = _checked_inputs(make_inputs(torch.Generator().manual_seed(seed + sample)), dtype, name, sample)
            goldens.append(_checked_output(golden_module(*_copies(inputs, torch.float32)), "fp32 golden", name, sample))
            references.append(_checked_output(reference_module(*_copies(inputs, None)), "dtype reference", name,
                                              sample))
            targets.append(_checked_output(target(*_copies(inputs, None)), "target", name, sample))

    two_way = []
    for sample, (golden, actual) in enumerate(zip(goldens, targets)):
        result = compare_two_way(actual, golden, rtol=two_way_rtol, atol=two_way_atol, name=f"{name}[{sample}]")
        if not result.passed:
            logger.warning("NOTE: (informational, not gating) %s", result.describe())
        two_way.append(result)

    stem = os.path.join(os.fspath(output_dir), plot_file_stem(name))
    pooled_target = torch.cat([t.reshape(-1) for t in targets])
    pooled_golden = torch.cat([g.reshape(-1) for g in goldens])
    plots = [plot_scatter(pooled_target, pooled_golden, name, f"{stem}_scatter.png")]

    three_way = compare_three_way(goldens, references, targets, name, thresholds.bc_threshold,
                                  thresholds.max_linf_ratio, thresholds.max_l2_ratio)
    failures = three_way_failures(three_way.sigma_ratio, three_way.bc, three_way.worst_linf_ratio,
                                  three_way.worst_l2_ratio, thresholds.bc_threshold, thresholds.max_linf_ratio,
                                  thresholds.max_l2_ratio)
    if failures:
        plots.extend(plot_three_way(goldens, references, targets, name, output_dir))
    outcome = ModuleAccuracyResult(name, three_way, tuple(two_way), failures, tuple(plots))
    logger.info("%s", outcome.describe())
    if gate and not outcome.passed:
        raise AssertionError(f"three-way gate FAILED: {outcome.describe()}")
    return outcome

"""Compare two gradient dumps with the layer-1 metrics, per parameter and per module class.

Dump ``b`` is the reference: rel_l2 = ||a - b|| / max(||b||, eps). Per module class the
gradients of all its parameters are pooled (concatenated) before the metrics are taken. The
recorded scaling factors of both dumps are returned beside the metrics, since a difference
there (dump timing, loss scale, clipping) explains a multiplicative gradient difference.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from megatron_vllm_align.guards.dump_loader import GradientDump, load_gradient_dump
from megatron_vllm_align.guards.scaling import GradientScaling
from megatron_vllm_align.validation.grad_metrics import GradMetrics, grad_metrics


@dataclass(frozen=True)
class DumpDiff:
    """Metrics of dump a against reference dump b.

    per_parameter / per_module_class: GradMetrics by parameter name / module class name.
    only_in_a / only_in_b: names present in one dump only. shape_mismatch: name -> (a, b) shapes.
    scaling_a / scaling_b: rank 0's recorded factors; scaling_differences: field -> (a, b).
    """

    per_parameter: dict[str, GradMetrics]
    per_module_class: dict[str, GradMetrics]
    only_in_a: list[str]
    only_in_b: list[str]
    shape_mismatch: dict[str, tuple[list[int], list[int]]]
    scaling_a: GradientScaling
    scaling_b: GradientScaling
    scaling_differences: dict[str, tuple[object, object]] = field(default_factory=dict)


def _scaling_differences(a: GradientScaling, b: GradientScaling) -> dict[str, tuple[object, object]]:
    da, db = a.to_dict(), b.to_dict()
    return {name: (da[name], db[name]) for name in da if name != "source" and da[name] != db[name]}


def diff_dumps(a: GradientDump, b: GradientDump) -> DumpDiff:
    """Layer-1 metrics of every parameter present in both dumps with the same shape."""
    common = [name for name in a.grads if name in b.grads]
    shape_mismatch = {name: (list(a.grads[name].shape), list(b.grads[name].shape))
                      for name in common if a.grads[name].shape != b.grads[name].shape}
    compared = [name for name in common if name not in shape_mismatch]
    per_parameter = {name: grad_metrics(a.grads[name], b.grads[name]) for name in compared}
    by_class: dict[str, list[str]] = {}
    for name in compared:
        by_class.setdefault(b.records[name].module_class or "<unknown>", []).append(name)
    per_class = {cls: grad_metrics(torch.cat([a.grads[n].flatten().double() for n in names]),
                                   torch.cat([b.grads[n].flatten().double() for n in names]))
                 for cls, names in sorted(by_class.items())}
    return DumpDiff(per_parameter=per_parameter, per_module_class=per_class,
                    only_in_a=sorted(set(a.grads) - set(b.grads)), only_in_b=sorted(set(b.grads) - set(a.grads)),
                    shape_mismatch=shape_mismatch, scaling_a=a.scaling, scaling_b=b.scaling,
                    scaling_differences=_scaling_differences(a.scaling, b.scaling))


def diff_gradient_dumps(directory_a: str | os.PathLike, step_a: int, directory_b: str | os.PathLike,
                        step_b: int | None = None) -> DumpDiff:
    """Load both dumps (step_b defaults to step_a) and diff them; a against reference b."""
    return diff_dumps(load_gradient_dump(directory_a, step_a),
                      load_gradient_dump(directory_b, step_a if step_b is None else step_b))


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3e}"


def format_diff(diff: DumpDiff) -> str:
    """A plain-text table of a DumpDiff (per module class, then per parameter)."""
    header = f"{'':44s} {'max_abs_err':>11s} {'rel_l2':>10s} {'norm_ratio':>10s} {'cosine':>10s}"
    lines = ["per module class (pooled):", header]
    for title, table in (("", diff.per_module_class), ("per parameter:", diff.per_parameter)):
        if title:
            lines += [title, header]
        for name, m in table.items():
            lines.append(f"{name[:44]:44s} {_fmt(m.max_abs_err):>11s} {_fmt(m.rel_l2):>10s} "
                         f"{_fmt(m.norm_ratio):>10s} {_fmt(m.cosine):>10s}")
    for label, names in (("only in a", diff.only_in_a), ("only in b", diff.only_in_b)):
        if names:
            lines.append(f"{label}: {', '.join(names)}")
    for name, (shape_a, shape_b) in diff.shape_mismatch.items():
        lines.append(f"shape mismatch {name}: {shape_a} vs {shape_b}")
    for name, (value_a, value_b) in diff.scaling_differences.items():
        lines.append(f"scaling differs: {name}: a={value_a} b={value_b}")
    return "\n".join(lines)

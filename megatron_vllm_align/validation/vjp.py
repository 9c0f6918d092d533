"""Layer 1: module-level VJP comparison against an independent reference
(docs/method.md#layer-1-module-vjp).

``compare_vjp`` runs a candidate module and an independent reference module on independent
copies of the same inputs, backpropagates the *same external* upstream gradient dY through both,
and compares every gradient item by item (inputs by position, parameters by name).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from megatron_vllm_align.contracts import Tolerance

from .grad_metrics import grad_metrics
from .report import DECLARED_UNUSED, OK, Check, ComparisonReport

DY_KINDS = ("random", "zero", "sparse", "along_output")
SPARSE_FRACTION = 0.05  # share of output elements that carry a non-zero dY in the "sparse" kind


def check_same_parameters(candidate: nn.Module, reference: nn.Module) -> None:
    """Raise ValueError unless both modules hold the same parameter names, shapes, dtypes and values,
    as independent tensors (shared storage would let one side's gradient reach the other)."""
    cand = dict(candidate.named_parameters())
    ref = dict(reference.named_parameters())
    if cand.keys() != ref.keys():
        only_c = sorted(cand.keys() - ref.keys())
        only_r = sorted(ref.keys() - cand.keys())
        raise ValueError(f"parameter names differ: only in candidate {only_c}, only in reference {only_r}")
    for name, p in cand.items():
        q = ref[name]
        if p.shape != q.shape or p.dtype != q.dtype or p.device != q.device:
            raise ValueError(
                f"parameter {name!r}: candidate {tuple(p.shape)} {p.dtype} {p.device} vs "
                f"reference {tuple(q.shape)} {q.dtype} {q.device}")
        if p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
            raise ValueError(f"parameter {name!r} shares storage between candidate and reference; "
                             "give the reference an independent copy (copy.deepcopy)")
        if not torch.equal(p.detach(), q.detach()):
            raise ValueError(f"parameter {name!r} has different values in candidate and reference")


def _clone_inputs(inputs: Sequence[Any]) -> list[Any]:
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs]


def _output_tensors(out: Any, side: str) -> list[torch.Tensor]:
    """Differentiable output tensors in order; Megatron-style (out, bias) tuples are flattened."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError(f"{side} returned no tensor that requires grad")
    for i, t in enumerate(tensors):
        if not torch.isfinite(t).all():
            raise ValueError(f"{side} output {i} has non-finite values")
    return tensors


def make_dy(outputs: Sequence[torch.Tensor], kind: str, seed: int) -> list[torch.Tensor]:
    """Upstream gradients for ``outputs``: "random" (N(0,1)), "zero", "sparse" (N(0,1) at a
    seeded SPARSE_FRACTION of positions, at least one) or "along_output" (per row of the last
    dimension, N(0,1) plus the output row scaled to the same norm).

    "along_output" exists because a random dY is nearly orthogonal to the output: backward terms
    that live along it (RMSNorm's projection ``x mean(x dY)``, softmax's ``p sum(p dY)``) shrink
    as 1/sqrt(width) under random dY, so dropping one escapes at large widths; with a component
    along the output as large as the random one they stay the size of the others. Drawn in fp32, then cast to each
    output's dtype, so both sides receive the same bytes."""
    if kind not in DY_KINDS:
        raise ValueError(f"unknown dY kind {kind!r}; expected one of {DY_KINDS} or explicit tensors")
    gen = torch.Generator().manual_seed(seed)
    dys = []
    for out in outputs:
        if kind == "zero":
            dy = torch.zeros(out.shape)
        else:
            dy = torch.randn(out.shape, generator=gen)
            if kind == "sparse":
                keep = torch.rand(out.shape, generator=gen) < SPARSE_FRACTION
                keep.view(-1)[torch.randint(out.numel(), (1,), generator=gen)] = True
                dy = dy * keep
            elif kind == "along_output":
                rows = out.detach().float().cpu().reshape(dy.shape)
                scale = dy.norm(dim=-1, keepdim=True) / rows.norm(dim=-1, keepdim=True).clamp_min(1e-30)
                dy = dy + rows * scale
        dys.append(dy.to(dtype=out.dtype, device=out.device))
    return dys


def _check_dy(dys: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    if len(dys) != len(outputs):
        raise ValueError(f"dY has {len(dys)} tensors for {len(outputs)} differentiable outputs")
    for i, (dy, out) in enumerate(zip(dys, outputs)):
        if dy.shape != out.shape or dy.dtype != out.dtype or dy.device != out.device:
            raise ValueError(f"dY[{i}] is {tuple(dy.shape)} {dy.dtype} {dy.device}; output {i} is "
                             f"{tuple(out.shape)} {out.dtype} {out.device}")


def run_backward(module: nn.Module, inputs: Sequence[Any], dy: str | Sequence[torch.Tensor],
                 seed: int, side: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None],
                                                list[torch.Tensor]]:
    """Forward ``module`` on a private copy of ``inputs`` and backpropagate ``dy``.

    Returns (outputs, gradients by item name, the dY tensors used). Items are ``input[i]`` for
    inputs given with requires_grad=True and the module's parameter names.
    """
    module.zero_grad(set_to_none=True)
    local = _clone_inputs(inputs)
    outputs = _output_tensors(module(*local), side)
    dys = make_dy(outputs, dy, seed) if isinstance(dy, str) else list(dy)
    _check_dy(dys, outputs)
    torch.autograd.backward(outputs, dys)
    grads: dict[str, torch.Tensor | None] = {}
    for i, x in enumerate(local):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            grads[f"input[{i}]"] = x.grad
    for name, p in module.named_parameters():
        if p.requires_grad:
            grads[name] = p.grad
    return outputs, grads, dys


def _tolerance_for(item: str, tolerances: Tolerance | Mapping[str, Tolerance]) -> Tolerance:
    if isinstance(tolerances, Tolerance):
        return tolerances
    if item not in tolerances:
        raise KeyError(f"no tolerance given for gradient {item!r}; tolerances cover {sorted(tolerances)}")
    return tolerances[item]


def compare_gradient(item: str, dy_kind: str, grad: torch.Tensor | None, ref: torch.Tensor | None,
                     tolerance: Tolerance, declared_unused: bool = False) -> Check:
    """Classify one gradient: missing / unexpected / unused / shape / non-finite / zero / tolerance / ok."""
    if ref is None and grad is None:
        if declared_unused:
            return Check(item, dy_kind, DECLARED_UNUSED, "no gradient on either side (declared unused)")
        return Check(item, dy_kind, "unused", "differentiable but receives no gradient on either side; "
                     "declare it unused if the module genuinely does not use it")
    if grad is None:
        return Check(item, dy_kind, "missing", "reference has a gradient, candidate has none "
                     "(detached chain or dropped term)")
    if ref is None:
        return Check(item, dy_kind, "unexpected", "candidate has a gradient, reference has none")
    if grad.shape != ref.shape:
        return Check(item, dy_kind, "shape", f"candidate {tuple(grad.shape)} vs reference {tuple(ref.shape)}")
    m = grad_metrics(grad, ref)
    # a finite float64 norm means every value is finite: the element-wise test only where it is not
    if not math.isfinite(m.ref_norm) and not torch.isfinite(ref).all():
        raise ValueError(f"reference gradient of {item!r} (dY {dy_kind}) has non-finite values; "
                         "the reference cannot judge the candidate")
    if not math.isfinite(m.norm) and not (finite := torch.isfinite(grad)).all():
        first = tuple(int(i) for i in (~finite).nonzero()[0])
        return Check(item, dy_kind, "non_finite", f"{int((~finite).sum())} non-finite values in gradient of "
                     f"{item!r}, first at index {first}")
    if m.ref_norm > 0 and m.norm == 0:
        return Check(item, dy_kind, "zero", "candidate gradient is all zero where the reference is not",
                     m, tolerance)
    limit = tolerance.atol + tolerance.rtol * m.ref_max_abs
    if m.rel_l2 > tolerance.rel_l2 and m.max_abs_err > tolerance.atol:
        return Check(item, dy_kind, "tolerance", f"rel L2 {m.rel_l2:.3g} > {tolerance.rel_l2:.3g}",
                     m, tolerance)
    if m.max_abs_err > limit:
        return Check(item, dy_kind, "tolerance", f"max abs err {m.max_abs_err:.3g} > {limit:.3g}",
                     m, tolerance)
    return Check(item, dy_kind, OK, "", m, tolerance)


def compare_vjp(candidate: nn.Module, reference: nn.Module, inputs: Sequence[Any], *,
                tolerances: Tolerance | Mapping[str, Tolerance],
                dy_kinds: Iterable[str | Sequence[torch.Tensor]] = DY_KINDS,
                seed: int = 0, declared_unused: Iterable[str] = (), name: str | None = None,
                tolerance_reasoning: str = "",
                contract_check: Callable[[nn.Module], list[str]] | None = None) -> ComparisonReport:
    """Compare the VJP of ``candidate`` with an independent ``reference`` item by item.

    candidate, reference: modules with the same parameter names and values held as independent
        tensors (refused with ValueError otherwise). Called as ``module(*inputs)``.
    inputs: positional inputs; tensors given with requires_grad=True are differentiable items
        (``input[i]``). Each side gets its own copy.
    tolerances: one Tolerance for all gradients or one per item name, derived in advance
        (``derive_tolerance`` or a contract's reference); an item without one is a KeyError.
    tolerance_reasoning: how the tolerances were derived; kept in the report.
    dy_kinds: "random", "zero", "sparse", "along_output" and/or explicit dY tensors (one per
        differentiable output).
    declared_unused: items that genuinely receive no gradient; any other gradient-less item fails.
    contract_check: optional callable returning mismatch lines between the candidate's declared
        surrogate and its gradient contract (each line becomes a failing check).
    """
    name = name or type(candidate).__name__
    check_same_parameters(candidate, reference)
    declared = set(declared_unused)
    report = ComparisonReport(name=name, kind="vjp", tolerance_reasoning=tolerance_reasoning)
    for k, dy in enumerate(dy_kinds):
        kind = dy if isinstance(dy, str) else f"user[{k}]"
        dy_seed = seed * 1000 + k
        out_c, grads_c, dys = run_backward(candidate, inputs, dy, dy_seed, "candidate")
        out_r, grads_r, _ = run_backward(reference, inputs, dys, dy_seed, "reference")
        fwd = max(float((a.detach().double() - b.detach().double()).abs().max()) for a, b in zip(out_c, out_r))
        report.notes.append(f"dY {kind}: forward max |candidate - reference| = {fwd:.3g}")
        unknown = declared - grads_c.keys()
        if unknown:
            raise ValueError(f"declared_unused names no differentiable item: {sorted(unknown)}")
        for item in grads_c:
            report.checks.append(compare_gradient(item, kind, grads_c[item], grads_r.get(item),
                                                  _tolerance_for(item, tolerances), item in declared))
    if contract_check is not None:
        for line in contract_check(candidate):
            report.checks.append(Check("contract", "-", "contract", line))
    return report

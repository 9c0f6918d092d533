"""Layer 1, step 6: one optimizer update from the same parameters and optimizer state."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from megatron_vllm_align.contracts import Tolerance

from .grad_metrics import grad_metrics
from .report import OK, Check, ComparisonReport
from .tolerances import unit_roundoff
from .vjp import check_same_parameters, run_backward


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD: its update is -lr * grad, so a wrong gradient scale shows in the update.
    (Adam's first step is about ±lr whatever the gradient's scale and would hide it.)"""
    return torch.optim.SGD(params, lr=1e-2)


def compare_one_step_update(candidate: nn.Module, reference: nn.Module, inputs: Sequence[Any], *,
                            tolerance: Tolerance, dy: str | Sequence[torch.Tensor] = "random",
                            optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
                            = default_optimizer, seed: int = 0,
                            name: str | None = None) -> ComparisonReport:
    """Run one forward/backward/step on each module and compare the parameter changes.

    Both modules must start from identical parameters (checked); each gets a fresh optimizer
    from ``optimizer_factory`` (same hyperparameters and state). An element of the change
    passes when ``|d_c - d_r| <= atol + rtol * max|d_r| + ulp(p)``: the last term is the one
    rounding each side makes when it writes the updated parameter in its own dtype.
    ``tolerance`` is the gradient tolerance; for SGD the update is -lr * grad, so relative
    figures carry over unchanged.
    """
    name = name or f"{type(candidate).__name__} one-step update"
    check_same_parameters(candidate, reference)
    report = ComparisonReport(name=name, kind="one_step_update")
    before = {n: p.detach().clone() for n, p in candidate.named_parameters()}
    _, _, dys = run_backward(candidate, inputs, dy, seed, "candidate")
    run_backward(reference, inputs, dys, seed, "reference")
    for module in (candidate, reference):
        opt = optimizer_factory([p for p in module.parameters() if p.requires_grad])
        opt.step()
    ref_params = dict(reference.named_parameters())
    for n, p in candidate.named_parameters():
        d_c = p.detach().double() - before[n].double()
        d_r = ref_params[n].detach().double() - before[n].double()
        m = grad_metrics(d_c, d_r)
        ulp = 2 * unit_roundoff(p.dtype) * before[n].double().abs()
        excess = (d_c - d_r).abs() - (tolerance.atol + tolerance.rtol * m.ref_max_abs) - ulp
        n_bad = int((excess > 0).sum())
        if n_bad:
            report.checks.append(Check(n, "update", "tolerance",
                                       f"{n_bad} of {excess.numel()} elements moved differently beyond "
                                       f"tolerance + one ulp (worst by {float(excess.max()):.3g})",
                                       m, tolerance))
        else:
            report.checks.append(Check(n, "update", OK, "", m, tolerance))
    return report

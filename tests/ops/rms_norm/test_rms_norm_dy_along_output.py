"""The "along_output" dY kind exposes backward terms that random dY hides at real widths.

Planted bug: VllmRMSNorm's closed-form backward without its projection term
(``d x = rstd * (h - xh * mean(h * xh))`` becomes ``rstd * h``). Under random dY that term is
about 1/sqrt(hidden) of the gradient, so the bug's error shrinks with width; with half of dY's
norm along the output it stays of order one. Widths are those of the models we claim (Qwen3-0.6B
1024 up to 8192) and one wider.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.rms_norm import vjp as rmsnorm
from megatron_vllm_align.ops.rms_norm.module import VllmRMSNorm
from megatron_vllm_align.ops.rms_norm.reference import ReferenceRMSNorm
from megatron_vllm_align.validation import compare_vjp
from megatron_vllm_align.validation.tolerances import contract_tolerances

EPS = 1e-6
WIDTHS = (1024, 4096, 8192, 16384)
SEEDS = (0, 1, 2)
TOKENS = 8


def _without_projection(total, gamma, grad_out, eps):
    rstd = torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps)
    return rstd * grad_out * gamma, grad_out * total * rstd


def _compare(context, hidden: int, seed: int, dy_kind: str):
    gen = torch.Generator().manual_seed(seed)
    candidate = VllmRMSNorm(hidden, EPS, vllm_context=context)
    with torch.no_grad():
        candidate.weight.copy_((1 + 0.3 * torch.randn(hidden, generator=gen)).bfloat16())
    x = torch.randn(TOKENS, hidden, generator=gen).bfloat16().requires_grad_()
    tolerances = contract_tolerances(get_default_contract("rms_norm"), {"input[0]": "input", "weight": "norm_weight"})
    return compare_vjp(candidate, ReferenceRMSNorm(candidate.weight, EPS), [x], tolerances=tolerances,
                       dy_kinds=[dy_kind], seed=seed, name=f"rms_norm hidden={hidden} seed={seed} dY={dy_kind}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hidden", WIDTHS)
def test_correct_rmsnorm_passes_along_output(bf16_context, hidden, seed):
    report = _compare(bf16_context, hidden, seed, "along_output")
    assert report.passed, "\n".join(report.failures())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hidden", WIDTHS)
def test_dropped_projection_term_is_caught_at_every_width(bf16_context, monkeypatch, hidden, seed):
    monkeypatch.setattr(rmsnorm, "rms_norm_input_grad", _without_projection)
    report = _compare(bf16_context, hidden, seed, "along_output")
    failed = {check.item for check in report.checks if not check.passed}
    assert "input[0]" in failed, report.to_markdown()


def test_random_dy_loses_the_dropped_projection_term_as_width_grows(bf16_context, monkeypatch):
    """Why the kind exists: the bug's relative error under random dY shrinks about as 1/sqrt(hidden),
    under "along_output" it does not (measured: printed)."""
    monkeypatch.setattr(rmsnorm, "rms_norm_input_grad", _without_projection)

    def rel_l2(hidden, kind):
        (check,) = [c for c in _compare(bf16_context, hidden, 0, kind).checks if c.item == "input[0]"]
        return check.metrics.rel_l2

    random = {hidden: rel_l2(hidden, "random") for hidden in (1024, 16384)}
    along = {hidden: rel_l2(hidden, "along_output") for hidden in (1024, 16384)}
    print(f"dropped projection term, rel L2 of dX: random {random}, along_output {along}")
    assert random[16384] < random[1024] / 2  # sqrt(16) = 4 in expectation
    assert along[16384] > 0.3 and along[1024] > 0.3

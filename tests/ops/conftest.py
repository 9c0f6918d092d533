"""Checkers for the op tests: elementwise kernel bounds and the one-rounding layer-1 tolerance (engine
contexts come from tests/conftest.py)."""

import pytest


def _check_elementwise_bound(actual, expected, roundings, extra=None):
    """Assert ``|actual - expected| <= roundings * u * |expected| (+ extra)`` elementwise, with u the
    unit roundoff of expected's dtype; returns the largest |difference| / (u |expected|) seen."""
    import torch

    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{actual.dtype} {tuple(actual.shape)} vs expected {expected.dtype} {tuple(expected.shape)}")
    u = torch.finfo(expected.dtype).eps / 2
    diff = (actual.double() - expected.double()).abs()
    bound = roundings * u * expected.double().abs()
    if extra is not None:
        bound = bound + extra.double()
    worst = int((diff - bound).flatten().argmax())
    assert bool((diff <= bound).all()), (
        f"elementwise bound broken at flat index {worst}: |diff| {diff.flatten()[worst]:.3g} > "
        f"{bound.flatten()[worst]:.3g} (actual {actual.flatten()[worst]}, expected {expected.flatten()[worst]})")
    scale = u * expected.double().abs()
    return float((diff / scale.clamp_min(torch.finfo(torch.float64).tiny)).max())


@pytest.fixture
def within_roundings():
    """The checker ``(actual, expected, roundings, extra=None)`` of the documented elementwise bounds."""
    return _check_elementwise_bound


def _one_rounding_tolerance(reduction_length: int):
    """Layer-1 tolerance for a bf16 gradient computed in fp32 and rounded once, against an fp32
    autograd reference that also rounds once (derived before any comparison is run):

    each side's single rounding to bf16 errs by at most u|g| (u = 2^-8), so the two differ by at
    most 2u|g| <= 2u max|g_ref| per element and 2u in relative L2; the fp32 arithmetic before the
    rounding (sums of up to ``reduction_length`` terms in a different order on each side) adds
    about 4 sqrt(n) 2^-24 (4 sigma). atol = 0: a zero dY must give exactly zero gradients.
    """
    import math

    from megatron_vllm_align.contracts import Tolerance

    u = 2.0 ** -8
    bound = 2 * u + 4 * math.sqrt(reduction_length) * 2.0 ** -24
    return Tolerance(rel_l2=bound, rtol=bound, atol=0.0)


@pytest.fixture
def one_rounding_tolerance():
    """``(reduction_length) -> Tolerance`` of :func:`_one_rounding_tolerance`."""
    return _one_rounding_tolerance


def _failing_checks(case, seed: int = 0, tokens: int = 37) -> set[tuple[str, str]]:
    """``(item, status)`` of every check that fails when ``case`` (a ``Layer1Case``) runs layer 1 once,
    with its contract's tolerances and every dY kind."""
    from megatron_vllm_align.validation.tolerances import contract_tolerances
    from megatron_vllm_align.validation.vjp import compare_vjp

    candidate, reference, inputs = case.build(seed, tokens)
    report = compare_vjp(candidate, reference, inputs, tolerances=contract_tolerances(case.contract, case.variables),
                         seed=seed)
    return {(c.item, c.status) for c in report.checks if not c.passed}


@pytest.fixture
def failing_checks():
    """``(case, seed=0, tokens=37) -> {(item, status)}`` of :func:`_failing_checks`."""
    return _failing_checks

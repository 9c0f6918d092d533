"""Checkers for the visible-kernel tests (engine contexts come from tests/conftest.py)."""

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

"""Tolerances for the module tests (engine contexts come from tests/conftest.py)."""

import pytest


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

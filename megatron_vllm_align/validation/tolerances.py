"""Layer-1 tolerances derived in advance from dtype, reduction length and reference precision.

The rule (docs/method.md#tolerances): a tolerance is computed before the comparison
runs, from facts about the arithmetic, and its reasoning is kept next to it. It is never relaxed
after a failure.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from megatron_vllm_align.contracts import ContractError, GradientContract, Tolerance

# Safety factors, fixed here once. Bound = K_ROUND * u_out + K_ACC * sqrt(n) * u_acc.
K_ROUND = 2.0   # candidate and reference each round the final value once: <= 2 half-ulps.
K_ACC = 4.0     # accumulation error grows like sqrt(n) * u in expectation; 4 sigma of headroom.
K_MAX = 4.0     # an element's error may exceed the RMS error; 4x for the max-abs bound.


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff u = 2^-(mantissa bits + 1) of a floating dtype (half an ulp at 1.0)."""
    if not dtype.is_floating_point:
        raise TypeError(f"unit_roundoff: {dtype} is not a floating dtype")
    return torch.finfo(dtype).eps / 2.0


def derive_tolerance(grad_dtype: torch.dtype, reduction_length: int,
                     accumulation_dtype: torch.dtype = torch.float32,
                     reference_dtype: torch.dtype = torch.float32,
                     extra_roundings: int = 0) -> tuple[Tolerance, str]:
    """Tolerance for one gradient compared against an independent reference, and its reasoning.

    grad_dtype: dtype the gradient is stored in (its final rounding).
    reduction_length: the longest sum behind one gradient element (K for dX of a linear, M
        tokens for dW, hidden size for a norm's row statistics, 1 for elementwise ops).
    accumulation_dtype: dtype the candidate accumulates in, per its contract.
    reference_dtype: dtype the reference computes in; its own error adds in the same way.
    extra_roundings: intermediate values the candidate rounds to ``grad_dtype`` that the
        reference keeps in higher precision (e.g. a bf16 visible output saved for backward).
    """
    if reduction_length < 1:
        raise ValueError(f"reduction_length must be >= 1, got {reduction_length}")
    if extra_roundings < 0:
        raise ValueError(f"extra_roundings must be >= 0, got {extra_roundings}")
    u_out = unit_roundoff(grad_dtype)
    u_acc = max(unit_roundoff(accumulation_dtype), unit_roundoff(reference_dtype))
    rounding = K_ROUND * u_out * (1 + extra_roundings)
    accumulation = K_ACC * math.sqrt(reduction_length) * u_acc
    rel_l2 = rounding + accumulation
    rtol = K_MAX * rel_l2
    atol = torch.finfo(grad_dtype).tiny
    reasoning = (
        f"grad dtype {str(grad_dtype).removeprefix('torch.')} (u={u_out:.3g}), "
        f"accumulation {str(accumulation_dtype).removeprefix('torch.')} / reference "
        f"{str(reference_dtype).removeprefix('torch.')} (u={u_acc:.3g}), reduction n={reduction_length}: "
        f"rel_l2 <= {K_ROUND:g}*u_out*(1+{extra_roundings} extra roundings) + "
        f"{K_ACC:g}*sqrt(n)*u_acc = {rel_l2:.3g}; max-abs <= {K_MAX:g}x that, relative to "
        f"max|g_ref| ({rtol:.3g}), plus the smallest normal ({atol:.3g}) for all-zero gradients."
    )
    return Tolerance(atol=atol, rtol=rtol, rel_l2=rel_l2), reasoning


def contract_tolerances(contract: GradientContract, variables: Mapping[str, str]) -> dict[str, Tolerance]:
    """``compare_vjp`` tolerances keyed by harness item (``input[0]``, a parameter name) from
    ``contract.reference``; ``variables`` maps each item to the contract's trainable variable."""
    known = contract.trainable.variables
    for item, variable in variables.items():
        if variable not in known:
            raise ContractError(f"harness item {item!r} needs the trainable variable {variable!r}; the contract "
                                f"lists {list(known)}", contract=contract.module_class, field="trainable.variables")
    return {item: contract.reference.tolerance_for(variable) for item, variable in variables.items()}

"""Compare what an implementation declares about its gradients with its contract."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_vllm_align.contracts.schema import STE, ContractError, GradientContract

_STE_KEYS = ("kind", "threshold", "value_at_threshold")


def _contract_values(contract: GradientContract) -> dict[str, tuple[str, Any]]:
    """Declarable name -> (contract field path, contract value)."""
    s, b = contract.surrogate, contract.backward
    return {
        "case": ("case", contract.case),
        "dx_weight": ("surrogate.dx_weight", s.dx_weight),
        "activation_ref": ("surrogate.activation_ref", s.activation_ref),
        "weight_ste": ("surrogate.weight_ste", s.weight_ste),
        "activation_ste": ("surrogate.activation_ste", s.activation_ste),
        "backward_kind": ("backward.kind", b.kind),
        "backward_implementation": ("backward.implementations", b.implementations),
        "scales": ("trainable.scales", contract.trainable.scales),
        "saved": ("save_recompute.save", contract.save_recompute.save),
    }


def _number_or_text(value: Any) -> Any:
    """Declared STE attribute in the contract's terms (integers compare as floats)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if is_number else value


def _ste_mismatches(field: str, declared: STE | Mapping[str, Any], expected: STE) -> list[str]:
    items = ({k: getattr(declared, k) for k in _STE_KEYS} if isinstance(declared, STE)
             else dict(declared))
    unknown = [k for k in items if k not in _STE_KEYS]
    if unknown:
        raise ContractError(f"unknown STE attribute {unknown[0]!r}; allowed: "
                            f"{', '.join(_STE_KEYS)}", field=field)
    return [f"{field}.{key}: implementation declares {value!r}, contract says "
            f"{getattr(expected, key)!r}"
            for key, value in items.items() if _number_or_text(value) != getattr(expected, key)]


def contract_mismatches(contract: GradientContract, **declared: Any) -> list[str]:
    """Lines describing where `declared` disagrees with `contract`; empty when consistent.

    Declarable names: case, dx_weight, activation_ref, backward_kind (exact values);
    weight_ste / activation_ste (an STE, or a mapping of any of kind, threshold,
    value_at_threshold, compared key by key; thresholds compare exactly: they are declared
    constants); backward_implementation (the one selected at run time; must be listed);
    scales (mapping, compared as a whole); saved (names of saved tensors, compared as a set).
    An unknown name raises ContractError, so a misspelt declaration cannot pass silently.
    """
    expected = _contract_values(contract)
    unknown = [name for name in declared if name not in expected]
    if unknown:
        raise ContractError(f"cannot compare unknown declaration {unknown[0]!r}; declarable: "
                            f"{', '.join(expected)}", contract=contract.module_class)
    lines = []
    for name, value in declared.items():
        field, want = expected[name]
        if name in ("weight_ste", "activation_ste"):
            try:
                lines += _ste_mismatches(field, value, want)
            except ContractError as error:
                raise error.within(contract=contract.module_class) from None
        elif name == "backward_implementation":
            if value not in want:
                lines.append(f"{field}: implementation uses {value!r}, contract allows "
                             f"{list(want)}")
        elif name == "saved":
            got = {value} if isinstance(value, str) else set(value)
            missing, extra = sorted(set(want) - got), sorted(got - set(want))
            if missing or extra:
                lines.append(f"{field}: implementation saves {sorted(got)}, contract says "
                             f"{sorted(want)} (missing {missing}, extra {extra})")
        elif value != want:
            lines.append(f"{field}: implementation declares {value!r}, contract says {want!r}")
    return [f"{contract.module_class}: {line}" for line in lines]

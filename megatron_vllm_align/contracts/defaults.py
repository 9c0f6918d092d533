"""The project's default gradient contracts, read from the YAML files in `defaults/`.

Each file `defaults/<module_class>.yaml` holds one contract; the files are the only source of
truth (package data, loaded through importlib.resources).
"""

from __future__ import annotations

import functools
import importlib.resources

from megatron_vllm_align.contracts.io import contracts_from_yaml
from megatron_vllm_align.contracts.schema import ContractError, GradientContract


@functools.cache
def _load_defaults() -> tuple[tuple[str, GradientContract], ...]:
    folder = importlib.resources.files(__package__).joinpath("defaults")
    contracts: dict[str, GradientContract] = {}
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".yaml"):
            continue
        for name, contract in contracts_from_yaml(entry.read_text(encoding="utf-8"),
                                                  source=f"defaults/{entry.name}").items():
            if name in contracts:
                raise ContractError("defined in two default files", contract=name,
                                    source=f"defaults/{entry.name}")
            contracts[name] = contract
    return tuple(contracts.items())


def default_contracts() -> dict[str, GradientContract]:
    """All default contracts keyed by module class (a new dict on each call)."""
    return dict(_load_defaults())


def get_default_contract(name: str) -> GradientContract:
    """The default contract of module class `name`; ContractError lists the available names."""
    contracts = default_contracts()
    if name not in contracts:
        raise ContractError(f"no default contract for this module class; available: "
                            f"{', '.join(sorted(contracts))}", contract=name)
    return contracts[name]

"""The project's default gradient contracts, read from each op's home.

Each file ``megatron_vllm_align/ops/<op>/<contract name>.yaml`` holds one contract named like the
file (the FP8 linear's home holds its three scale schemes); the files are the only source of truth
(package data, loaded through importlib.resources without importing the ops).
"""

from __future__ import annotations

import functools
import importlib.resources

from megatron_vllm_align.contracts.io import contracts_from_yaml
from megatron_vllm_align.contracts.schema import ContractError, GradientContract

OPS_PACKAGE = "megatron_vllm_align.ops"


def default_contract_files() -> list[tuple[str, str, str]]:
    """``(op, file name, YAML text)`` of every default contract file, sorted by op then file."""
    root = importlib.resources.files(OPS_PACKAGE)
    files = []
    for op in sorted(root.iterdir(), key=lambda item: item.name):
        if not op.is_dir() or op.name.startswith(("_", ".")):
            continue
        for entry in sorted(op.iterdir(), key=lambda item: item.name):
            if entry.name.endswith(".yaml"):
                files.append((op.name, entry.name, entry.read_text(encoding="utf-8")))
    return files


@functools.cache
def _load_defaults() -> tuple[tuple[str, GradientContract], ...]:
    contracts: dict[str, GradientContract] = {}
    for op, file_name, text in default_contract_files():
        source = f"ops/{op}/{file_name}"
        loaded = contracts_from_yaml(text, source=source)
        if list(loaded) != [file_name.removesuffix(".yaml")]:
            raise ContractError(f"a default contract file holds exactly the contract it is named after, got "
                                f"{sorted(loaded)}", source=source)
        for name, contract in loaded.items():
            if name in contracts:
                raise ContractError("defined in two default files", contract=name, source=source)
            contracts[name] = contract
    return tuple(contracts.items())


def default_contracts() -> dict[str, GradientContract]:
    """All default contracts keyed by contract name (a new dict on each call)."""
    return dict(_load_defaults())


def get_default_contract(name: str) -> GradientContract:
    """The default contract named ``name``; ContractError lists the available names."""
    contracts = default_contracts()
    if name not in contracts:
        raise ContractError(f"no default contract for this module class; available: "
                            f"{', '.join(sorted(contracts))}", contract=name)
    return contracts[name]

"""Gradient contracts as data: schema, YAML/Markdown I/O, defaults, and declaration checks."""

from megatron_vllm_align.contracts.defaults import default_contracts, get_default_contract
from megatron_vllm_align.contracts.io import (
    contract_from_dict,
    contract_to_dict,
    contracts_from_yaml,
    contracts_to_yaml,
    load_contracts,
    save_contracts,
)
from megatron_vllm_align.contracts.markdown import contract_to_markdown, contracts_table_markdown
from megatron_vllm_align.contracts.mismatches import contract_mismatches
from megatron_vllm_align.contracts.schema import (
    STE,
    BackwardSource,
    ContractError,
    DiscreteState,
    GradientContract,
    QuantizePosition,
    Reference,
    SaveRecompute,
    Surrogate,
    Tolerance,
    Trainable,
    VisibleForward,
)

__all__ = [
    "STE",
    "BackwardSource",
    "ContractError",
    "DiscreteState",
    "GradientContract",
    "QuantizePosition",
    "Reference",
    "SaveRecompute",
    "Surrogate",
    "Tolerance",
    "Trainable",
    "VisibleForward",
    "contract_from_dict",
    "contract_mismatches",
    "contract_to_dict",
    "contract_to_markdown",
    "contracts_from_yaml",
    "contracts_table_markdown",
    "contracts_to_yaml",
    "default_contracts",
    "get_default_contract",
    "load_contracts",
    "save_contracts",
]

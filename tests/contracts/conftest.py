"""Fixtures for the gradient-contract tests: fresh plain-dict copies of default contracts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from megatron_vllm_align.contracts import contract_to_dict, get_default_contract


@pytest.fixture
def contract_data() -> Callable[[str], dict[str, Any]]:
    """Factory: the default contract `name` as a new plain dict, safe to mutate."""
    return lambda name: contract_to_dict(get_default_contract(name))

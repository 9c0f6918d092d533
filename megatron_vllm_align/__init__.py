"""megatron-vllm-align: the training forward is the inference forward.

Megatron-Core layers run vLLM's own kernels and weight processing in forward and reuse a
training backward; gradient contracts, three validation layers and training guards prove it.

Public names are loaded lazily (PEP 562) so that ``import megatron_vllm_align`` does not import
vLLM or Megatron until a name that needs them is used.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # accuracy comparisons (seed 003)
    "assert_close": "megatron_vllm_align.accuracy",
    "assert_close_three_way": "megatron_vllm_align.accuracy",
    "compare_three_way": "megatron_vllm_align.accuracy",
    # layer-1 backward validation (seed 000)
    "compare_vjp": "megatron_vllm_align.validation",
    "compare_one_step_update": "megatron_vllm_align.validation",
    "derive_tolerance": "megatron_vllm_align.validation",
    "gradcheck_module": "megatron_vllm_align.validation",
    "visible_forward": "megatron_vllm_align.validation",
    "visible_with_surrogate": "megatron_vllm_align.validation",
    "VisibleWithSurrogate": "megatron_vllm_align.validation",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_vllm_align' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)

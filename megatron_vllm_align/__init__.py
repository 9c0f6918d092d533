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
    # accuracy comparisons (two-way, three-way)
    "assert_close": "megatron_vllm_align.accuracy",
    "assert_close_three_way": "megatron_vllm_align.accuracy",
    "compare_three_way": "megatron_vllm_align.accuracy",
    "compare_two_way": "megatron_vllm_align.accuracy",
    "sigma_ratio": "megatron_vllm_align.accuracy",
    "bhattacharyya_coefficient": "megatron_vllm_align.accuracy",
    "per_input_ratios": "megatron_vllm_align.accuracy",
    "ThreeWayResult": "megatron_vllm_align.accuracy",
    # gradient contracts as data
    "GradientContract": "megatron_vllm_align.contracts",
    "ContractError": "megatron_vllm_align.contracts",
    "load_contracts": "megatron_vllm_align.contracts",
    "save_contracts": "megatron_vllm_align.contracts",
    "default_contracts": "megatron_vllm_align.contracts",
    "get_default_contract": "megatron_vllm_align.contracts",
    "contract_to_markdown": "megatron_vllm_align.contracts",
    "contracts_table_markdown": "megatron_vllm_align.contracts",
    "contract_mismatches": "megatron_vllm_align.contracts",
    # quantization numerics and straight-through estimators
    "FP8Scheme": "megatron_vllm_align.quant",
    "quantize_fp8": "megatron_vllm_align.quant",
    "dequantize_fp8": "megatron_vllm_align.quant",
    "NVFP4Tensor": "megatron_vllm_align.quant",
    "quantize_nvfp4": "megatron_vllm_align.quant",
    "dequantize_nvfp4": "megatron_vllm_align.quant",
    "ste_quantize": "megatron_vllm_align.quant",
    "FP8Linear": "megatron_vllm_align.ops.fp8_linear",
    "FP8LinearConfig": "megatron_vllm_align.ops.fp8_linear",
    # layer-1 backward validation
    "compare_vjp": "megatron_vllm_align.validation",
    "compare_one_step_update": "megatron_vllm_align.validation",
    "derive_tolerance": "megatron_vllm_align.validation",
    "gradcheck_module": "megatron_vllm_align.validation",
    "visible_forward": "megatron_vllm_align.validation",
    "visible_with_surrogate": "megatron_vllm_align.validation",
    "VisibleWithSurrogate": "megatron_vllm_align.validation",
    "ComparisonReport": "megatron_vllm_align.validation",
    # trainer vs engine mismatch
    "logprob_mismatch": "megatron_vllm_align.validation.logprob_mismatch",
    # training guards
    "GradientDumper": "megatron_vllm_align.guards",
    "load_gradient_dump": "megatron_vllm_align.guards",
    "diff_gradient_dumps": "megatron_vllm_align.guards",
    "check_optimizer_identity": "megatron_vllm_align.guards",
    "validate_freeze": "megatron_vllm_align.guards",
    "FreezeViolation": "megatron_vllm_align.guards",
    # Megatron-Core models
    "get_gpt_layer_vllm_spec": "megatron_vllm_align.megatron",
    "build_gpt_from_hf": "megatron_vllm_align.megatron",
    "token_logprobs": "megatron_vllm_align.megatron",
    "completion_logprobs": "megatron_vllm_align.megatron",
    # the linear backward's numerics (Megatron's own GEMMs, or the fp32 closed form)
    "backward_precision": "megatron_vllm_align.ops.dense_linear",
    "set_backward_precision": "megatron_vllm_align.ops.dense_linear",
    # rollouts from the real engine (sampled tokens; MVA_INVARIANT=1 for bitwise equality)
    "sample_completions": "megatron_vllm_align.engine",
    "SampledCompletion": "megatron_vllm_align.engine",
    "enable_cpu_compat": "megatron_vllm_align.megatron",
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

"""The W8A8 FP8 linear (contracts ``fp8_linear_per_channel`` / ``_per_tensor`` / ``_block128``): vLLM's FP8 method
forward, the linear VJP on the contract's references."""
from megatron_vllm_align.ops.fp8_linear.emulated import (
    FP8Linear,
    FP8LinearConfig,
    FP8LinearFunction,
    default_fp8_linear_config,
    fp8_linear,
)
from megatron_vllm_align.ops.fp8_linear.kernel import (
    FP8_ACTIVATION_SCHEME,
    FP8_WEIGHT_SCHEME,
    fp8_linear_native,
)
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear, VllmFP8LinearFunction
from megatron_vllm_align.ops.fp8_linear.reference import FP8_LINEAR_VARIABLES, ReferenceFP8Linear
from megatron_vllm_align.ops.fp8_linear.vjp import check_reference_choices, fp8_linear_vjp, saved_tensor_names

__all__ = [
    "FP8_LINEAR_VARIABLES", "FP8Linear", "FP8LinearConfig", "FP8LinearFunction",
    "FP8_ACTIVATION_SCHEME", "FP8_WEIGHT_SCHEME", "ReferenceFP8Linear", "VllmFP8Linear",
    "VllmFP8LinearFunction", "check_reference_choices", "default_fp8_linear_config", "fp8_linear",
    "fp8_linear_native", "fp8_linear_vjp", "saved_tensor_names",
]

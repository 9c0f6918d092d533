"""Autograd modules: vLLM's visible forward, a reused / closed-form training backward."""
from megatron_vllm_align.modules.attention import VllmCausalAttentionFunction, VllmDotProductAttention
from megatron_vllm_align.modules.linear import (
    DenseLinearFunction,
    VllmDenseLinear,
    VllmFP8Linear,
    VllmFP8LinearFunction,
    linear_vjp,
)
from megatron_vllm_align.modules.logprob import SelectedLogprobFunction, VllmSelectedLogprob
from megatron_vllm_align.modules.refresh import refresh_deployed_weights, register_deployed_refresh
from megatron_vllm_align.modules.rmsnorm import FusedAddRMSNormFunction, RMSNormFunction, VllmRMSNorm
from megatron_vllm_align.modules.rotary import RotaryFunction, VllmRotaryEmbedding
from megatron_vllm_align.modules.silu_and_mul import SiluAndMulFunction, VllmSiluAndMul

__all__ = [
    "DenseLinearFunction", "FusedAddRMSNormFunction", "RMSNormFunction", "RotaryFunction",
    "SelectedLogprobFunction", "SiluAndMulFunction", "VllmCausalAttentionFunction", "VllmDenseLinear",
    "VllmDotProductAttention", "VllmFP8Linear", "VllmFP8LinearFunction", "VllmRMSNorm", "VllmRotaryEmbedding",
    "VllmSelectedLogprob", "VllmSiluAndMul", "linear_vjp", "refresh_deployed_weights",
    "register_deployed_refresh",
]

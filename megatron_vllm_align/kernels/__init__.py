"""Visible kernels: vLLM's own layers and ops, run in the engine's configuration, each with a
readable native reference beside it."""
from megatron_vllm_align.kernels.activation import VllmSiluAndMulKernel, silu_and_mul_native
from megatron_vllm_align.kernels.attention import attention_native, vllm_prefill_attention
from megatron_vllm_align.kernels.linear import VllmLinearKernel, fp8_linear_native, linear_native
from megatron_vllm_align.kernels.logprob import selected_logprob_native, vllm_selected_logprob
from megatron_vllm_align.kernels.norm import VllmRMSNormKernel, rms_norm_native
from megatron_vllm_align.kernels.rotary import VllmRotaryKernel, rotary_native
from megatron_vllm_align.kernels.vllm_context import EngineSpec, VllmContext, engine_vllm_config, vllm_context

__all__ = [
    "EngineSpec", "VllmContext", "VllmLinearKernel", "VllmRMSNormKernel", "VllmRotaryKernel",
    "VllmSiluAndMulKernel", "attention_native", "engine_vllm_config", "fp8_linear_native", "linear_native",
    "rms_norm_native", "rotary_native", "selected_logprob_native", "silu_and_mul_native",
    "vllm_context", "vllm_prefill_attention", "vllm_selected_logprob",
]

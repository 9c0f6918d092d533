"""The output layer: vLLM's ``lm_head`` + ``LogitsProcessor`` on the engine's row sets, the reused linear VJP."""
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel, engine_logit_calls
from megatron_vllm_align.ops.output_layer.module import OutputLogitsFunction
from megatron_vllm_align.ops.output_layer.vjp import output_layer_vjp

__all__ = ["OutputLogitsFunction", "VllmLMHeadKernel", "engine_logit_calls", "output_layer_vjp"]

"""The vLLM-forward spec for Llama / Qwen2 / Qwen3-style dense and Qwen-MoE GPT layers.

``GPTModel(config, transformer_layer_spec=get_gpt_layer_vllm_spec(config, ctx), ...)`` builds a model
whose decoder runs the vLLM engine's forward (``ctx`` = :func:`vllm_context` of the model the engine
serves) with the local spec's module tree and parameter names; the output layer is installed after the
model is built (``install_vllm_output_layer``). MoE layers (``moe_layer_pattern(config)``) take
:class:`~.vllm_moe.VllmMoELayer`, unquantized only. With ``quantization="fp8_per_channel"`` the four
linears the engine quantizes become the FP8 classes; any other quant method is refused when the layer
is built, as is a config without ``use_te_activation_func`` (:data:`VLLM_FORWARD_CONFIG_OVERRIDES`
sets it). Residual handling: :mod:`.vllm_layers`. Module-by-module table and vLLM counterparts:
docs/megatron_facts.md#the-vllm-forward-spec-megatronvllm_specpy.
"""
from __future__ import annotations

import functools
from typing import Any

from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_vllm_align.megatron.engine_layout import engine_shards
from megatron_vllm_align.megatron.vllm_attention import VllmSelfAttention
from megatron_vllm_align.megatron.vllm_layers import (
    VllmFinalRMSNorm,
    VllmTransformerLayer,
    check_vllm_forward_config,
)
from megatron_vllm_align.megatron.vllm_linear import (
    VllmMegatronFP8Linear,
    VllmMegatronFP8QKVLinear,
    VllmMegatronLinear,
    VllmMegatronQKVLinear,
)
from megatron_vllm_align.megatron.vllm_moe import VllmMoELayer
from megatron_vllm_align.ops.attention.module import VllmDotProductAttention
from megatron_vllm_align.ops.rms_norm.module import VllmRMSNorm
from megatron_vllm_align.ops.silu_and_mul.module import VllmSiluAndMul
from megatron_vllm_align.ops.vllm_context import VllmContext

# TransformerConfig fields the vLLM-forward layers need beyond transformer_config_from_hf's.
VLLM_FORWARD_CONFIG_OVERRIDES: dict[str, Any] = {"use_te_activation_func": True}


def vllm_layer_spec(vllm_context: VllmContext, qk_layernorm: bool = False, moe: bool = False,
                    head_shards: int = 1) -> ModuleSpec:
    """ModuleSpec of one vLLM-forward decoder layer (table in the module docstring); FP8 linears
    when ``vllm_context`` has a quantization config; :class:`~.vllm_moe.VllmMoELayer` as the
    ``mlp`` when ``moe``; attention heads in ``head_shards`` groups (:mod:`.engine_layout`)."""
    on_engine = {"vllm_context": vllm_context}
    quantized = vllm_context.quant_config is not None
    norm = ModuleSpec(module=VllmRMSNorm, params=on_engine)
    linear = ModuleSpec(module=VllmMegatronFP8Linear if quantized else VllmMegatronLinear, params=on_engine)
    qkv_linear = VllmMegatronFP8QKVLinear if quantized else VllmMegatronQKVLinear
    attention = ModuleSpec(
        module=VllmSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, **on_engine},
        submodules=SelfAttentionSubmodules(
            # SelfAttention calls linear_qkv and core_attention directly (builders, not specs).
            linear_qkv=functools.partial(qkv_linear, vllm_context=vllm_context),
            core_attention=functools.partial(VllmDotProductAttention, head_shards=head_shards),
            linear_proj=linear,
            q_layernorm=norm if qk_layernorm else None,
            k_layernorm=norm if qk_layernorm else None,
        ),
    )
    if moe:
        mlp = ModuleSpec(module=VllmMoELayer, params=on_engine)
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=linear,
            activation_func=ModuleSpec(module=VllmSiluAndMul, params=on_engine),
            linear_fc2=linear,
        ))
    return ModuleSpec(
        module=VllmTransformerLayer,
        params=on_engine,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=attention, pre_mlp_layernorm=norm, mlp=mlp),
    )


def moe_layer_pattern(config: Any) -> list[bool]:
    """Which of ``config.num_layers`` layers are MoE layers: none without ``num_moe_experts``; else
    ``moe_layer_freq`` as Megatron reads it (int N: layers 0, N, 2N, ...; list: 1 = MoE, 0 = dense)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    if len(freq) != config.num_layers or set(freq) - {0, 1}:
        raise ValueError(f"TransformerConfig.moe_layer_freq = {freq}: expected {config.num_layers} entries of 0 or 1")
    return [entry == 1 for entry in freq]


def get_gpt_layer_vllm_spec(config: Any, vllm_context: VllmContext) -> TransformerBlockSubmodules:
    """The decoder spec for ``GPTModel(config, transformer_layer_spec=...)``: ``config.num_layers``
    vLLM-forward layers (q/k norms when ``config.qk_layernorm``; MoE where
    :func:`moe_layer_pattern` says) and the fused final norm.

    ``config`` must carry :data:`VLLM_FORWARD_CONFIG_OVERRIDES` and pass
    :func:`~.vllm_layers.check_vllm_forward_config` (``params_dtype`` the engine's dtype, no
    dropout, ...): ValueError naming the field otherwise.
    """
    for field, value in VLLM_FORWARD_CONFIG_OVERRIDES.items():
        if getattr(config, field) != value:
            raise ValueError(f"TransformerConfig.{field} must be {value!r} for the vLLM-forward spec "
                             "(see VLLM_FORWARD_CONFIG_OVERRIDES)")
    check_vllm_forward_config(config, vllm_context.model_dtype)
    qk_layernorm = bool(config.qk_layernorm)
    head_shards = engine_shards(vllm_context, config.tensor_model_parallel_size)
    return TransformerBlockSubmodules(
        layer_specs=[vllm_layer_spec(vllm_context, qk_layernorm, moe, head_shards)
                     for moe in moe_layer_pattern(config)],
        layer_norm=ModuleSpec(module=VllmFinalRMSNorm, params={"vllm_context": vllm_context}),
    )

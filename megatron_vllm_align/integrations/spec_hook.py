"""The recipe's ``align`` flag as the hooks NeMo 2 / Megatron-Bridge model configs take.

Both frameworks build a GPTModel from a TransformerConfig subclass (NeMo 2 ``GPTConfig``,
Megatron-Bridge ``GPTModelProvider``) whose ``transformer_layer_spec`` field may be a callable
``spec(config) -> ModuleSpec``. :func:`transformer_layer_spec_hook` returns that callable;
:func:`align_config_overrides` the config fields the vLLM-forward spec requires; and
:func:`finish_aligned_model` the step after ``GPTModel`` is built (vLLM output layer, deployed
values refreshed), e.g. as a Megatron-Bridge pre-wrap hook.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from megatron_vllm_align.megatron.build import LayerSpec, local_layer_spec
from megatron_vllm_align.ops.vllm_context import (
    EngineSpec,
    VllmContext,
    vllm_context,
)
from megatron_vllm_align.train.config import AlignSection


def _check_align(align: AlignSection) -> None:
    if not isinstance(align, AlignSection):
        raise TypeError(f"align must be an AlignSection (the recipe's align section), got {type(align).__name__}")


def engine_context_for(align: AlignSection, checkpoint_dir: str, dtype: str = "bfloat16") -> VllmContext:
    """The served engine's vLLM context: model ``checkpoint_dir`` (its config.json), ``dtype`` and
    ``align.quantization``."""
    _check_align(align)
    return vllm_context(EngineSpec(str(checkpoint_dir), dtype=dtype, quantization=align.quantization))


def align_config_overrides(align: AlignSection) -> dict[str, Any]:
    """TransformerConfig fields to set on the model config: the vLLM-forward spec's required
    values when ``align.enabled``, else none."""
    _check_align(align)
    if not align.enabled:
        return {}
    from megatron_vllm_align.megatron.vllm_spec import VLLM_FORWARD_CONFIG_OVERRIDES

    return dict(VLLM_FORWARD_CONFIG_OVERRIDES)


def transformer_layer_spec_hook(align: AlignSection, checkpoint_dir: str,
                                dtype: str = "bfloat16") -> Callable[[Any], LayerSpec]:
    """``spec(config)`` for ``transformer_layer_spec``: vLLM-forward layers of the engine serving
    ``checkpoint_dir`` when ``align.enabled`` (config must carry :func:`align_config_overrides`
    and ``params_dtype`` equal to the engine's dtype, else ValueError naming the field);
    Megatron's local spec otherwise. The engine context is resolved when the spec is built."""
    _check_align(align)
    if not align.enabled:
        return local_layer_spec

    def vllm_spec(config: Any) -> LayerSpec:
        from megatron_vllm_align.megatron.vllm_spec import get_gpt_layer_vllm_spec

        return get_gpt_layer_vllm_spec(config, engine_context_for(align, checkpoint_dir, dtype))

    return vllm_spec


def finish_aligned_model(model: nn.Module, align: AlignSection, checkpoint_dir: str,
                         dtype: str = "bfloat16") -> nn.Module:
    """After ``GPTModel`` is built with :func:`transformer_layer_spec_hook` (and weights loaded, if
    any): when ``align.enabled`` install the vLLM output layer and refresh every deployed value;
    a no-op otherwise. Returns ``model``."""
    _check_align(align)
    if not align.enabled:
        return model
    from megatron_vllm_align.megatron.vllm_output import install_vllm_output_layer
    from megatron_vllm_align.ops.refresh import refresh_deployed_weights

    install_vllm_output_layer(model, engine_context_for(align, checkpoint_dir, dtype))
    refresh_deployed_weights(model)
    return model

"""A Megatron transformer layer that carries the residual stream the way vLLM's decoder does.

vLLM's decoder passes ``(branch output, residual)`` to the next RMSNorm, which adds them in fp32 and
normalises the unrounded sum; Megatron's bias-dropout-add would round the sum to bf16 first, so it
cannot be bit-exact (docs/megatron_facts.md#the-residual-stream-megatronvllm_layerspy). Between layers
the hidden state is therefore ``[s, b, 2h] = [branch | residual]`` (:func:`join_residual_stream`); the
block's input (the embeddings, ``[s, b, h]``) has none yet. Layer i (:class:`VllmTransformerLayer`):

    x, residual = input_layernorm(branch, residual)      # plain RMSNorm at layer 0
    x, residual = pre_mlp_layernorm(self_attention(x), residual)
    return [mlp(x) | residual]

and the final norm (:class:`VllmFinalRMSNorm`) is ``model.norm(branch, residual)``. Recompute:
``"full"`` is Megatron's own; ``"selective"`` honours ``core_attn`` and ``mlp`` and refuses the rest
(docs/method.md#saved-state-and-recompute). Refused: pipeline parallel size > 1 (a stage boundary would
carry ``2h`` features) and sequence parallelism (:func:`check_vllm_forward_config`); the bda submodules
are unused. Tensor parallelism: :mod:`.vllm_tensor_parallel`.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_vllm_align.ops.rms_norm.module import VllmRMSNorm


def join_residual_stream(branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The residual stream ``[..., 2h] = [branch | residual]`` passed between vLLM-forward layers."""
    return torch.cat([branch, residual], dim=-1)


def split_residual_stream(stream: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(branch, residual)`` of a residual stream; ``(stream, None)`` for a plain ``[..., h]`` input."""
    width = stream.shape[-1]
    if width == hidden_size:
        return stream, None
    if width != 2 * hidden_size:
        raise ValueError(f"hidden states must have {hidden_size} (embeddings) or {2 * hidden_size} "
                         f"([branch | residual]) features, got {width}")
    branch, residual = stream.split(hidden_size, dim=-1)
    return branch, residual


# Selective recompute the layer honours: core attention (VllmSelfAttention) and the dense MLP.
SELECTIVE_RECOMPUTE_MODULES = frozenset({"core_attn", "mlp"})


def check_vllm_forward_config(config: Any, model_dtype: torch.dtype) -> None:
    """ValueError naming the TransformerConfig field that the vLLM decoder forward cannot honour."""
    required = {
        "params_dtype": model_dtype,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "fp32_residual_connection": False,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "use_te_activation_func": True,  # MLP applies the spec's activation (vLLM's SiluAndMul) to [gate | up]
    }
    if config.sequence_parallel:
        raise ValueError("TransformerConfig.sequence_parallel = True; the vLLM-forward layer needs False: vLLM's "
                         "decoder keeps activations replicated over the tensor-parallel ranks (all-reduce after "
                         "each row-parallel linear, no reduce-scatter), and its fused norm reads the [branch | "
                         "residual] stream whole")
    why = {"pipeline_model_parallel_size": "a pipeline stage boundary would carry the [branch | residual] "
                                           "stream of 2h features, which Megatron's schedules do not send",
           "context_parallel_size": "vLLM's attention reads each sequence whole"}
    for field, expected in required.items():
        value = getattr(config, field)
        if value != expected:
            raise ValueError(f"TransformerConfig.{field} = {value!r}; the vLLM-forward layer needs {expected!r} "
                             f"({why.get(field, f'engine dtype {model_dtype}')})")
    if config.activation_func is not torch.nn.functional.silu:
        raise ValueError(f"TransformerConfig.activation_func = {config.activation_func!r}; the vLLM-forward "
                         "layer runs SiLU-and-mul (F.silu)")
    if config.recompute_granularity == "selective":
        unsupported = sorted(set(config.recompute_modules) - SELECTIVE_RECOMPUTE_MODULES)
        if unsupported:
            raise ValueError(f"TransformerConfig.recompute_modules = {config.recompute_modules}: {unsupported} "
                             f"cannot be recomputed by the vLLM-forward layer (supported: "
                             f"{sorted(SELECTIVE_RECOMPUTE_MODULES)}; 'layernorm' recompute would discard the "
                             "fused norm's residual output, which the next norm saves for its backward)")


class VllmTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose forward is vLLM's decoder layer on the residual stream
    (module docstring). Submodules and parameter names are the local spec's.

    ``forward(hidden_states [s, b, h] or [s, b, 2h], attention_mask, ..., packed_seq_params) ->
    ([s, b, 2h] residual stream, context)``. ``vllm_context`` (a spec param) is the engine whose
    dtype the config is checked against (:func:`check_vllm_forward_config`).
    """

    def __init__(self, config: Any, submodules: Any, layer_number: int = 1, hidden_dropout: float | None = None,
                 pg_collection: Any = None, vp_stage: int | None = None, *, vllm_context: Any, **kwargs: Any
                 ) -> None:
        check_vllm_forward_config(config, vllm_context.model_dtype)
        if hidden_dropout:
            raise ValueError(f"hidden_dropout must be 0 for the vLLM forward, got {hidden_dropout}")
        super().__init__(config, submodules, layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.vllm_context = vllm_context

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
                packed_seq_params: Any = None, inference_context: Any = None, **kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # One entry of the engine's vLLM context for all of the layer's kernels (each would enter it again).
        with self.vllm_context.active(parallel_state=True):
            return self._decoder_layer(hidden_states, attention_mask, inference_context, packed_seq_params, context)

    def _decoder_layer(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                       inference_context: Any, packed_seq_params: Any, context: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        branch, residual = split_residual_stream(hidden_states, self.config.hidden_size)
        if residual is None:
            residual = branch
            x = self.input_layernorm(branch)
        else:
            x, residual = self.input_layernorm(branch, residual)
        attention_out, _ = self.self_attention(x, attention_mask=attention_mask, inference_context=inference_context,
                                               packed_seq_params=packed_seq_params)
        x, residual = self.pre_mlp_layernorm(attention_out, residual)
        if self.recompute_mlp:
            mlp_out, _ = tensor_parallel.checkpoint(self.mlp, False, x)
        else:
            mlp_out, _ = self.mlp(x)
        return join_residual_stream(mlp_out, residual), context


class VllmFinalRMSNorm(VllmRMSNorm):
    """The block's final norm on the residual stream: vLLM's ``model.norm(branch, residual)``
    (fused add); a plain RMSNorm when the input has no residual part. Returns [..., h]."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            raise ValueError("VllmFinalRMSNorm takes the residual stream as one tensor, not a separate residual")
        branch, residual = split_residual_stream(hidden_states, self.weight.shape[0])
        if residual is None:
            return super().forward(branch)
        normed, _ = super().forward(branch, residual)
        return normed

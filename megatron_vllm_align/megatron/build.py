"""Build a megatron-core GPTModel from a Hugging Face dense, Qwen3-MoE or Qwen2-MoE checkpoint.

``build_gpt_from_hf(dir)`` is the native Megatron path (local spec). ``align=True`` builds the
vLLM-forward model (:mod:`.vllm_spec`, engine context from the same checkpoint directory) and
replaces the output layer by :class:`~.vllm_output.VllmOutputLayer`. Any spec must keep the
local spec's parameter names (``input_layernorm.weight``, ``self_attention.linear_qkv.weight``,
...) so that the same converted weights load into it. MoE checkpoints: the native path uses
Megatron's local MoE spec (``SequentialMLP`` experts, allgather dispatcher, no auxiliary loss);
the aligned one :class:`~.vllm_moe.VllmMoELayer`, whose stacked expert weights
:func:`~.vllm_moe.stack_expert_weights` makes from the same converted tensors.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_vllm_align.megatron.cpu_compat import (
    MOE_PATCHES,
    enable_cpu_compat,
    init_single_process_cpu,
)
from megatron_vllm_align.megatron.hf_checkpoint import (
    HFCheckpointError,
    HFDenseConfig,
    megatron_state_dict_from_hf,
    read_hf_config,
    read_hf_tensors,
)
from megatron_vllm_align.megatron.vllm_tensor_parallel import (
    is_gated_fc1,
    local_shard,
    mark_megatron_shards,
)
from megatron_vllm_align.ops.refresh import refresh_deployed_weights
from megatron_vllm_align.ops.vllm_context import (
    EngineSpec,
    VllmContext,
    vllm_context,
)

LayerSpec = ModuleSpec | TransformerBlockSubmodules
LayerSpecSource = LayerSpec | Callable[[TransformerConfig], LayerSpec]


def transformer_config_from_hf(
    hf_config: HFDenseConfig, params_dtype: torch.dtype = torch.bfloat16, **overrides
) -> TransformerConfig:
    """The TransformerConfig of `hf_config`'s decoder: RMSNorm, gated SiLU MLP, GQA, no dropout.

    Biases only on q/k/v when the checkpoint has them (Qwen2); CPU initialisation without
    random init (the weights are loaded next). MoE (``hf_config.moe``): experts, top-k, expert
    FFN size, renormalised top-k softmax exactly when ``norm_topk_prob`` (else softmax over all
    experts first, ``moe_router_pre_softmax``), the sparse layers as a ``moe_layer_freq`` list,
    allgather dispatcher (it runs on CPU), no load-balancing loss; a Qwen2-MoE shared expert as
    Megatron's gated shared expert (``moe_shared_expert_gate``). `overrides` are extra
    TransformerConfig fields.
    """
    fields = dict(
        num_layers=hf_config.num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.qkv_bias,
        qk_layernorm=hf_config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    moe = hf_config.moe
    if moe is not None:
        fields.update(
            num_moe_experts=moe.num_experts,
            moe_router_topk=moe.top_k,
            moe_ffn_hidden_size=moe.moe_intermediate_size,
            moe_router_pre_softmax=not moe.norm_topk_prob,
            moe_layer_freq=[int(i in moe.sparse_layers) for i in range(hf_config.num_layers)],
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
        if moe.shared_expert_intermediate_size:
            fields.update(moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                          moe_shared_expert_gate=True)
    fields.update(overrides)
    return TransformerConfig(**fields)


def local_layer_spec(config: TransformerConfig) -> LayerSpec:
    """Megatron's local (no Transformer Engine) layer spec for `config`; for MoE configs its
    decoder block spec (MoE layers where ``config.moe_layer_freq`` says)."""
    if config.num_moe_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)


def load_megatron_params(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (full, TP = 1 tensors) into `model`'s parameters by name (cast to each
    parameter's dtype); under tensor parallelism each parameter gets its rank's shard
    (:func:`~.vllm_tensor_parallel.local_shard`).

    The parameter names and `state`'s keys must match exactly; shapes must match (or shard). Raises
    ValueError naming the missing / unexpected / misshapen entries.
    """
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"load_megatron_params: parameters without a checkpoint tensor: {missing[:8]}; "
            f"checkpoint tensors without a parameter: {unexpected[:8]}"
        )
    try:
        local = {name: local_shard(name, state[name], param, is_gated_fc1(model, name))
                 for name, param in params.items()}
    except ValueError as error:
        raise ValueError(f"load_megatron_params: {error}") from error
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local[name])


# Megatron's llama3 RoPE scaling has these fixed (RotaryEmbedding._apply_scaling).
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def native_rope_scaling(hf_config: HFDenseConfig) -> dict:
    """GPTModel's RoPE scaling arguments for Megatron's local spec: none for plain RoPE, llama3 with
    Megatron's fixed factors; any other scaling raises HFCheckpointError naming it (the aligned model
    takes every scaling from vLLM)."""
    scaling = hf_config.rope_scaling
    if scaling is None:
        return {}
    fixed = {key: float(scaling.get(key, value)) for key, value in _MEGATRON_LLAMA3.items()}
    if scaling["rope_type"] != "llama3" or fixed != _MEGATRON_LLAMA3:
        raise HFCheckpointError(f"Megatron's local spec has no {scaling['rope_type']!r} RoPE scaling with "
                                f"{scaling} (it implements llama3 with {_MEGATRON_LLAMA3}); build with align=True")
    return {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def build_gpt_from_hf(
    checkpoint_dir: str | os.PathLike,
    align: bool = False,
    *,
    transformer_layer_spec: LayerSpecSource | None = None,
    params_dtype: torch.dtype = torch.bfloat16,
    engine_context: VllmContext | None = None,
    quantization: str | None = None,
    engine_tensor_parallel_size: int | None = None,
    **config_overrides,
) -> GPTModel:
    """A GPTModel with the weights of the HF checkpoint in `checkpoint_dir`, every parameter in `params_dtype`.

    align=False: Megatron's local spec unless `transformer_layer_spec` is given (MoE: its decoder
    block spec; on CPU this installs ``cpu_compat.MOE_PATCHES``, process-wide).
    align=True: the vLLM-forward model: `transformer_layer_spec` defaults to
    :func:`~.vllm_spec.get_gpt_layer_vllm_spec`, the output layer is a
    :class:`~.vllm_output.VllmOutputLayer` on the same weight, and every deployed (shadow) value
    is refreshed after loading. `engine_context` is the served engine's vLLM context (default:
    ``vllm_context(EngineSpec(checkpoint_dir, quantization=quantization))``); `params_dtype` must
    be its dtype. `engine_tensor_parallel_size`: the engine's size where it is not the trainer's (a TP 1 trainer
    then computes a TP 2 engine's shards, :mod:`.engine_layout`; dense unquantized models only).
    ``quantization="fp8_per_channel"`` (the engine's argument) gives FP8 W8A8
    linears where the engine quantizes (see :mod:`.vllm_spec`); the master weights stay bf16. After each
    optimizer step call ``refresh_deployed_weights(model)`` (or ``register_deployed_refresh``).
    A spec is a ModuleSpec / TransformerBlockSubmodules or a function of the TransformerConfig
    returning one. Needs megatron's model parallel state: a one-process CPU run without it gets
    :func:`~.cpu_compat.init_single_process_cpu` here; anything else (torchrun, CUDA) sets it up first.
    The model takes that state's tensor parallel size T and each rank loads its shard (aligned: the
    engine's ``tensor_parallel_size = T`` layout, :mod:`.vllm_tensor_parallel`); with expert parallel size
    EP = T (MoE, aligned only) each rank loads its experts (the engine's ``enable_expert_parallel``, :mod:`.vllm_moe`).
    Raises HFCheckpointError for an unsupported architecture or a checkpoint that does not fit
    its config, ValueError naming the field the aligned forward cannot run with.
    """
    if quantization is not None and not align:
        raise ValueError(f"build_gpt_from_hf: quantization={quantization!r} needs align=True "
                         "(Megatron's local spec has no vLLM quantization)")
    if not parallel_state.model_parallel_is_initialized() or not dist.is_initialized():  # none, or destroyed under it
        one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1 and (not dist.is_initialized() or
                                                                       dist.get_world_size() == 1)
        if torch.cuda.is_available() or not one_process:
            raise RuntimeError(
                "build_gpt_from_hf: megatron's model parallel state is not initialised; set it up first "
                "(megatron.core.parallel_state.initialize_model_parallel)"
            )
        init_single_process_cpu()
    for field, size in (("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()),
                        ("expert_model_parallel_size", parallel_state.get_expert_model_parallel_world_size()),
                        ("expert_tensor_parallel_size", parallel_state.get_expert_tensor_parallel_world_size())):
        if config_overrides.setdefault(field, size) != size:
            raise ValueError(f"build_gpt_from_hf: {field}={config_overrides[field]} but megatron's parallel state "
                             f"has {size}")
    if config_overrides["expert_model_parallel_size"] > 1 and not align:
        raise ValueError("build_gpt_from_hf: expert_model_parallel_size > 1 needs align=True (the checkpoint loader "
                         "stacks the experts of the aligned MoE layer; Megatron's local experts are not sharded here)")
    hf_config = read_hf_config(checkpoint_dir)
    state = megatron_state_dict_from_hf(read_hf_tensors(checkpoint_dir), hf_config)
    if align:
        from megatron_vllm_align.megatron.engine_layout import engine_shards
        from megatron_vllm_align.megatron.vllm_spec import (
            VLLM_FORWARD_CONFIG_OVERRIDES,
            get_gpt_layer_vllm_spec,
        )

        if engine_context is None:
            engine_context = vllm_context(EngineSpec(str(checkpoint_dir), quantization=quantization,
                                                     tensor_parallel_size=engine_tensor_parallel_size))
        elif quantization != engine_context.spec.quantization:
            raise ValueError(f"build_gpt_from_hf: quantization={quantization!r} but engine_context serves "
                             f"quantization={engine_context.spec.quantization!r}")
        elif engine_tensor_parallel_size not in (None, engine_context.spec.tensor_parallel_size):
            raise ValueError(f"build_gpt_from_hf: engine_tensor_parallel_size={engine_tensor_parallel_size} but "
                             f"engine_context serves tensor_parallel_size={engine_context.spec.tensor_parallel_size}")
        trainer_tp = config_overrides["tensor_model_parallel_size"]
        if hf_config.moe is not None and engine_shards(engine_context, trainer_tp) > 1:
            raise ValueError("build_gpt_from_hf: an MoE model is not emulated in another tensor-parallel layout than "
                             "the engine's (its experts' all-reduce is not reproduced); run the trainer at the "
                             "engine's size")
        from megatron_vllm_align.megatron.vllm_moe import stack_expert_weights

        config_overrides = {**VLLM_FORWARD_CONFIG_OVERRIDES, **config_overrides}
        state = stack_expert_weights(state)
        if transformer_layer_spec is None:
            transformer_layer_spec = functools.partial(get_gpt_layer_vllm_spec, vllm_context=engine_context)
    config = transformer_config_from_hf(hf_config, params_dtype, **config_overrides)
    rope_kwargs = {} if align else native_rope_scaling(hf_config)
    if transformer_layer_spec is None and hf_config.moe is not None:  # native MoE layer: see cpu_compat
        enable_cpu_compat([patch.name for patch in MOE_PATCHES])
    spec_source = transformer_layer_spec if transformer_layer_spec is not None else local_layer_spec
    built_spec = isinstance(spec_source, (ModuleSpec, TransformerBlockSubmodules))
    layer_spec = spec_source if built_spec else spec_source(config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=hf_config.rope_theta,
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
        # at TP > 1 the local spec's logits gathered over the vocabulary shards; the aligned output layer
        # installed below gathers its own
        parallel_output=align or config.tensor_model_parallel_size == 1,
        **rope_kwargs,
    )
    mark_megatron_shards(model)
    if align:
        from megatron_vllm_align.megatron.vllm_output import install_vllm_output_layer

        install_vllm_output_layer(model, engine_context)
    # The local spec's torch RMSNorm creates fp32 weights whatever params_dtype says. Only
    # parameters are cast: buffers (e.g. an aligned spec's engine-side caches) keep their dtype.
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(params_dtype)
    load_megatron_params(model, state)
    refresh_deployed_weights(model)
    return model

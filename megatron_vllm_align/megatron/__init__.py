"""Megatron-Core on any machine: CPU compatibility, HF checkpoint loading, logprobs, and the
vLLM-forward spec (training forward = the engine's forward, bitwise)."""

from megatron_vllm_align.megatron.build import (
    build_gpt_from_hf,
    load_megatron_params,
    local_layer_spec,
    transformer_config_from_hf,
)
from megatron_vllm_align.megatron.cpu_compat import (
    PATCHES,
    CpuPatch,
    CpuRNGStatesTracker,
    UnsupportedMegatronVersion,
    active_patches,
    check_megatron_version,
    cpu_compat_required,
    cpu_patches,
    disable_cpu_compat,
    enable_cpu_compat,
    init_single_process_cpu,
    seed_cpu_rng,
)
from megatron_vllm_align.megatron.hf_checkpoint import (
    HFCheckpointError,
    HFDenseConfig,
    hf_config_from_dict,
    interleave_qkv,
    megatron_state_dict_from_hf,
    read_hf_config,
    read_hf_tensors,
)
from megatron_vllm_align.megatron.logprobs import (
    completion_logprobs,
    packed_step,
    packed_token_logprobs,
    token_logprobs,
    uses_vllm_forward,
)
from megatron_vllm_align.megatron.vllm_attention import (
    VllmSelfAttention,
    token_positions,
)
from megatron_vllm_align.megatron.vllm_layers import (
    VllmFinalRMSNorm,
    VllmTransformerLayer,
    join_residual_stream,
    split_residual_stream,
)
from megatron_vllm_align.megatron.vllm_linear import (
    VllmMegatronFP8Linear,
    VllmMegatronFP8QKVLinear,
    VllmMegatronLinear,
    VllmMegatronQKVLinear,
    megatron_to_vllm_qkv_rows,
)
from megatron_vllm_align.megatron.vllm_output import VllmOutputLayer, install_vllm_output_layer
from megatron_vllm_align.megatron.vllm_spec import (
    VLLM_FORWARD_CONFIG_OVERRIDES,
    get_gpt_layer_vllm_spec,
    vllm_layer_spec,
)
from megatron_vllm_align.utils.token_logprobs import (
    as_token_tensor,
    next_token_logprobs,
)

__all__ = [
    "PATCHES",
    "VLLM_FORWARD_CONFIG_OVERRIDES",
    "CpuPatch",
    "CpuRNGStatesTracker",
    "HFCheckpointError",
    "HFDenseConfig",
    "UnsupportedMegatronVersion",
    "VllmFinalRMSNorm",
    "VllmMegatronFP8Linear",
    "VllmMegatronFP8QKVLinear",
    "VllmMegatronLinear",
    "VllmMegatronQKVLinear",
    "VllmOutputLayer",
    "VllmSelfAttention",
    "VllmTransformerLayer",
    "active_patches",
    "as_token_tensor",
    "build_gpt_from_hf",
    "check_megatron_version",
    "cpu_compat_required",
    "cpu_patches",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "get_gpt_layer_vllm_spec",
    "hf_config_from_dict",
    "init_single_process_cpu",
    "install_vllm_output_layer",
    "interleave_qkv",
    "join_residual_stream",
    "load_megatron_params",
    "local_layer_spec",
    "megatron_state_dict_from_hf",
    "megatron_to_vllm_qkv_rows",
    "completion_logprobs",
    "next_token_logprobs",
    "packed_step",
    "packed_token_logprobs",
    "read_hf_config",
    "read_hf_tensors",
    "seed_cpu_rng",
    "split_residual_stream",
    "token_logprobs",
    "token_positions",
    "transformer_config_from_hf",
    "uses_vllm_forward",
    "vllm_layer_spec",
]

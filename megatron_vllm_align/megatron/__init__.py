"""The native Megatron-Core path on any machine: CPU compatibility, HF checkpoint loading, logprobs."""

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
    cpu_patches,
    cpu_compat_required,
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
from megatron_vllm_align.megatron.logprobs import as_token_tensor, next_token_logprobs, token_logprobs

__all__ = [
    "PATCHES",
    "CpuPatch",
    "CpuRNGStatesTracker",
    "HFCheckpointError",
    "HFDenseConfig",
    "UnsupportedMegatronVersion",
    "active_patches",
    "as_token_tensor",
    "build_gpt_from_hf",
    "check_megatron_version",
    "cpu_patches",
    "cpu_compat_required",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "hf_config_from_dict",
    "init_single_process_cpu",
    "interleave_qkv",
    "load_megatron_params",
    "local_layer_spec",
    "megatron_state_dict_from_hf",
    "next_token_logprobs",
    "read_hf_config",
    "read_hf_tensors",
    "seed_cpu_rng",
    "token_logprobs",
    "transformer_config_from_hf",
]

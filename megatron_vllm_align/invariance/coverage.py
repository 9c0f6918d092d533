"""What the invariance layer covers, checked when vLLM resolves an engine config.

The check runs inside vLLM's platform hook ``check_and_update_config``, which every
``EngineArgs.create_engine_config`` calls: in the engine's processes and in the trainer's
(:class:`~megatron_vllm_align.ops.vllm_context.VllmContext` resolves its config the same way),
so an engine or an aligned trainer that would be silently non-invariant is refused with an error
naming the model, quantization or feature instead.
"""
from __future__ import annotations

import functools
from typing import Any

from megatron_vllm_align.invariance import InvarianceUnsupported, requested
from megatron_vllm_align.utils.quantization_names import Quantization

# Decoder architectures whose every op on the path to a logprob is covered (attention, linear
# layers, RMSNorm, SiLU, RoPE, softmax top-k routing, vLLM's CPU fused experts).
COVERED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                         "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# Engine ``quantization`` values whose linear methods run under a probed row rule (see .row_tiles).
COVERED_QUANTIZATIONS = (None, Quantization.FP8_PER_CHANNEL.value, Quantization.COMPRESSED_TENSORS.value)
COVERED_ATTENTION_BACKENDS = (None, "CPU_ATTN")

_WRAPPED = "_mva_coverage"


def check_covered(vllm_config: Any) -> None:
    """Raise :class:`InvarianceUnsupported` naming the first thing ``vllm_config`` uses that the
    invariance layer does not cover."""
    model_config = vllm_config.model_config
    if model_config is None:
        return
    architectures = tuple(getattr(model_config.hf_config, "architectures", None) or ())
    uncovered = [name for name in architectures if name not in COVERED_ARCHITECTURES]
    if not architectures or uncovered:
        raise InvarianceUnsupported(f"MVA_INVARIANT=1 does not cover architecture {uncovered or architectures} "
                                    f"(covered: {', '.join(COVERED_ARCHITECTURES)})")
    if model_config.quantization not in COVERED_QUANTIZATIONS:
        raise InvarianceUnsupported(f"MVA_INVARIANT=1 does not cover quantization {model_config.quantization!r} "
                                    f"(covered: {COVERED_QUANTIZATIONS})")
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend_name = getattr(backend, "name", backend)
    if backend_name not in COVERED_ATTENTION_BACKENDS:
        raise InvarianceUnsupported(f"MVA_INVARIANT=1 does not cover attention backend {backend_name!r} "
                                    f"(covered on CPU: CPU_ATTN)")
    check_eager(vllm_config)
    if vllm_config.speculative_config is not None:
        raise InvarianceUnsupported("MVA_INVARIANT=1 does not cover speculative decoding")
    window = getattr(model_config.hf_text_config, "sliding_window", None)
    if window is not None and getattr(model_config.hf_text_config, "use_sliding_window", True):
        raise InvarianceUnsupported(f"MVA_INVARIANT=1 does not cover sliding-window attention (window {window})")


def check_eager(vllm_config: Any) -> None:
    """Raise :class:`InvarianceUnsupported` for a compiled engine: the trainer reproduces vLLM's eager
    graph, and the compiled graph (inductor on CPU, CUDA graphs on GPU) rounds differently
    (docs/invariance.md, "The compiled engine")."""
    from vllm.config import CompilationMode

    mode = vllm_config.compilation_config.mode
    if mode != CompilationMode.NONE:
        raise InvarianceUnsupported(f"MVA_INVARIANT=1 covers the eager engine only, and this engine is compiled "
                                    f"(compilation mode {CompilationMode(mode).name}): start it with "
                                    "enforce_eager=True (server: --enforce-eager). The compiled graph's logprobs "
                                    "differ from the eager graph the trainer reproduces (docs/invariance.md)")


def checked_config_hook(hook):
    """Wrap a platform's ``check_and_update_config(vllm_config)`` classmethod function: run vLLM's
    hook, then, with invariance requested, :func:`check_covered`."""
    if getattr(hook, _WRAPPED, False):
        return hook

    @functools.wraps(hook)
    def checked(cls, vllm_config):
        hook(cls, vllm_config)
        if requested():
            check_covered(vllm_config)

    setattr(checked, _WRAPPED, True)
    return checked


def install_coverage_check() -> None:
    """Wrap the CPU platform's config hook (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.check_and_update_config = classmethod(checked_config_hook(CpuPlatform.check_and_update_config.__func__))

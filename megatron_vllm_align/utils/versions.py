"""The vLLM versions this package's engine patches are written and measured against.

One tuple for every patch that wraps vLLM internals: the invariance plugin
(:mod:`megatron_vllm_align.invariance.plugin`, docs/invariance.md), the CPU MoE expert_map fix
(:mod:`megatron_vllm_align.ops.routed_experts.expert_map`) and the seeded chunked-prefill fix
(:mod:`megatron_vllm_align.engine.seeded_sampling`). Each refuses or skips its patch on any other
version.
"""
from __future__ import annotations

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)

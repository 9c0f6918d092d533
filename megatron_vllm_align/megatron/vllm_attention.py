"""Megatron self-attention running vLLM's Llama / Qwen attention forward.

:class:`VllmSelfAttention` is a ``SelfAttention`` (same constructor, submodules and parameter names)
whose forward is vLLM's ``LlamaAttention`` / ``Qwen2Attention`` / ``Qwen3Attention`` order: ``linear_qkv``
(vLLM's ``[q; k; v]`` output layout, :mod:`.vllm_linear`) -> split -> per-head q/k RMSNorm (Qwen3 only)
-> vLLM's rotary embedding -> vLLM's CPU attention over the packed sequences (``core_attention``) ->
``linear_proj``. Under tensor parallelism each rank runs its ``num_attention_heads / T`` query and
``num_query_groups / T`` KV heads, as vLLM's rank does. Positions are the engine's, every sequence from
0: from ``packed_seq_params.cu_seqlens_q`` in the packed ``thd`` layout, ``0..s-1`` per batch row in
``[s, b]``. Selective recompute of ``core_attn`` (training) goes through Megatron's
``_checkpointed_attention_forward``. Megatron's ``rotary_pos_emb`` is ignored: vLLM rotates with its
bf16 cos/sin cache.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_vllm_align.ops.attention.kernel import seq_lens_from_cu_seqlens
from megatron_vllm_align.ops.rotary_embedding.module import VllmRotaryEmbedding
from megatron_vllm_align.ops.vllm_context import VllmContext


def is_packed(packed_seq_params: PackedSeqParams | None) -> bool:
    """True for Megatron's packed ``thd`` layout (hidden states [t, 1, h], sequences by cu_seqlens)."""
    return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


def token_positions(seq_len: int, batch: int, packed_seq_params: PackedSeqParams | None) -> torch.Tensor:
    """int64 [seq_len * batch]: each token's position in its sequence, in the order of
    ``hidden_states [seq_len, batch, h].reshape(-1, h)``. Packed: batch must be 1 and the
    ``cu_seqlens_q`` lengths must sum to seq_len."""
    if not is_packed(packed_seq_params):
        return torch.arange(seq_len).repeat_interleave(batch)
    if batch != 1:
        raise ValueError(f"packed (thd) hidden states must be [t, 1, h], got batch {batch}")
    lens = seq_lens_from_cu_seqlens(packed_seq_params.cu_seqlens_q)
    if sum(lens) != seq_len:
        raise ValueError(f"packed_seq_params.cu_seqlens_q covers {sum(lens)} tokens, hidden states hold {seq_len}")
    return torch.cat([torch.arange(n) for n in lens])


def check_head_dim_served(head_dim: int) -> None:
    """ValueError naming ``kv_channels`` unless vLLM's attention backend of this platform serves head_dim."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(f"config.kv_channels (head_dim) = {head_dim} is not served by vLLM's CPU_ATTN "
                         f"backend (supported: {supported})")


class VllmSelfAttention(SelfAttention):
    """``SelfAttention`` with vLLM's forward (module docstring). Extra keyword: ``vllm_context``,
    whose model config gives the rotary parameters (``rope_parameters``,
    ``max_position_embeddings``) exactly as vLLM's model reads them.

    ``forward(hidden_states [s, b, h], attention_mask, packed_seq_params=None, ...) ->
    (out [s, b, h], None)``. Refuses cross attention (``key_value_states``) and inference caches.
    """

    def __init__(self, config: Any, submodules: Any, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_comm_type: str | None = None,
                 pg_collection: Any = None, *, vllm_context: VllmContext, **kwargs: Any) -> None:
        check_head_dim_served(config.kv_channels)
        if config.attention_output_gate:
            raise ValueError("config.attention_output_gate=True is not supported by the vLLM Llama/Qwen forward")
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        hf_config = vllm_context.vllm_config.model_config.hf_config
        self.rotary = VllmRotaryEmbedding(
            config.kv_channels, hf_config.max_position_embeddings,
            getattr(hf_config, "rope_parameters", None), vllm_context=vllm_context)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                key_value_states: torch.Tensor | None = None, inference_context: Any = None,
                rotary_pos_emb: Any = None, rotary_pos_cos: Any = None, rotary_pos_sin: Any = None,
                rotary_pos_cos_sin: Any = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, sequence_len_offset: Any = None,
                *, inference_params: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if key_value_states is not None:
            raise ValueError("VllmSelfAttention: key_value_states (cross attention) is not supported")
        if inference_context is not None or inference_params is not None:
            raise ValueError("VllmSelfAttention: inference KV caches are not supported (the engine serves)")
        seq_len, batch = hidden_states.shape[:2]
        heads, groups, head_dim = (self.num_attention_heads_per_partition, self.num_query_groups_per_partition,
                                   self.hidden_size_per_attention_head)
        qkv, _ = self.linear_qkv(hidden_states)
        q, k, v = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q.reshape(seq_len, batch, heads, head_dim)).reshape(seq_len, batch, -1)
        if self.k_layernorm is not None:
            k = self.k_layernorm(k.reshape(seq_len, batch, groups, head_dim)).reshape(seq_len, batch, -1)
        positions = token_positions(seq_len, batch, packed_seq_params).to(hidden_states.device)
        q, k = self.rotary(positions, q.reshape(seq_len * batch, -1), k.reshape(seq_len * batch, -1))
        query = q.reshape(seq_len, batch, heads, head_dim)
        key = k.reshape(seq_len, batch, groups, head_dim)
        value = v.reshape(seq_len, batch, groups, head_dim)
        mask = None if is_packed(packed_seq_params) else attention_mask
        if self.checkpoint_core_attention and self.training:
            core = self._checkpointed_attention_forward(query, key, value, mask, attention_bias=attention_bias,
                                                        packed_seq_params=packed_seq_params)
        else:
            core = self.core_attention(query, key, value, mask, attn_mask_type=self.attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        return self.linear_proj(core.reshape(seq_len, batch, -1))

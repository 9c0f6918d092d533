"""Causal GQA attention whose forward is vLLM's CPU prefill kernel and whose backward is the
training library's: PyTorch's scaled_dot_product_attention, recomputed in fp32 and differentiated by its
own backward kernel.

Gradient contract (case A, docs/method.md#backward-reuse: only rounding differs from the math):
- visible forward: ``vllm_prefill_attention`` (bf16 in, bf16 out, byte-equal to the engine);
- trainable variables: q, k, v (no parameters; no discrete state; no surrogate);
- save/recompute: saves q, k, v. vLLM's kernel returns no log-sum-exp, so (docs/method.md#saved-state-and-recompute) the
  backward rebuilds the softmax with the training kernel from the saved q, k in fp32 with the
  same scale, causal mask and GQA mapping, and never reads the visible output;
- backward: the values of ``torch.autograd.grad`` through fp32 SDPA per sequence (``enable_gqa``, which
  sums each KV head's gradient over its query heads), cast to the input dtype: the CPU flash kernels that
  autograd runs, called directly on runs of equal-length sequences (:func:`~.vjp.training_attention_vjp`).
  Chosen over a hand-written closed form because in case A the training library's backward is reused,
  and SDPA needs nothing from the forward but q, k, v;
- reference: ``attention_native`` under autograd (plain ops); see
  tests/ops/attention/test_attention_module.py.

Transformer Engine's DotProductAttention is the GPU training backward, but it needs its own
forward's softmax statistics; no TE path is wired here (TE is not installable on these machines).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_vllm_align.ops.attention.kernel import (
    seq_lens_from_cu_seqlens,
    validate_attention_inputs,
    vllm_prefill_attention,
)
from megatron_vllm_align.ops.attention.vjp import training_attention_vjp


class VllmCausalAttentionFunction(torch.autograd.Function):
    """Packed causal GQA attention: vLLM CPU kernel forward, fp32 SDPA backward (module docstring).

    ``apply(q, k, v, seq_lens, scale)`` with q [T, Hq, D], k/v [T, Hkv, D], seq_lens positive
    ints summing to T (list, tuple or tensor); returns [T, Hq, D] in q's dtype.
    """

    contract_name = "attention"

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seq_lens: Sequence[int] | torch.Tensor, scale: float) -> torch.Tensor:
        lens = validate_attention_inputs(q, k, v, seq_lens, scale)
        out = vllm_prefill_attention(q, k, v, lens, scale)
        ctx.save_for_backward(q, k, v)
        ctx.seq_lens = lens
        ctx.scale = float(scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        dq, dk, dv = training_attention_vjp(q, k, v, grad_output, ctx.seq_lens, ctx.scale)
        return dq, dk, dv, None, None


_CAUSAL_MASK_TYPES = ("causal", "padding_causal")


class VllmDotProductAttention(torch.nn.Module):
    """Megatron-Core core attention (``DotProductAttention`` signature) running
    ``VllmCausalAttentionFunction``: causal self-attention, no dropout, no parameters.

    Constructor: Megatron's keywords (``layer_number`` and unknown keywords are accepted and
    unused); reads ``config.kv_channels`` (head dim, for the default
    scale), ``config.attention_dropout``, ``config.window_size``, ``config.softmax_type`` and
    ``config.context_parallel_size`` and refuses what the vLLM forward does not compute. ``head_shards``:
    the query / KV heads run as that many consecutive groups, one kernel call each (a TP 1 trainer
    computing a tensor-parallel engine's ranks, ``megatron.engine_layout``).
    ``apply_query_key_layer_scaling`` changes nothing: Megatron divides the scale by the layer
    number and multiplies the scores back before the softmax.

    Forward: query [sq, b, np, hn], key/value [sk, b, ng, hn] (sq == sk; each batch row is one
    sequence) -> [sq, b, np*hn]. Packed THD (``packed_seq_params.qkv_format == "thd"``): query
    [t, np, hn] (or [t, 1, np, hn]) with sequences given by ``cu_seqlens_q`` -> [t, np*hn]
    (or [t, 1, np*hn]). ``attention_mask`` must be None or the causal mask (True = masked).
    """

    def __init__(self, config: Any, layer_number: int = 1, attn_mask_type: Any = None,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, head_shards: int = 1, **kwargs: Any) -> None:
        super().__init__()
        self.head_shards = head_shards
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention dropout must be 0 (the vLLM forward has none), "
                             f"got {dropout}")
        if attention_type != "self":
            raise ValueError(f"attention_type must be 'self', got {attention_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"config.window_size must be None (no sliding window), "
                             f"got {config.window_size}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"config.softmax_type must be 'vanilla', got {config.softmax_type!r}")
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("context parallelism is not supported by VllmDotProductAttention")
        self._check_mask_type(attn_mask_type)
        self.softmax_scale = (config.kv_channels ** -0.5 if softmax_scale is None
                              else float(softmax_scale))

    @staticmethod
    def _check_mask_type(attn_mask_type: Any) -> None:
        name = getattr(attn_mask_type, "name", attn_mask_type)
        if name is not None and name not in _CAUSAL_MASK_TYPES:
            raise ValueError(f"attn_mask_type must be causal, got {attn_mask_type!r}")

    @staticmethod
    def _check_attention_mask(attention_mask: torch.Tensor | None, seq_len: int) -> None:
        if attention_mask is None:
            return
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool,
                            device=attention_mask.device).triu(1)
        if attention_mask.shape[-2:] != (seq_len, seq_len) or not torch.equal(
                attention_mask.bool(), causal.expand_as(attention_mask)):
            raise ValueError("attention_mask must be None or the causal mask (True above the "
                             "diagonal); padding or arbitrary masks are not supported")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None,
                **kwargs: Any) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        self._check_mask_type(attn_mask_type)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_packed(query, key, value, attention_mask, packed_seq_params)
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"query/key/value must be [s, b, heads, head_dim], got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        seq_len, batch = query.shape[0], query.shape[1]
        if key.shape[:2] != (seq_len, batch) or value.shape[:2] != (seq_len, batch):
            raise ValueError(f"self-attention needs key/value [sq, b, ...] like query "
                             f"{tuple(query.shape[:2])}, got {tuple(key.shape[:2])}, "
                             f"{tuple(value.shape[:2])}")
        self._check_attention_mask(attention_mask, seq_len)
        q, k, v = (t.transpose(0, 1).reshape(batch * seq_len, t.shape[2], t.shape[3])
                   for t in (query, key, value))
        out = self._attend(q, k, v, (seq_len,) * batch)
        return out.view(batch, seq_len, -1).transpose(0, 1).contiguous()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Any) -> torch.Tensor:
        """All heads in one kernel call, or (``head_shards`` T > 1) one call per group of Hq / T query and
        Hkv / T KV heads, as each rank of a TP = T engine runs its own heads."""
        if self.head_shards == 1:
            return VllmCausalAttentionFunction.apply(q, k, v, seq_lens, self.softmax_scale)
        if q.shape[1] % self.head_shards or k.shape[1] % self.head_shards:
            raise ValueError(f"{q.shape[1]} query / {k.shape[1]} KV heads do not split into {self.head_shards} "
                             "engine ranks")
        groups = zip(*(t.chunk(self.head_shards, dim=1) for t in (q, k, v)))
        return torch.cat([VllmCausalAttentionFunction.apply(qs.contiguous(), ks.contiguous(), vs.contiguous(),
                                                            seq_lens, self.softmax_scale)
                          for qs, ks, vs in groups], dim=1)

    def _forward_packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, packed_seq_params: Any
                        ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("attention_mask must be None with packed (thd) sequences")
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
            raise ValueError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            padded = getattr(packed_seq_params, name, None)
            if padded is not None and not torch.equal(padded.cpu(), cu_q.cpu()):
                raise ValueError(f"packed_seq_params.{name} differs from cu_seqlens_q: padded "
                                 "packed sequences are not supported")
        squeeze = query.dim() == 4
        if squeeze and query.shape[1] != 1:
            raise ValueError(f"packed query must be [t, heads, head_dim] or [t, 1, heads, "
                             f"head_dim], got {tuple(query.shape)}")
        q, k, v = (t.squeeze(1) if squeeze else t for t in (query, key, value))
        out = self._attend(q, k, v, seq_lens_from_cu_seqlens(cu_q))
        out = out.reshape(out.shape[0], -1)
        return out.unsqueeze(1) if squeeze else out

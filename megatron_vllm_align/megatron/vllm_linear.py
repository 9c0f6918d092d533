"""Megatron linear builders whose forward is vLLM's linear: unquantized (contract ``dense_linear``)
or W8A8 FP8 per channel (``fp8_linear_per_channel``, engine quantization ``"fp8_per_channel"``).

:class:`VllmMegatronLinear` takes Megatron's linear constructor call, keeps the master weight as the
only parameter (``weight`` [out, in], ``bias`` [out]: the local spec's names and layout) and runs
``VllmDenseLinear``'s vLLM shadow; :class:`VllmMegatronFP8Linear` does the same with ``VllmFP8Linear``'s
(vLLM quantizes the master per output channel at every refresh). A bias is added inside the GEMM and
``forward`` returns ``(out, None)`` whatever ``skip_bias_add`` says. Under tensor parallelism the
parameters are the rank's shard (:mod:`.vllm_tensor_parallel`). :class:`VllmMegatronQKVLinear` /
:class:`VllmMegatronFP8QKVLinear` are ``linear_qkv``: master rows in Megatron's per-query-group layout,
shadow and output in vLLM's ``[all q; all k; all v]`` layout, dW gathered back by the inverse
permutation. Why and how: docs/megatron_facts.md#megatron-linears-on-vllms-gemm-megatronvllm_linearpy.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.megatron.engine_layout import EngineShardedLinearKernel, engine_shards
from megatron_vllm_align.megatron.vllm_tensor_parallel import TensorParallelShard
from megatron_vllm_align.ops.dense_linear.module import (
    DenseLinearFunction,
    VllmDenseLinear,
)
from megatron_vllm_align.ops.fp8_linear.module import (
    VllmFP8Linear,
    VllmFP8LinearFunction,
)
from megatron_vllm_align.ops.vllm_context import VllmContext


def megatron_to_vllm_qkv_rows(num_heads: int, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """int64 [(num_heads + 2 num_query_groups) head_dim]: entry r is the row of Megatron's
    interleaved ``linear_qkv`` that holds row r of vLLM's ``[q; k; v]`` ``qkv_proj`` (one tensor-parallel
    rank: its heads and query groups)."""
    if num_heads % num_query_groups:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_query_groups={num_query_groups}")
    per_group = num_heads // num_query_groups
    rows = torch.arange((num_heads + 2 * num_query_groups) * head_dim).view(num_query_groups, per_group + 2, head_dim)
    q_rows = rows[:, :per_group].reshape(-1)
    k_rows = rows[:, per_group].reshape(-1)
    v_rows = rows[:, per_group + 1].reshape(-1)
    return torch.cat([q_rows, k_rows, v_rows])


class MegatronLinearExtraState:
    """The empty ``_extra_state`` entry Megatron's linears put in their state dict (for TE
    compatibility), so that local-spec and vLLM-forward state dicts have the same keys."""

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        """Ignored, as in Megatron's linears."""


class _MegatronBuilderLinear(MegatronLinearExtraState):
    """Megatron's linear builder signature on a vLLM-forward linear (a ``_DeployedLinear`` subclass
    later in the MRO); ``forward -> (out, None)``.

    ``config.params_dtype`` is the master dtype; with ``config.perform_initialization`` the
    weight is initialised by Megatron's ``init_method`` (bias zero) and the shadow refreshed.
    Subclasses give :meth:`_linear_apply` (the autograd Function of their contract).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, vllm_context: VllmContext,
                 init_method: Any = None, bias: bool = False, prefix: str = "", tp_group: Any = None,
                 **kwargs: Any) -> None:
        shard = TensorParallelShard.of_megatron_linear(kwargs, tp_group)
        shard.check_bias(bias)
        local_input, local_output = shard.local_sizes(input_size, output_size)
        # Set before nn.Module.__init__ runs: the parent's constructor already builds and refreshes the shadow.
        object.__setattr__(self, "tp_shard", shard)
        object.__setattr__(self, "output_segments", self._output_segments(local_output, config, kwargs))
        super().__init__(local_input, local_output, bias=bias, vllm_context=vllm_context, prefix=prefix,
                         params_dtype=config.params_dtype)
        shard.mark(self.weight, self.bias)
        if config.perform_initialization and init_method is not None:
            with torch.no_grad():
                init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()
            self.refresh_deployed()

    def _output_segments(self, output_size: int, config: Any, kwargs: dict[str, Any]) -> tuple[int, ...]:
        """The output's stacked blocks as vLLM's merged column-parallel layer shards them: ``[gate | up]``
        for a gated ``linear_fc1``, else the whole output."""
        if kwargs.get("tp_comm_buffer_name") == "fc1" and config.gated_linear_unit:
            return (output_size // 2, output_size // 2)
        return (output_size,)

    def _build_kernel(self, context: VllmContext, in_features: int, out_features: int, bias: bool,
                      quantized: bool, prefix: str) -> Any:
        """This trainer's shadow kernel, or the engine's shard kernels where the engine's tensor-parallel
        layout is not the trainer's (:mod:`.engine_layout`)."""
        shards = engine_shards(context, self.tp_shard.world_size)
        if shards == 1:
            return super()._build_kernel(context, in_features, out_features, bias, quantized, prefix)
        return EngineShardedLinearKernel(context, in_features, out_features, bias, quantized, prefix,
                                         mode=self.tp_shard.mode, shards=shards, segments=self.output_segments)

    def _load_deployed(self, kernel: Any) -> None:
        """Load ``kernel`` from the current master (collective for a quantized row-parallel shard:
        :meth:`TensorParallelShard.weight_amax_over_shards`)."""
        with self.tp_shard.weight_amax_over_shards(kernel.quantized):
            super()._load_deployed(kernel)

    def _linear_apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        flat = self._flat_input(self.tp_shard.enter(x))
        out = self._linear_apply(flat, *self._deployed_operands())
        return self.tp_shard.leave(out.reshape(*x.shape[:-1], out.shape[-1])), None


class VllmMegatronLinear(_MegatronBuilderLinear, VllmDenseLinear):
    """Megatron's linear on vLLM's unquantized linear (contract ``dense_linear``)."""

    def _linear_apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return DenseLinearFunction.apply(x, weight, bias, self.kernel)


class VllmMegatronFP8Linear(_MegatronBuilderLinear, VllmFP8Linear):
    """Megatron's linear on vLLM's W8A8 FP8 per-channel linear (contract ``fp8_linear_per_channel``;
    the engine context must have ``quantization="fp8_per_channel"``). Backward reference choices
    are VllmFP8Linear's defaults."""

    def _linear_apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return VllmFP8LinearFunction.apply(x, weight, bias, self.kernel, self.dx_weight, self.dw_activation)


class _PermuteRows(torch.autograd.Function):
    """``apply(tensor [R, ...], rows [R], inverse [R]) -> tensor[rows]`` for a permutation ``rows``
    with ``inverse = argsort(rows)``; backward ``grad[inverse]``: each master row receives its one
    gradient row by a gather (autograd's index backward would zero-fill and scatter-add)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return tensor[rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class _QKVRows:
    """Megatron's ``linear_qkv`` (master rows per query group) running vLLM's ``qkv_proj`` GEMM.

    Reads ``num_attention_heads``, ``num_query_groups`` and ``kv_channels`` from ``config``.
    ``forward(x [..., hidden]) -> ([..., q | k | v] in vLLM's layout, None)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, vllm_context: VllmContext,
                 **kwargs: Any) -> None:
        world = TensorParallelShard.of_megatron_linear(kwargs, kwargs.get("tp_group")).world_size
        if config.num_query_groups % world:
            raise ValueError(f"num_query_groups={config.num_query_groups} is not divisible by tensor parallel size "
                             f"{world} (vLLM would replicate KV heads; Megatron splits query groups)")
        rows = megatron_to_vllm_qkv_rows(config.num_attention_heads // world, config.num_query_groups // world,
                                         config.kv_channels)
        if rows.numel() * world != output_size:
            raise ValueError(f"linear_qkv output_size {output_size} != (num_attention_heads + 2 num_query_groups) "
                             f"* kv_channels = {rows.numel() * world} (attention_output_gate is not supported)")
        # Set before nn.Module.__init__ runs: the parent's constructor already refreshes the shadow.
        object.__setattr__(self, "vllm_rows", rows)
        object.__setattr__(self, "vllm_rows_inverse", torch.argsort(rows))
        kv_width = config.num_query_groups // world * config.kv_channels
        object.__setattr__(self, "qkv_widths", (rows.numel() - 2 * kv_width, kv_width, kv_width))
        super().__init__(input_size, output_size, config=config, vllm_context=vllm_context, **kwargs)

    def _output_segments(self, output_size: int, config: Any, kwargs: dict[str, Any]) -> tuple[int, ...]:
        """``[q | k | v]`` in vLLM's layout."""
        return self.qkv_widths

    def _deployed_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The master rows permuted to vLLM's ``[q; k; v]`` (a differentiable gather)."""
        rows, inverse = self.vllm_rows, self.vllm_rows_inverse
        bias = None if self.bias is None else _PermuteRows.apply(self.bias, rows, inverse)
        return _PermuteRows.apply(self.weight, rows, inverse), bias


class VllmMegatronQKVLinear(_QKVRows, VllmMegatronLinear):
    """``linear_qkv`` on vLLM's unquantized ``qkv_proj`` (see :class:`_QKVRows`). Its backward runs
    in Megatron's layout: dY's columns gathered back to the master's row order, then Megatron's
    local linear backward on the master weight (``DenseLinearFunction``'s ``output_order``), so dX,
    dW and db are those of Megatron's own ``linear_qkv`` for the same dY."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        flat = self._flat_input(self.tp_shard.enter(x))
        out = DenseLinearFunction.apply(flat, self.weight, self.bias, self.kernel, self.vllm_rows_inverse)
        return self.tp_shard.leave(out.reshape(*x.shape[:-1], out.shape[-1])), None


class VllmMegatronFP8QKVLinear(_QKVRows, VllmMegatronFP8Linear):
    """``linear_qkv`` on vLLM's W8A8 FP8 ``qkv_proj``: per-channel weight scales are per row, so
    quantizing the permuted rows gives exactly the engine's merged layer (see :class:`_QKVRows`)."""

"""Megatron linear builders whose forward is vLLM's unquantized linear (contract ``dense_linear``).

Megatron builds a linear as ``cls(input_size, output_size, *, config, init_method, bias,
skip_bias_add, gather_output / input_is_parallel, is_expert, tp_comm_buffer_name, tp_group,
...)`` and expects ``forward(x) -> (out, bias)``. :class:`VllmMegatronLinear` takes that call,
keeps the master weight as the only parameter (``weight`` [out, in], ``bias`` [out]: the local
spec's names and layout) and runs :class:`~megatron_vllm_align.modules.linear.VllmDenseLinear`'s
vLLM shadow. Like vLLM, a bias is always added inside the GEMM; ``forward`` returns
``(out, None)`` whatever ``skip_bias_add`` says (the vLLM-forward attention and MLP consume it).

:class:`VllmMegatronQKVLinear` is Megatron's ``linear_qkv``: the master weight stays in
Megatron's per-query-group layout ``[q heads of group g; k_g; v_g]`` (so checkpoints, the HF
loader and the optimizer are unchanged), while the shadow gets the rows permuted to vLLM's
``qkv_proj`` layout ``[all q; all k; all v]``: the engine's GEMM shape, hence the kernel vLLM
dispatches for it (sgl ``weight_packed_linear`` or oneDNN, chosen from the weight's size).
The output is in vLLM's layout. The permutation is a differentiable row gather of the master
``weight[vllm_rows]`` (and bias) inside the forward, so autograd scatters dW back to the master
layout exactly (no arithmetic: each row receives one gradient row).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.kernels.vllm_context import VllmContext
from megatron_vllm_align.modules.linear import DenseLinearFunction, VllmDenseLinear


def megatron_to_vllm_qkv_rows(num_heads: int, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """int64 [(num_heads + 2 num_query_groups) head_dim]: entry r is the row of Megatron's
    interleaved ``linear_qkv`` that holds row r of vLLM's ``[q; k; v]`` ``qkv_proj``."""
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


class VllmMegatronLinear(MegatronLinearExtraState, VllmDenseLinear):
    """Megatron's linear builder signature on vLLM's unquantized linear; ``forward -> (out, None)``.

    ``config.params_dtype`` is the master dtype; with ``config.perform_initialization`` the
    weight is initialised by Megatron's ``init_method`` (bias zero) and the shadow refreshed.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, vllm_context: VllmContext,
                 init_method: Any = None, bias: bool = False, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(input_size, output_size, bias=bias, vllm_context=vllm_context, prefix=prefix,
                         params_dtype=config.params_dtype)
        if config.perform_initialization and init_method is not None:
            with torch.no_grad():
                init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()
            self.refresh_deployed()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


class VllmMegatronQKVLinear(VllmMegatronLinear):
    """Megatron's ``linear_qkv`` (master rows per query group) running vLLM's ``qkv_proj`` GEMM.

    Reads ``num_attention_heads``, ``num_query_groups`` and ``kv_channels`` from ``config``.
    ``forward(x [..., hidden]) -> ([..., q | k | v] in vLLM's layout, None)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, vllm_context: VllmContext,
                 **kwargs: Any) -> None:
        rows = megatron_to_vllm_qkv_rows(config.num_attention_heads, config.num_query_groups, config.kv_channels)
        if rows.numel() != output_size:
            raise ValueError(f"linear_qkv output_size {output_size} != (num_attention_heads + 2 num_query_groups) "
                             f"* kv_channels = {rows.numel()} (attention_output_gate is not supported)")
        # Set before nn.Module.__init__ runs: the parent's constructor already refreshes the shadow.
        object.__setattr__(self, "vllm_rows", rows)
        super().__init__(input_size, output_size, config=config, vllm_context=vllm_context, **kwargs)

    def _deployed_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.bias is None else self.bias[self.vllm_rows]
        return self.weight[self.vllm_rows], bias

    def refresh_deployed(self) -> None:
        """Rebuild the shadow from the master rows permuted to vLLM's ``[q; k; v]``."""
        with torch.no_grad():
            self.kernel.load(*self._deployed_operands())
        self._deployed_stamp = self._master_stamp()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        flat = self._flat_input(x)
        weight, bias = self._deployed_operands()
        out = DenseLinearFunction.apply(flat, weight, bias, self.kernel)
        return out.reshape(*x.shape[:-1], out.shape[-1]), None

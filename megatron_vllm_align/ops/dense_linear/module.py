"""Linear layers whose forward is vLLM's (a shadow layer holding the deployed value) and whose
backward is the ordinary linear VJP, reused.

Weights have three values (docs/method.md#weight-values): the optimizer's main copy, the module's master parameters
(``weight`` [N, K], ``bias`` [N]) and the deployed value, which vLLM builds from the master in a
shadow ``ReplicatedLinear`` (:class:`~megatron_vllm_align.ops.dense_linear.kernel.VllmLinearKernel`). The
shadow is a plain attribute, never a submodule, and holds no tensor that requires grad:
``parameters()`` is exactly the master parameters and the optimizer sees nothing else.
``refresh_deployed()`` rebuilds the shadow from the current master; the forward refuses a
master that changed since (detected through the parameters' autograd version counters and
storage, which catch ``torch.optim`` steps and in-place copies; writes through ``.data`` are
invisible to it, so refresh explicitly after those, e.g. with
:func:`~megatron_vllm_align.ops.refresh.register_deployed_refresh`).

Backward: the project's one linear VJP, :func:`~megatron_vllm_align.ops.dense_linear.vjp.linear_vjp`
(shared with the FP8 linears of ``ops.fp8_linear``): ``dX = dY W_ref``, ``dW = dY^T X_ref``, ``db = sum_tokens dY``,
computed from the saved values by the calls of Megatron's local linear backward (GEMMs in the model
dtype, fp32 accumulation inside them), so its bits are Megatron's for the same operands. On CUDA with Transformer
Engine importable, dX and dW come from TE's GEMMs instead (:mod:`megatron_vllm_align.ops.dense_linear.te_gemm`, not
exercised here).

Contract ``dense_linear`` (case A), :class:`VllmDenseLinear`: ``W_ref`` = the master weight cast to
the model dtype (exactly the values vLLM packed), ``X_ref`` = the input. Saves x and the weight
parameter (by reference). The FP8 linear (``ops.fp8_linear.module``) shares :class:`DeployedLinear`.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel
from megatron_vllm_align.ops.dense_linear.vjp import linear_vjp
from megatron_vllm_align.ops.refresh import ProbedDeployedValue, master_stamp, probe_input
from megatron_vllm_align.ops.vllm_context import VllmContext


def gather_columns(matrix: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``matrix[:, order]`` (contiguous) for a 2-D ``matrix`` and an int64 permutation ``order``, moved
    in blocks: the largest width B that splits ``order`` into runs ``b, b + 1, ..., b + B - 1`` with
    ``b`` a multiple of B (a linear_qkv permutation: B = head_dim) is gathered as whole blocks of B
    columns, which is far faster on CPU than a gather of single columns. Values are only moved."""
    width = order.numel()
    starts = torch.nonzero(order[1:] != order[:-1] + 1).flatten().add_(1).tolist()
    block = math.gcd(width, *starts, *order[[0, *starts]].tolist())
    blocks = order[::block].div(block, rounding_mode="floor")
    return matrix.reshape(matrix.shape[0], width // block, block).index_select(1, blocks).view(matrix.shape[0], width)


class DenseLinearFunction(torch.autograd.Function):
    """``apply(x [M, K], weight, bias, kernel, output_order=None) -> Y [M, N]`` (contract ``dense_linear``).

    ``output_order``: None when the kernel's output columns are the master's rows as they are;
    else int64 [N] with entry ``r`` = the kernel output column holding master row ``r`` (the
    kernel was loaded from ``weight[rows]`` and ``output_order = argsort(rows)``). The backward then
    gathers dY's columns back to the master's order and runs the linear VJP on the master weight,
    so dX, dW and db are those of the un-permuted linear (:func:`gather_columns` moves values, no
    arithmetic).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                kernel: VllmLinearKernel, output_order: torch.Tensor | None = None) -> torch.Tensor:
        out = kernel(x)
        ctx.save_for_backward(x, weight, output_order)
        ctx.model_dtype = kernel.context.model_dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, output_order = ctx.saved_tensors
        if output_order is not None:
            grad_out = gather_columns(grad_out, output_order)
        w_ref = weight.detach().to(ctx.model_dtype)
        needs = tuple(ctx.needs_input_grad[:3])
        return (*linear_vjp(grad_out, x, w_ref, ctx.bias_dtype, x.dtype, weight.dtype, needs), None, None)


class DeployedLinear(ProbedDeployedValue, nn.Module):
    """Master ``weight`` [out, in] (+ ``bias`` [out]) and the vLLM shadow built from them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, vllm_context: VllmContext,
                 quantized: bool, prefix: str, params_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.kernel = self._build_kernel(vllm_context, in_features, out_features, bias, quantized, prefix)
        dtype = params_dtype or vllm_context.model_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._deployed_stamp: tuple[tuple[int, int], ...] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (its own ``reset_parameters``, which reads only weight and
        bias), then a refresh of the deployed value."""
        nn.Linear.reset_parameters(self)
        self.refresh_deployed()

    def _master_stamp(self) -> tuple[tuple[int, int], ...]:
        return master_stamp(self.weight, self.bias)

    def _deployed_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The master operands in the shadow's row order (here: as they are)."""
        return self.weight, self.bias

    def _build_kernel(self, context: VllmContext, in_features: int, out_features: int, bias: bool,
                      quantized: bool, prefix: str) -> VllmLinearKernel:
        """The shadow kernel (unloaded); subclasses may return another with the same interface."""
        return VllmLinearKernel(context, in_features, out_features, bias, quantized, prefix)

    def _new_kernel(self) -> VllmLinearKernel:
        return self.kernel.fresh()

    def _load_deployed(self, kernel: VllmLinearKernel) -> None:
        kernel.load(*self._deployed_operands())

    def _probe(self, kernel: VllmLinearKernel) -> torch.Tensor:
        return kernel(probe_input(kernel.in_features, kernel.context.model_dtype))

    def refresh_deployed(self) -> None:
        """Rebuild the deployed value (vLLM's processing of the current master) in the shadow."""
        with torch.no_grad():
            self._load_deployed(self.kernel)
        self._deployed_stamp = self._master_stamp()

    def _flat_input(self, x: torch.Tensor) -> torch.Tensor:
        if self._deployed_stamp != self._master_stamp():
            raise RuntimeError(f"{type(self).__name__}: the master weight changed since the deployed value was "
                               "built; call refresh_deployed() (or register_deployed_refresh(optimizer, model))")
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x must be [..., in_features={self.weight.shape[1]}], got "
                             f"{tuple(getattr(x, 'shape', ()))}")
        return x.reshape(-1, x.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, prefix={self.kernel.prefix!r}")


class VllmDenseLinear(DeployedLinear):
    """``forward(x [..., in]) -> y [..., out]`` through vLLM's unquantized linear (``dense_linear``)."""

    contract_name = "dense_linear"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, vllm_context: VllmContext,
                 prefix: str = "", params_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias, vllm_context=vllm_context, quantized=False,
                         prefix=prefix, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = DenseLinearFunction.apply(self._flat_input(x), self.weight, self.bias, self.kernel)
        return out.reshape(*x.shape[:-1], out.shape[-1])



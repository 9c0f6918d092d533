"""Linear layers whose forward is vLLM's (a shadow layer holding the deployed value) and whose
backward is the ordinary linear VJP, reused.

Weights have three tiers (seed 000): the optimizer's main copy, the module's master parameters
(``weight`` [N, K], ``bias`` [N]) and the deployed value, which vLLM builds from the master in a
shadow ``ReplicatedLinear`` (:class:`~megatron_vllm_align.kernels.linear.VllmLinearKernel`). The
shadow is a plain attribute, never a submodule, and holds no tensor that requires grad:
``parameters()`` is exactly the master parameters and the optimizer sees nothing else.
``refresh_deployed()`` rebuilds the shadow from the current master; the forward refuses a
master that changed since (detected through the parameters' autograd version counters and
storage, which catch ``torch.optim`` steps and in-place copies; writes through ``.data`` are
invisible to it, so refresh explicitly after those, e.g. with
:func:`~megatron_vllm_align.modules.refresh.register_deployed_refresh`).

Backward: the project's one linear VJP, :func:`~megatron_vllm_align.quant.linear_vjp.linear_vjp`
(shared with ``quant.FP8Linear``): ``dX = dY W_ref``, ``dW = dY^T X_ref``, ``db = sum_tokens dY``,
in fp32 from the saved values, each cast once to its tensor's dtype. On CUDA with Transformer
Engine importable, dX and dW come from TE's GEMMs instead (:mod:`megatron_vllm_align.quant.te_gemm`, not exercised here).

Contracts:
- ``dense_linear`` (case A), :class:`VllmDenseLinear`: ``W_ref`` = the master weight cast to the
  model dtype (exactly the values vLLM packed), ``X_ref`` = the input. Saves x and the weight
  parameter (by reference).
- ``fp8_linear_per_channel`` (case B), :class:`VllmFP8Linear` (:class:`VllmFP8LinearFunction`): vLLM's
  ``Fp8PtpcOnlineLinearMethod`` (engine quantization ``"fp8_per_channel"``) quantizes the master
  per output channel at refresh and the input per token in every call (W8A8). Identity STEs for
  both quantizers; scales are stop-gradient. ``dx_weight="dequantized"`` (default):
  ``W_ref = dequant(deployed FP8 weight)``, the derivative of the visible forward;
  ``"master"``: ``W_ref`` = master weight. ``dw_activation="dequantized"`` (default):
  ``X_ref = dequant(x_q)`` with x_q, x_scale from the kernel's own activation quantizer;
  ``"original"``: ``X_ref = x``. Saved: the deployed FP8 weight and its scales by reference (or
  the master), and x_q, x_scale (or x), under the contract's names
  (``quant.linear_vjp.saved_tensor_names``). Dequantization is ``quant.fp8.dequantize_fp8`` in fp32.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.kernels.linear import FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME, VllmLinearKernel
from megatron_vllm_align.kernels.vllm_context import VllmContext
from megatron_vllm_align.modules.refresh import master_stamp
from megatron_vllm_align.quant.linear_vjp import (
    check_reference_choices,
    fp8_linear_vjp,
    linear_vjp,
    saved_tensor_names,
)


class DenseLinearFunction(torch.autograd.Function):
    """``apply(x [M, K], weight, bias, kernel) -> Y [M, N]`` (contract ``dense_linear``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                kernel: VllmLinearKernel) -> torch.Tensor:
        out = kernel(x)
        ctx.save_for_backward(x, weight)
        ctx.model_dtype = kernel.context.model_dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        w_ref = weight.detach().to(ctx.model_dtype)
        needs = tuple(ctx.needs_input_grad[:3])
        return (*linear_vjp(grad_out, x, w_ref, ctx.bias_dtype, x.dtype, weight.dtype, needs), None)


class VllmFP8LinearFunction(torch.autograd.Function):
    """``apply(x [M, K], weight, bias, kernel, dx_weight, dw_activation) -> Y [M, N]``
    (contract ``fp8_linear_per_channel``, W8A8 through vLLM's FP8 method)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                kernel: VllmLinearKernel, dx_weight: str, dw_activation: str) -> torch.Tensor:
        out = kernel(x)
        names = saved_tensor_names(dx_weight, dw_activation, *ctx.needs_input_grad[:2])
        available = {"master_weight": weight, "input": x}
        if "weight_fp8" in names:
            available["weight_fp8"], available["weight_scale"] = kernel.fp8_weight()
        if "input_fp8" in names:
            available["input_fp8"], available["input_scale"] = kernel.quantize_activation(x)
        ctx.saved_names = names
        ctx.save_for_backward(*(available[name] for name in names))
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = dict(zip(ctx.saved_names, ctx.saved_tensors))
        grads = fp8_linear_vjp(grad_out, saved, FP8_WEIGHT_SCHEME, FP8_ACTIVATION_SCHEME, ctx.dtypes,
                               tuple(ctx.needs_input_grad[:3]))
        return (*grads, None, None, None)


class _DeployedLinear(nn.Module):
    """Master ``weight`` [out, in] (+ ``bias`` [out]) and the vLLM shadow built from them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, vllm_context: VllmContext,
                 quantized: bool, prefix: str, params_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.kernel = VllmLinearKernel(vllm_context, in_features, out_features, bias, quantized, prefix)
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

    def refresh_deployed(self) -> None:
        """Rebuild the deployed value (vLLM's processing of the current master) in the shadow."""
        self.kernel.load(self.weight, self.bias)
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


class VllmDenseLinear(_DeployedLinear):
    """``forward(x [..., in]) -> y [..., out]`` through vLLM's unquantized linear (``dense_linear``)."""

    contract_name = "dense_linear"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, vllm_context: VllmContext,
                 prefix: str = "", params_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias, vllm_context=vllm_context, quantized=False,
                         prefix=prefix, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = DenseLinearFunction.apply(self._flat_input(x), self.weight, self.bias, self.kernel)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class VllmFP8Linear(_DeployedLinear):
    """``forward(x [..., in]) -> y [..., out]`` through vLLM's W8A8 FP8 per-channel linear
    (``fp8_linear_per_channel``). Needs an engine with ``quantization="fp8_per_channel"``;
    ``prefix`` is the layer's name in the vLLM model (the quantization config may skip layers)."""

    contract_name = "fp8_linear_per_channel"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, vllm_context: VllmContext,
                 prefix: str = "", params_dtype: torch.dtype | None = None, dx_weight: str = "dequantized",
                 dw_activation: str = "dequantized", **kwargs: Any) -> None:
        check_reference_choices(dx_weight, dw_activation)
        super().__init__(in_features, out_features, bias, vllm_context=vllm_context, quantized=True,
                         prefix=prefix, params_dtype=params_dtype)
        self.dx_weight = dx_weight
        self.dw_activation = dw_activation
        self._check_method()

    def _check_method(self) -> None:
        """Refuse anything but vLLM's PTPC method on a kernel that quantizes x with its ``quant_fp8``."""
        from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearKernel
        from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod

        method = self.kernel.quant_method
        if not isinstance(method, Fp8PtpcOnlineLinearMethod):
            raise ValueError(f"VllmFP8Linear needs vLLM's Fp8PtpcOnlineLinearMethod (engine quantization "
                             f"'fp8_per_channel') for prefix {self.kernel.prefix!r}, got {type(method).__name__}")
        fp8_kernel = method.fp8_linear
        if type(fp8_kernel).apply_weights is not FP8ScaledMMLinearKernel.apply_weights:
            raise ValueError(f"vLLM chose {type(fp8_kernel).__name__}, which quantizes activations inside a "
                             "fused op; the saved activation would not be the one its forward used")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = VllmFP8LinearFunction.apply(self._flat_input(x), self.weight, self.bias, self.kernel,
                                      self.dx_weight, self.dw_activation)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dx_weight={self.dx_weight}, dw_activation={self.dw_activation}"

"""The W8A8 FP8 linear whose forward is vLLM's and whose backward is the reused linear VJP on the
references its contract names.

- ``fp8_linear_per_channel`` (case B), :class:`VllmFP8Linear` (:class:`VllmFP8LinearFunction`): vLLM's
  ``Fp8PtpcOnlineLinearMethod`` (engine quantization ``"fp8_per_channel"``) quantizes the master
  per output channel at refresh and the input per token in every call (W8A8). Identity STEs for
  both quantizers; scales are stop-gradient. ``dx_weight="dequantized"`` (default):
  ``W_ref = dequant(deployed FP8 weight)``, the derivative of the visible forward;
  ``"master"``: ``W_ref`` = master weight. ``dw_activation="dequantized"`` (default):
  ``X_ref = dequant(x_q)`` with x_q, x_scale from the kernel's own activation quantizer;
  ``"original"``: ``X_ref = x``. Saved: the deployed FP8 weight and its scales by reference (or
  the master), and x_q, x_scale (or x), under the contract's names
  (``ops.fp8_linear.vjp.saved_tensor_names``). Dequantization is ``quant.fp8.dequantize_fp8`` (the
  fp32 product rounded once to the model dtype); the backward is the BF16 GEMM one of
  ``ops.dense_linear.vjp.linear_vjp`` on those references.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel
from megatron_vllm_align.ops.dense_linear.module import DeployedLinear
from megatron_vllm_align.ops.fp8_linear.kernel import FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME
from megatron_vllm_align.ops.fp8_linear.vjp import check_reference_choices, fp8_linear_vjp, saved_tensor_names
from megatron_vllm_align.ops.vllm_context import VllmContext
from megatron_vllm_align.utils.quantization_names import Quantization


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


class VllmFP8Linear(DeployedLinear):
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
                             f"'{Quantization.FP8_PER_CHANNEL}') for prefix {self.kernel.prefix!r}, "
                             f"got {type(method).__name__}")
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

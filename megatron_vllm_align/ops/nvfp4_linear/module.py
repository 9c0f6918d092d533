"""The W4A4 NVFP4 linear whose forward is vLLM's (its ModelOpt NVFP4 method on the emulation kernel,
``ops.nvfp4_linear.kernel``) and whose backward is the reused linear VJP on the contract's references.

Contract ``nvfp4_linear`` (case B), :class:`VllmNVFP4Linear` (:class:`VllmNVFP4LinearFunction`):

* Weights have three values (docs/method.md#weight-values): the optimizer's main copy, the master parameters ``weight``
  [N, K] / ``bias`` [N], and the deployed value (packed E2M1 + e4m3 block scales + fp32
  ``weight_scale_2``), which :meth:`VllmNVFP4Linear.refresh_deployed` rebuilds from the master in a
  shadow vLLM layer; the forward refuses a master (or input scale) that changed since.
* The input's global scale ``input_scale`` (``g = amax_calib / 2688``, vLLM's ``input_scale``) is
  fixed from calibration: a buffer, never a parameter (:meth:`VllmNVFP4Linear.calibrate_input_scale`).
* Surrogate: ``dX = STE_act(G @ W_ref)`` with ``W_ref = dequant(deployed weight)`` (default,
  ``dx_weight="dequantized"``; ``"master"``: the master weight); ``dW = G^T @ X_ref`` with ``X_ref =
  dequant(x_q)`` from the kernel's own activation quantizer (default; ``dw_activation="original"``:
  x), identity weight STE; ``db = sum_tokens G``. ``STE_act`` is the contract's clipped STE: 1 where
  ``|x| <= 2688 * g`` (1 at the threshold), 0 beyond, where the forward saturates
  (``quant.ste.ste_pass_mask`` with ``scale = g``). ``activation_ste`` can be given to implement
  another STE; :meth:`VllmNVFP4Linear.declared_surrogate` then says so and ``contract_mismatches``
  reports it.
* Saved (names of the contract's ``save_recompute.save``; ``ops.nvfp4_linear.vjp``): the deployed
  weight by reference (``weight_fp4``, ``weight_block_scale``, ``weight_global_scale``), the input's
  packed codes, block scales and global scale, and the bool clip mask; only what the requested
  gradients use.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.contracts import STE, get_default_contract
from megatron_vllm_align.ops.nvfp4_linear.kernel import VllmNVFP4LinearKernel
from megatron_vllm_align.ops.nvfp4_linear.vjp import check_reference_choices, nvfp4_linear_vjp, saved_tensor_names
from megatron_vllm_align.ops.refresh import master_stamp
from megatron_vllm_align.ops.vllm_context import VllmContext
from megatron_vllm_align.quant.nvfp4 import E2M1_MAX, E4M3_MAX
from megatron_vllm_align.quant.ste import ste_pass_mask

CONTRACT_NAME = "nvfp4_linear"
BACKWARD_IMPLEMENTATION = "torch:matmul"
SCALES = {"weight.global": "stop_gradient", "weight.block": "stop_gradient", "input.global": "fixed",
          "input.block": "stop_gradient"}


def contract_activation_ste() -> STE:
    """The activation STE of the default ``nvfp4_linear`` contract (clipped at 2688, 1 there)."""
    return get_default_contract(CONTRACT_NAME).surrogate.activation_ste


class VllmNVFP4LinearFunction(torch.autograd.Function):
    """``apply(x [M, K], weight, bias, input_scale, kernel, dx_weight, dw_activation, activation_ste)
    -> Y [M, N]`` (contract ``nvfp4_linear``); inputs pre-validated, ``input_scale`` is not
    differentiated (fixed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                input_scale: torch.Tensor, kernel: VllmNVFP4LinearKernel, dx_weight: str, dw_activation: str,
                activation_ste: STE) -> torch.Tensor:
        out = kernel(x)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        names = saved_tensor_names(dx_weight, dw_activation, need_dx, need_dw,
                                   clip_activation=activation_ste.kind == "clipped")
        available: dict[str, torch.Tensor] = {"master_weight": weight, "input": x}
        if "weight_fp4" in names:
            available.update(zip(("weight_fp4", "weight_block_scale", "weight_global_scale"),
                                 kernel.deployed_weight(), strict=True))
        if "input_fp4" in names:
            available.update(zip(("input_fp4", "input_block_scale", "input_global_scale"),
                                 kernel.quantize_activation(x), strict=True))
        if "input_clip_mask" in names:
            available["input_clip_mask"] = ste_pass_mask(activation_ste, x, kernel.input_scale())
        ctx.saved_names = names
        ctx.save_for_backward(*(available[name] for name in names))
        ctx.model_dtype = kernel.context.model_dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = dict(zip(ctx.saved_names, ctx.saved_tensors, strict=True))
        grads = nvfp4_linear_vjp(grad_out, saved, ctx.model_dtype, ctx.dtypes, tuple(ctx.needs_input_grad[:3]))
        return (*grads, None, None, None, None, None)


class VllmNVFP4Linear(nn.Module):
    """``forward(x [..., in]) -> y [..., out]`` through vLLM's W4A4 NVFP4 linear (``nvfp4_linear``).

    ``in_features`` must be a multiple of 16. ``input_scale``: the calibrated input global scale
    ``amax / 2688`` (float or fp32 tensor); ``None`` leaves the module uncalibrated until
    :meth:`calibrate_input_scale`. ``vllm_context`` supplies the model dtype (x must have it) and
    vLLM's configuration; ``prefix`` is the layer's name in the vLLM model. Parameters: ``weight``
    (+ ``bias``) only; buffer ``input_scale`` (fp32 [1], NaN while uncalibrated).
    """

    contract_name = CONTRACT_NAME

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, vllm_context: VllmContext,
                 input_scale: float | torch.Tensor | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None, dx_weight: str = "dequantized",
                 dw_activation: str = "dequantized", activation_ste: STE | None = None, **kwargs: Any) -> None:
        super().__init__()
        check_reference_choices(dx_weight, dw_activation)
        activation_ste = contract_activation_ste() if activation_ste is None else activation_ste
        if not isinstance(activation_ste, STE) or activation_ste.kind == "none":
            raise ValueError(f"activation_ste must be an identity or clipped contracts.STE (NVFP4 quantizes the "
                             f"input), got {activation_ste!r}")
        self.kernel = VllmNVFP4LinearKernel(vllm_context, in_features, out_features, bias, prefix)
        dtype = params_dtype or vllm_context.model_dtype
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"params_dtype must be bfloat16, float16 or float32, got {dtype}")
        self.dx_weight, self.dw_activation, self.activation_ste = dx_weight, dw_activation, activation_ste
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.register_buffer("input_scale", torch.full((1,), float("nan"), dtype=torch.float32))
        if input_scale is not None:
            self.input_scale.copy_(_checked_input_scale(input_scale))
        self._deployed_stamp: tuple[tuple[int, int], ...] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, then a refresh of the deployed value."""
        nn.Linear.reset_parameters(self)
        self.refresh_deployed()

    @property
    def calibrated(self) -> bool:
        return bool(torch.isfinite(self.input_scale).all())

    def calibrate_input_scale(self, *samples: torch.Tensor) -> torch.Tensor:
        """Fix ``input_scale = amax|samples| / (6 * 448)`` in fp32 (ModelOpt's rule), refresh, return it."""
        if not samples or not all(isinstance(s, torch.Tensor) and s.numel() for s in samples):
            raise ValueError("calibrate_input_scale needs at least one non-empty tensor")
        amax = max(float(s.detach().abs().amax().float()) for s in samples)
        with torch.no_grad():
            self.input_scale.copy_(_checked_input_scale(torch.tensor([amax], dtype=torch.float32)
                                                        / (E2M1_MAX * E4M3_MAX)))
        self.refresh_deployed()
        return self.input_scale

    def _master_stamp(self) -> tuple[tuple[int, int], ...]:
        return master_stamp(self.weight, self.bias, self.input_scale)

    def refresh_deployed(self) -> None:
        """Rebuild the deployed value (vLLM's processing of the current master) in the shadow; a no-op
        (the forward refuses) while uncalibrated."""
        if not self.calibrated:
            self._deployed_stamp = None
            return
        self.kernel.load(self.weight, self.bias, self.input_scale)
        self._deployed_stamp = self._master_stamp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.calibrated:
            raise RuntimeError(f"{type(self).__name__}: input_scale is not calibrated; pass input_scale= or call "
                               "calibrate_input_scale(x)")
        if self._deployed_stamp != self._master_stamp():
            raise RuntimeError(f"{type(self).__name__}: the master weight or input_scale changed since the deployed "
                               "value was built; call refresh_deployed() (or register_deployed_refresh(optimizer, "
                               "model))")
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x must be [..., in_features={self.weight.shape[1]}], got "
                             f"{tuple(getattr(x, 'shape', ()))}")
        out = VllmNVFP4LinearFunction.apply(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self.input_scale,
                                            self.kernel, self.dx_weight, self.dw_activation, self.activation_ste)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def declared_surrogate(self) -> dict[str, Any]:
        """What this module implements, for ``contract_mismatches(contract, **module.declared_surrogate())``."""
        return {
            "case": "B",
            "dx_weight": self.dx_weight,
            "activation_ref": "quantized" if self.dw_activation == "dequantized" else "original",
            "weight_ste": STE("identity"),
            "activation_ste": self.activation_ste,
            "backward_kind": "reused",
            "backward_implementation": BACKWARD_IMPLEMENTATION,
            "scales": dict(SCALES),
            "saved": saved_tensor_names(self.dx_weight, self.dw_activation, True, True,
                                        self.activation_ste.kind == "clipped"),
        }

    def extra_repr(self) -> str:
        ste = self.activation_ste
        ste_text = "identity" if ste.kind == "identity" else f"clipped at {ste.threshold:g}"
        return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, input_scale={float(self.input_scale):.6g}, "
                f"dx_weight={self.dx_weight}, dw_activation={self.dw_activation}, activation_ste={ste_text}, "
                f"prefix={self.kernel.prefix!r}")


def _checked_input_scale(value: float | torch.Tensor) -> torch.Tensor:
    scale = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    if scale.numel() != 1 or not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"input_scale must be one finite value > 0, got {value!r}")
    return scale

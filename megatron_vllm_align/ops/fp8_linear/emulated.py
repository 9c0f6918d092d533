"""An emulated W8A8 FP8 linear ``Y = X W^T + b``: a visible FP8 forward and an STE backward to the
master weight, configured from a gradient contract.

Why it exists: the CPU engine serves only per-channel FP8 (:class:`.module.VllmFP8Linear`, vLLM's own
method), so this emulation (vLLM's quantization rules and GEMM formula, ``quant.fp8_gemm``) is the
module of this home's other two contracts (``fp8_linear_per_tensor``, ``fp8_linear_block128``: their
layer-1 cases in :mod:`.case`), the FP8 reference's default visible value (:mod:`.reference`) and what
layer 2 installs to compare conventions over the three FP8 precisions (``validation.layer2``). It
stays in the op home because the home's cases and reference import it (ops sit below validation).
Training never builds it.

Gradient contract (docs/method.md#which-weight-dx-uses), with ``G = dL/dY`` and all
products accumulated in fp32, then cast to the dtype of the input / parameter:

* forward: ``x_q, x_scale = quant(X)`` (``activation_scheme``), ``w_q, w_scale = quant(W_master)``
  (``weight_scheme``), recomputed every call (dynamic scales from amax, or the static scale the
  config carries); ``Y = visible_gemm(x_q, x_scale, w_q, w_scale, b, X.dtype)``.
* ``dX = STE_act(G @ W_ref)`` with ``W_ref = dequant(w_q, w_scale)`` for
  ``dx_weight="dequantized"`` (the exact derivative of the visible forward w.r.t. the
  dequantized activation) or ``W_ref = W_master`` for ``dx_weight="master"``.
* ``dW_master = STE_w(G^T @ X_ref)`` with ``X_ref = dequant(x_q, x_scale)`` for
  ``dw_activation="dequantized"`` or ``X_ref = X`` for ``dw_activation="original"``.
* ``db = sum_tokens(G)``.
* ``STE_act`` / ``STE_w`` multiply by the surrogate derivative of the ``contracts.STE`` evaluated
  at ``X`` / ``W_master`` (identity: 1; clipped: the 0/1 mask of ``quant.ste.ste_pass_mask``).
* The backward is the shared ``ops.fp8_linear.vjp.fp8_linear_vjp``: the ordinary BF16 GEMM backward
  (``ops.dense_linear.vjp.linear_vjp``, Megatron's local linear backward; Transformer Engine's GEMMs
  on CUDA where TE imports) on ``W_ref`` / ``X_ref`` rounded once to the model dtype.

Clipped STEs. A contract's clipped threshold is relative to the tensor's per-tensor scale ``s``
(derivative 1 where ``|x / s| < threshold``). Dynamic amax scaling (every dynamic granularity)
maps each tile's largest element to the FP8 maximum, so nothing saturates and there is no fixed
``s``: ``FP8LinearConfig`` refuses a clipped STE there. A clipped STE needs its role quantized
with a static ``per_tensor`` scheme whose fp32 ``[1]`` scale the config carries
(``activation_scale`` / ``weight_scale``); the mask is ``ste_pass_mask(ste, X or W_master, that
scale)``, so ``threshold=448`` clips exactly where the forward saturates. The activation mask is
computed in forward and saved (``input_clip_mask``); the weight mask is recomputed in backward
from the master weight.

Saved for backward, only what the requested gradients use (names as in a contract's
``save_recompute.save``): ``weight_fp8, weight_scale`` or ``master_weight`` (for dX),
``input_clip_mask`` (clipped activation STE), ``input_fp8, input_scale`` or ``input`` (for dW),
``master_weight`` (clipped weight STE; the parameter itself, no copy).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.contracts.defaults import get_default_contract
from megatron_vllm_align.contracts.schema import STE, ContractError, GradientContract
from megatron_vllm_align.ops.fp8_linear.vjp import check_reference_choices, fp8_linear_vjp, saved_tensor_names
from megatron_vllm_align.quant.fp8 import INPUT_DTYPES, FP8Scheme, quantize_fp8
from megatron_vllm_align.quant.fp8_contract import fp8_position
from megatron_vllm_align.quant.fp8_gemm import DequantFP8Gemm, VisibleGemm, vllm_fp8_scaled_mm
from megatron_vllm_align.quant.ste import ste_pass_mask

#: The library function of the backward's GEMMs, as a contract's backward.implementations names it.
BACKWARD_IMPLEMENTATION = "torch:matmul"
#: Contract ``surrogate.activation_ref`` -> ``FP8LinearConfig.dw_activation``.
_DW_ACTIVATION = {"quantized": "dequantized", "original": "original"}
#: role -> (scheme field, scale field, STE field, dynamic granularities, contract tensor name)
_ROLES = {
    "activation": ("activation_scheme", "activation_scale", "activation_ste", ("per_token", "per_token_group"),
                   "input"),
    "weight": ("weight_scheme", "weight_scale", "weight_ste", ("per_tensor", "per_channel", "block"), "weight"),
}
_STATIC_GRANULARITY = "per_tensor"


def _check_static_scale(name: str, scale: Any) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"FP8LinearConfig.{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (1,):
        raise ValueError(f"FP8LinearConfig.{name} must be a float32 tensor of shape (1,) (a static per_tensor "
                         f"scale), got {scale.dtype} {tuple(scale.shape)}")
    if not (bool(torch.isfinite(scale).all()) and bool((scale > 0).all())):
        raise ValueError(f"FP8LinearConfig.{name} must be finite and > 0, got {scale.tolist()}")


@dataclass(frozen=True, eq=False)
class FP8LinearConfig:
    """The full contract of an FP8 linear; every field is explicit (see the module docstring).

    activation_scheme: dynamic ``per_token`` or ``per_token_group``, or static ``per_tensor``.
    weight_scheme: dynamic ``per_tensor``, ``per_channel`` or ``block``, or static ``per_tensor``.
    dx_weight: ``"dequantized"`` or ``"master"``.
    dw_activation: ``"dequantized"`` or ``"original"``.
    activation_ste / weight_ste: ``contracts.STE`` (identity or clipped) applied to dX / dW; a
        clipped one needs its role's scheme static (module docstring, "Clipped STEs").
    visible_gemm: a ``VisibleGemm`` computing the forward output.
    activation_scale / weight_scale: the fp32 ``[1]`` scale of a static scheme; ``None`` (and
        forbidden) for a dynamic one.
    """

    activation_scheme: FP8Scheme
    weight_scheme: FP8Scheme
    dx_weight: str
    dw_activation: str
    activation_ste: STE
    weight_ste: STE
    visible_gemm: VisibleGemm
    activation_scale: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for role, (scheme_name, scale_name, ste_name, dynamic, _) in _ROLES.items():
            scheme, scale, ste = getattr(self, scheme_name), getattr(self, scale_name), getattr(self, ste_name)
            if not isinstance(scheme, FP8Scheme):
                raise TypeError(f"FP8LinearConfig.{scheme_name} must be an FP8Scheme, got {type(scheme).__name__}")
            if scheme.static:
                if scheme.granularity != _STATIC_GRANULARITY:
                    raise ValueError(f"FP8LinearConfig.{scheme_name}: a static scheme must be "
                                     f"{_STATIC_GRANULARITY!r}, got {scheme}")
                if scale is None:
                    raise ValueError(f"FP8LinearConfig.{scale_name} is required for the static {scheme_name}")
                _check_static_scale(scale_name, scale)
            else:
                if scheme.granularity not in dynamic:
                    raise ValueError(f"FP8LinearConfig.{scheme_name} must be dynamic with granularity in "
                                     f"{dynamic} or static {_STATIC_GRANULARITY!r}, got {scheme}")
                if scale is not None:
                    raise ValueError(f"FP8LinearConfig.{scale_name} must be None for the dynamic {scheme_name}")
            if not isinstance(ste, STE):
                raise TypeError(f"FP8LinearConfig.{ste_name} must be a contracts.STE, got {type(ste).__name__}")
            if ste.kind == "none":
                raise ValueError(f"FP8LinearConfig.{ste_name} is 'none', but the FP8 linear quantizes the {role}; "
                                 "use 'identity' or 'clipped'")
            if ste.kind == "clipped" and not scheme.static:
                raise ValueError(f"FP8LinearConfig.{ste_name} is clipped at {ste.threshold:g} times a per-tensor "
                                 f"scale, but {scheme_name} is dynamic {scheme.granularity}: amax scaling never "
                                 f"saturates; quantize the {role} with a static per_tensor scheme and give "
                                 f"{scale_name}")
        check_reference_choices(self.dx_weight, self.dw_activation, owner="FP8LinearConfig.")
        if not callable(self.visible_gemm):
            raise TypeError("FP8LinearConfig.visible_gemm must be callable")

    @classmethod
    def from_contract(cls, contract: GradientContract, visible_gemm: VisibleGemm | None = None,
                      static_scales: dict[str, torch.Tensor] | None = None) -> FP8LinearConfig:
        """The configuration that implements ``contract``, or ``ContractError`` saying why it cannot.

        Schemes come from the contract's quantize positions (``quant.fp8_contract``): a ``fixed``
        scale is static and its fp32 ``[1]`` tensor is ``static_scales[<tensor name>]``.
        ``dx_weight`` and the STEs are copied; ``activation_ref`` quantized / original becomes
        ``dw_activation`` dequantized / original. ``visible_gemm`` defaults to vLLM's CPU kernel
        (``vllm_fp8_scaled_mm``) for dynamic per-token e4m3 activations with per-channel or
        per-tensor e4m3 weights, else the native ``DequantFP8Gemm``. Refused: a case other than
        B, a backward that is not ``reused`` with ``torch:matmul`` allowed and fp32 accumulation,
        and anything ``FP8LinearConfig`` itself refuses (e.g. a clipped STE on a dynamic scale).
        """
        if not isinstance(contract, GradientContract):
            raise TypeError(f"contract must be a GradientContract, got {type(contract).__name__}")
        name, backward = contract.module_class, contract.backward
        refusals = (("case", contract.case == "B", f"FP8Linear is case 'B', got {contract.case!r}"),
                    ("backward.kind", backward.kind == "reused",
                     f"FP8Linear reuses GEMM backward formulas ('reused'), got {backward.kind!r}"),
                    ("backward.implementations", BACKWARD_IMPLEMENTATION in backward.implementations,
                     f"FP8Linear's backward runs {BACKWARD_IMPLEMENTATION!r}, which the contract does not allow"),
                    ("backward.accumulation", backward.accumulation == "fp32",
                     f"FP8Linear's backward accumulates in fp32, got {backward.accumulation!r}"))
        for field, holds, message in refusals:
            if not holds:
                raise ContractError(message, contract=name, field=field)
        activation, weight = fp8_position(contract, "activation"), fp8_position(contract, "weight")
        scales = dict(static_scales or {})
        static = {p.tensor for p in (activation, weight) if p.scheme.static}
        if set(scales) != static:
            raise ContractError(f"static_scales must hold exactly the tensors with a 'fixed' scale, "
                                f"{sorted(static)}; got {sorted(scales)}", contract=name, field="trainable.scales")
        if visible_gemm is None:
            channelwise = (activation.scheme == FP8Scheme("per_token")
                           and weight.scheme in (FP8Scheme("per_channel"), FP8Scheme("per_tensor"),
                                                 FP8Scheme("per_tensor", static=True)))
            visible_gemm = vllm_fp8_scaled_mm if channelwise else DequantFP8Gemm(activation.scheme, weight.scheme)
        try:
            return cls(activation_scheme=activation.scheme, weight_scheme=weight.scheme,
                       dx_weight=contract.surrogate.dx_weight,
                       dw_activation=_DW_ACTIVATION[contract.surrogate.activation_ref],
                       activation_ste=contract.surrogate.activation_ste, weight_ste=contract.surrogate.weight_ste,
                       visible_gemm=visible_gemm, activation_scale=scales.get(activation.tensor),
                       weight_scale=scales.get(weight.tensor))
        except (TypeError, ValueError) as error:
            raise ContractError(f"FP8Linear cannot honour it: {error}", contract=name) from None

    def declared_surrogate(self) -> dict[str, Any]:
        """What this configuration implements, as keyword arguments of ``contracts.contract_mismatches``
        (tensor names ``input`` / ``weight``; ``saved`` for a backward that needs dX and dW)."""
        activation_ref = {value: key for key, value in _DW_ACTIVATION.items()}[self.dw_activation]
        return {
            "case": "B",
            "dx_weight": self.dx_weight,
            "activation_ref": activation_ref,
            "weight_ste": self.weight_ste,
            "activation_ste": self.activation_ste,
            "backward_kind": "reused",
            "backward_implementation": BACKWARD_IMPLEMENTATION,
            "scales": {tensor: "fixed" if getattr(self, scheme_name).static else "stop_gradient"
                       for scheme_name, _, _, _, tensor in _ROLES.values()},
            "saved": _saved_tensor_names(self, need_dx=True, need_dw=True),
        }


def _saved_tensor_names(config: FP8LinearConfig, need_dx: bool, need_dw: bool) -> tuple[str, ...]:
    """Names of the tensors ``FP8LinearFunction`` saves for the requested gradients, in save order."""
    return saved_tensor_names(config.dx_weight, config.dw_activation, need_dx, need_dw,
                              clip_activation=config.activation_ste.kind == "clipped",
                              clip_weight=config.weight_ste.kind == "clipped")


def default_fp8_linear_config(dx_weight: str = "dequantized") -> FP8LinearConfig:
    """``FP8LinearConfig.from_contract`` of the default contract ``fp8_linear_per_channel`` (vLLM's
    CPU W8A8 path: per-token and per-channel e4m3, vLLM's GEMM, dequantized X_ref for dW, identity
    STEs), with ``dx_weight`` replaced when given."""
    config = FP8LinearConfig.from_contract(get_default_contract("fp8_linear_per_channel"))
    return dataclasses.replace(config, dx_weight=dx_weight)


class FP8LinearFunction(torch.autograd.Function):
    """``apply(x [M, K], weight [N, K], bias [N] | None, config) -> Y [M, N]``; inputs pre-validated."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: FP8LinearConfig) -> torch.Tensor:
        x_q, x_scale = quantize_fp8(x.detach(), config.activation_scheme, config.activation_scale)
        w_q, w_scale = quantize_fp8(weight.detach(), config.weight_scheme, config.weight_scale)
        out = config.visible_gemm(x_q, x_scale, w_q, w_scale, None if bias is None else bias.detach(), x.dtype)
        expected = (x.shape[0], weight.shape[0])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != x.dtype:
            raise ValueError(f"visible_gemm must return a {x.dtype} tensor of shape {expected}, got "
                             f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")

        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        names = _saved_tensor_names(config, need_dx, need_dw)
        available = {"weight_fp8": w_q, "weight_scale": w_scale, "master_weight": weight,
                     "input_fp8": x_q, "input_scale": x_scale, "input": x}
        if "input_clip_mask" in names:
            available["input_clip_mask"] = ste_pass_mask(config.activation_ste, x, config.activation_scale)
        ctx.saved_names = names
        ctx.save_for_backward(*(available[name] for name in names))
        ctx.config = config
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.need = (need_dx, need_dw, need_db)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = dict(zip(ctx.saved_names, ctx.saved_tensors))
        config: FP8LinearConfig = ctx.config
        weight_mask = None
        if ctx.need[1] and config.weight_ste.kind == "clipped":
            weight_mask = ste_pass_mask(config.weight_ste, saved["master_weight"], config.weight_scale)
        grads = fp8_linear_vjp(grad_out, saved, config.weight_scheme, config.activation_scheme, ctx.dtypes,
                               ctx.need, weight_mask)
        return (*grads, None)


def _check_linear_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if tensor is None and name == "bias":
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name} must be one of {INPUT_DTYPES}, got {tensor.dtype}")
        if tensor.device != weight.device:
            raise ValueError(f"{name} is on {tensor.device} but weight is on {weight.device}")
        if tensor.dtype != weight.dtype:
            raise ValueError(f"{name} is {tensor.dtype} but weight is {weight.dtype}; they must match")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., K] with K = weight.shape[1] = {weight.shape[1]}, got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x must contain at least one token, got shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape {(weight.shape[0],)}, got {tuple(bias.shape)}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               config: FP8LinearConfig) -> torch.Tensor:
    """``Y [..., N]`` for ``x [..., K]`` under ``config``; leading dims are flattened to tokens."""
    if not isinstance(config, FP8LinearConfig):
        raise TypeError(f"config must be an FP8LinearConfig, got {type(config).__name__}")
    _check_linear_inputs(x, weight, bias)
    out = FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, config)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FP8Linear(nn.Module):
    """``nn.Linear`` whose forward is W8A8 FP8 per ``config``; parameters: ``weight`` (+ ``bias``) only.

    ``config`` defaults to ``default_fp8_linear_config()`` (dX from the dequantized weight).
    Quantized values and scales are recomputed in every forward, never stored as parameters.
    The contract fields are exposed as read-only attributes (``dx_weight``, ``weight_scheme``, ...).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 config: FP8LinearConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = default_fp8_linear_config() if config is None else config
        if not isinstance(self.config, FP8LinearConfig):
            raise TypeError(f"config must be an FP8LinearConfig, got {type(self.config).__name__}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (its own ``reset_parameters``, which reads only weight and bias)."""
        nn.Linear.reset_parameters(self)

    dx_weight = property(lambda self: self.config.dx_weight)
    dw_activation = property(lambda self: self.config.dw_activation)
    activation_scheme = property(lambda self: self.config.activation_scheme)
    weight_scheme = property(lambda self: self.config.weight_scheme)
    activation_ste = property(lambda self: self.config.activation_ste)
    weight_ste = property(lambda self: self.config.weight_ste)
    visible_gemm = property(lambda self: self.config.visible_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.config)

    def declared_surrogate(self) -> dict[str, Any]:
        """What this module implements, for ``contract_mismatches(contract, **module.declared_surrogate())``."""
        return self.config.declared_surrogate()

    def extra_repr(self) -> str:
        c = self.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={c.activation_scheme.granularity}, weight={c.weight_scheme.granularity}, "
                f"dx_weight={c.dx_weight}, dw_activation={c.dw_activation}, "
                f"activation_ste={c.activation_ste.kind}, weight_ste={c.weight_ste.kind}")

"""Gradient contracts as frozen data: one record per module class, checked when it is built.

A contract fixes, before any code runs, the seven decisions of docs/method.md#gradient-contract:
visible forward, trainable variables, surrogate function, discrete state, backward source,
save/recompute, and reference with tolerances agreed in advance. Records are plain data (no
hooks into modules); `contract_mismatches` compares an implementation's declarations against them.

Every field is required except the STE threshold fields. Lists become tuples and integers
become floats where a float is expected; anything else of the wrong type, an enum value that is
not allowed, or a rule below that does not hold raises `ContractError` naming the contract and
the dotted field path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Case = Literal["A", "B", "C", "B+C"]
Dtype = Literal["fp64", "fp32", "bf16", "fp16"]
OutputRounding = Literal["rne", "rtz", "none"]
QuantRounding = Literal["rne", "rtz", "stochastic"]
TensorRole = Literal["weight", "activation"]
QuantFormat = Literal["fp8_e4m3", "fp8_e5m2", "nvfp4_e2m1", "mxfp4_e2m1", "int8"]
ScaleDtype = Literal["fp32", "bf16", "fp8_e4m3", "e8m0"]
GlobalScale = Literal["none", "fp32_per_tensor"]
ScaleHandling = Literal["fixed", "stop_gradient", "trainable"]
DxWeight = Literal["master", "dequantized", "not_applicable"]
ActivationRef = Literal["quantized", "original", "not_applicable"]
SteKind = Literal["identity", "clipped", "none"]
BackwardKind = Literal["reused", "custom_vjp", "glue"]
Metric = Literal["max_abs_error", "rel_l2", "norm_ratio", "cosine"]

#: Largest finite magnitude of each format; a stated clamp must equal it.
FORMAT_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "nvfp4_e2m1": 6.0, "mxfp4_e2m1": 6.0,
              "int8": 127.0}
#: Tolerance key that applies to every gradient without its own entry.
ANY_GRADIENT = "*"
REQUIRED_METRICS = ("max_abs_error", "rel_l2")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCALE_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z_][A-Za-z0-9_]*)?")
_IMPLEMENTATION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_.]+")
_GRANULARITY = re.compile(r"none|per_tensor|per_token|per_channel|per_token_group_[1-9][0-9]*"
                          r"|block_[1-9][0-9]*x[1-9][0-9]*|block_[1-9][0-9]*")
_GRANULARITY_FORMS = ("none, per_tensor, per_token, per_channel, per_token_group_<n>, "
                      "block_<rows>x<cols>, block_<n>")
_CLAMP = re.compile(r"none|±([0-9]+(?:\.[0-9]+)?)")


class ContractError(ValueError):
    """A gradient contract is malformed or inconsistent.

    `contract` is the module class (None when unknown), `field` the dotted path of the
    offending field inside the contract (None for file-level problems).
    """

    def __init__(self, message: str, *, contract: str | None = None, field: str | None = None,
                 source: str | None = None) -> None:
        self.message, self.contract, self.field, self.source = message, contract, field, source
        where = [f"contract {contract!r}"] if contract else []
        where += [f"field {field!r}"] if field else []
        where += [f"in {source}"] if source else []
        super().__init__(f"{', '.join(where)}: {message}" if where else message)

    def within(self, *, contract: str | None = None, prefix: str | None = None,
               source: str | None = None) -> ContractError:
        """The same error seen from an enclosing record: path prefixed, names filled in."""
        field = self.field
        if prefix and field:
            field = f"{prefix}{'' if field.startswith('[') else '.'}{field}"
        elif prefix:
            field = prefix
        return ContractError(self.message, contract=self.contract or contract, field=field,
                             source=self.source or source)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a record class (shared with the YAML reader)."""
    return typing.get_type_hints(cls)


def _describe_type(hint: Any) -> str:
    """Human-readable name of a field type, for error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe_type(args[0])}"
    if origin is dict:
        return f"a mapping of str to {_describe_type(args[1])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe_type(a) for a in args)
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    return f"a {hint.__name__} record"


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _checked(value: Any, hint: Any, field: str) -> Any:
    """`value` normalised to `hint` (list -> tuple, int -> float), or ContractError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _checked(value, inner, field)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ContractError(f"invalid value {value!r}; allowed: {', '.join(map(str, args))}",
                            field=field)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(_checked(item, args[0], f"{field}[{i}]") for i, item in enumerate(value))
    if origin is dict and isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ContractError(f"keys must be strings, got {key!r}", field=field)
        return {key: _checked(item, args[1], f"{field}.{key}") for key, item in value.items()}
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ContractError(f"must be finite, got {value!r}", field=field)
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, hint):
        return value
    hint_text = _describe_type(hint)
    if hint is float and isinstance(value, str) and _is_number_text(value):
        hint_text += " (YAML reads 1e-6 as text: write 1.0e-6)"
    raise ContractError(f"expected {hint_text}, got {type(value).__name__} {value!r}",
                        field=field)


def _require_text(value: str, field: str) -> None:
    if not value.strip():
        raise ContractError("must be non-empty text", field=field)


def _require_identifier(value: str, field: str) -> None:
    if not _IDENTIFIER.fullmatch(value):
        raise ContractError(f"{value!r} is not an identifier (letters, digits, _)", field=field)


def _require_names(values: tuple[str, ...], field: str, *, non_empty: bool = False) -> None:
    if non_empty and not values:
        raise ContractError("must list at least one name", field=field)
    for i, value in enumerate(values):
        _require_identifier(value, f"{field}[{i}]")
    if len(set(values)) != len(values):
        duplicates = sorted({v for v in values if values.count(v) > 1})
        raise ContractError(f"duplicate names {duplicates}", field=field)


class _Record:
    """Base of every contract record: normalises and type-checks fields, then `_check()`s."""

    def __post_init__(self) -> None:
        for name, hint in field_types(type(self)).items():
            object.__setattr__(self, name, _checked(getattr(self, name), hint, name))
        self._check()

    def _check(self) -> None:
        """Rules of this record beyond field types; raise ContractError naming the field."""


@dataclass(frozen=True)
class QuantizePosition(_Record):
    """One tensor the visible forward quantizes.

    `scale_rule` says how and when the scale is computed (dynamic per call, at weight refresh,
    fixed from calibration) and any lower bound on it; `clamp` is "none" or "±<format max>".
    """

    tensor: str
    role: TensorRole
    format: QuantFormat
    scale_granularity: str
    scale_dtype: ScaleDtype
    global_scale: GlobalScale
    scale_rule: str
    rounding: QuantRounding
    clamp: str

    def _check(self) -> None:
        _require_identifier(self.tensor, "tensor")
        if not _GRANULARITY.fullmatch(self.scale_granularity):
            raise ContractError(f"invalid value {self.scale_granularity!r}; allowed: "
                                f"{_GRANULARITY_FORMS}", field="scale_granularity")
        _require_text(self.scale_rule, "scale_rule")
        clamp = _CLAMP.fullmatch(self.clamp)
        if clamp is None:
            raise ContractError(f"invalid value {self.clamp!r}; write 'none' or '±<max>'",
                                field="clamp")
        if clamp.group(1) is not None and float(clamp.group(1)) != FORMAT_MAX[self.format]:
            raise ContractError(f"clamp {self.clamp} is not the {self.format} maximum "
                                f"±{FORMAT_MAX[self.format]:g}", field="clamp")


@dataclass(frozen=True)
class VisibleForward(_Record):
    """The inference implementation whose output the training forward returns.

    `kernel` is "library:name" (e.g. "vllm:_C.rms_norm"); `dequantize_positions` says where
    scales are applied (e.g. in the GEMM epilogue); `accumulation` is the reduction precision;
    `output_rounding` is the rounding of the final cast to `output_dtype`.
    """

    kernel: str
    input_dtype: Dtype
    output_dtype: Dtype
    layout: str
    quantize_positions: tuple[QuantizePosition, ...]
    dequantize_positions: tuple[str, ...]
    accumulation: Dtype
    output_rounding: OutputRounding

    def _check(self) -> None:
        if not _IMPLEMENTATION.fullmatch(self.kernel):
            raise ContractError(f"{self.kernel!r} is not 'library:name'", field="kernel")
        _require_text(self.layout, "layout")
        _require_names(tuple(p.tensor for p in self.quantize_positions), "quantize_positions")
        if bool(self.quantize_positions) != bool(self.dequantize_positions):
            raise ContractError("a quantized forward must state where it dequantizes, and an "
                                "unquantized one must list none", field="dequantize_positions")
        for i, text in enumerate(self.dequantize_positions):
            _require_text(text, f"dequantize_positions[{i}]")

    def quantizes(self, role: TensorRole) -> bool:
        """Whether any tensor of this role (weight or activation) is quantized."""
        return any(p.role == role for p in self.quantize_positions)


@dataclass(frozen=True)
class Trainable(_Record):
    """Variables that receive gradients, and how each quantization scale is treated.

    `scales` maps "<tensor>" or "<tensor>.<part>" (e.g. "input.global") of every quantized
    tensor to fixed | stop_gradient | trainable.
    """

    variables: tuple[str, ...]
    scales: dict[str, ScaleHandling]

    def _check(self) -> None:
        _require_names(self.variables, "variables", non_empty=True)
        for key in self.scales:
            if not _SCALE_KEY.fullmatch(key):
                raise ContractError(f"{key!r} is not '<tensor>' or '<tensor>.<part>'",
                                    field=f"scales.{key}")


@dataclass(frozen=True)
class STE(_Record):
    """Straight-through estimator for the rounding of one tensor role.

    identity: derivative 1 everywhere. clipped: 1 where |x / s| < threshold, 0 beyond it,
    `value_at_threshold` (0.0 or 1.0) exactly at it, where s is the tensor's per-tensor
    (global) scale, so a contract can fix the threshold before any calibration (NVFP4 with a
    fixed global scale g saturates at |x / g| = 6 · 448 = 2688; a kernel working in units of x
    uses 2688 · g). none: the role is not quantized.
    """

    kind: SteKind
    threshold: float | None = None
    value_at_threshold: float | None = None

    def _check(self) -> None:
        if self.kind == "clipped":
            if self.threshold is None or self.threshold <= 0:
                raise ContractError("a clipped STE needs a positive threshold",
                                    field="threshold")
            if self.value_at_threshold not in (0.0, 1.0):
                raise ContractError("a clipped STE needs value_at_threshold 0.0 or 1.0, got "
                                    f"{self.value_at_threshold!r}", field="value_at_threshold")
            return
        for name in ("threshold", "value_at_threshold"):
            if getattr(self, name) is not None:
                raise ContractError(f"only a clipped STE has a {name}; kind is {self.kind!r}",
                                    field=name)


@dataclass(frozen=True)
class Surrogate(_Record):
    """The derivative used through discrete operations.

    `dx_weight`: W_ref in dX = dY · W_ref, the master or the dequantized weight; stated, never
    defaulted. `activation_ref`: X_ref in dW = dYᵀ · X_ref, quantized or original activation.
    """

    dx_weight: DxWeight
    activation_ref: ActivationRef
    weight_ste: STE
    activation_ste: STE


@dataclass(frozen=True)
class DiscreteState(_Record):
    """Selections copied from the forward and never differentiated (expert IDs, indices,
    ordering), and the continuous quantities around them that still get gradients."""

    fixed: tuple[str, ...]
    continuous_with_gradient: tuple[str, ...]

    def _check(self) -> None:
        _require_names(self.fixed, "fixed")
        _require_names(self.continuous_with_gradient, "continuous_with_gradient")


@dataclass(frozen=True)
class BackwardSource(_Record):
    """Where the backward comes from.

    `implementations` are "library:name" in order of preference; the first importable one is
    used. `cast` says which dtypes enter and leave it; `accumulation` is its reduction precision.
    """

    kind: BackwardKind
    implementations: tuple[str, ...]
    cast: str
    accumulation: Dtype
    communication: str
    normalization: str

    def _check(self) -> None:
        if not self.implementations:
            raise ContractError("must list at least one implementation", field="implementations")
        for i, name in enumerate(self.implementations):
            if not _IMPLEMENTATION.fullmatch(name):
                raise ContractError(f"{name!r} is not 'library:name'",
                                    field=f"implementations[{i}]")
        for name in ("cast", "communication", "normalization"):
            _require_text(getattr(self, name), name)


@dataclass(frozen=True)
class SaveRecompute(_Record):
    """Tensors the forward saves for the backward, what is rebuilt instead, and the cost."""

    save: tuple[str, ...]
    recompute: str
    memory: str

    def _check(self) -> None:
        _require_names(self.save, "save")
        _require_text(self.recompute, "recompute")
        _require_text(self.memory, "memory")


@dataclass(frozen=True)
class Tolerance(_Record):
    """Layer-1 acceptance bounds for one gradient.

    Two-way check: (|g - g_ref| - atol) / max|g_ref| <= rtol, normalised by the global max of
    the reference, not per element; and ||g - g_ref||_2 / max(||g_ref||_2, eps) <= rel_l2.
    """

    atol: float
    rtol: float
    rel_l2: float

    def _check(self) -> None:
        for name in ("atol", "rtol", "rel_l2"):
            if getattr(self, name) < 0:
                raise ContractError("must be >= 0", field=name)


@dataclass(frozen=True)
class Reference(_Record):
    """Independent reference, coverage, metrics and tolerances, fixed before any run.

    `tolerances` is keyed by trainable variable name, or "*" for all others; `reasoning` records
    how the bounds follow from dtype, reduction length and reference precision.
    """

    implementation: str
    coverage: tuple[str, ...]
    metrics: tuple[Metric, ...]
    tolerances: dict[str, Tolerance]
    reasoning: str

    def _check(self) -> None:
        _require_text(self.implementation, "implementation")
        _require_text(self.reasoning, "reasoning")
        if not self.coverage:
            raise ContractError("must list at least one shape or path", field="coverage")
        if len(set(self.metrics)) != len(self.metrics):
            raise ContractError("duplicate metrics", field="metrics")
        for metric in REQUIRED_METRICS:
            if metric not in self.metrics:
                raise ContractError(f"must include {metric!r} (the tolerances bound it)",
                                    field="metrics")

    def tolerance_for(self, gradient: str) -> Tolerance:
        """Bounds for the gradient of variable `gradient` (its own entry, else "*")."""
        if gradient in self.tolerances:
            return self.tolerances[gradient]
        if ANY_GRADIENT in self.tolerances:
            return self.tolerances[ANY_GRADIENT]
        raise ContractError(f"no tolerance for gradient {gradient!r}; have "
                            f"{sorted(self.tolerances)}", field="reference.tolerances")


@dataclass(frozen=True)
class GradientContract(_Record):
    """The gradient contract of one module class; case A/B/C/B+C as in docs/method.md#backward-reuse
    (A: only rounding differs; B: quantized forward with STE; C: glue over a composite)."""

    module_class: str
    case: Case
    visible_forward: VisibleForward
    trainable: Trainable
    surrogate: Surrogate
    discrete_state: DiscreteState
    backward: BackwardSource
    save_recompute: SaveRecompute
    reference: Reference
    notes: str

    def __post_init__(self) -> None:
        name = self.module_class if isinstance(self.module_class, str) else None
        try:
            super().__post_init__()
        except ContractError as error:
            raise error.within(contract=name) from None

    def _check(self) -> None:
        _require_identifier(self.module_class, "module_class")
        self._check_scales()
        self._check_surrogate()
        self._check_case()
        overlap = set(self.discrete_state.fixed) & set(self.trainable.variables)
        if overlap:
            raise ContractError(f"{sorted(overlap)} are fixed discrete state and cannot also be "
                                "trainable variables", field="discrete_state.fixed")
        self._check_tolerances()

    def _check_scales(self) -> None:
        quantized = {p.tensor for p in self.visible_forward.quantize_positions}
        handled = {key.split(".")[0] for key in self.trainable.scales}
        if quantized - handled:
            raise ContractError(f"no scale handling stated for quantized tensor(s) "
                                f"{sorted(quantized - handled)}", field="trainable.scales")
        if handled - quantized:
            raise ContractError(f"scale handling for tensor(s) {sorted(handled - quantized)} "
                                "that the visible forward does not quantize",
                                field="trainable.scales")

    def _check_surrogate(self) -> None:
        surrogate, forward = self.surrogate, self.visible_forward
        rules = (("weight", "dx_weight", ("master", "dequantized"), "weight_ste"),
                 ("activation", "activation_ref", ("quantized", "original"), "activation_ste"))
        for role, choice_field, choices, ste_field in rules:
            choice, ste = getattr(surrogate, choice_field), getattr(surrogate, ste_field)
            if forward.quantizes(role):
                if choice not in choices:
                    raise ContractError(
                        f"the forward quantizes the {role}, so {choice_field} must be stated "
                        f"as {' or '.join(map(repr, choices))}, got {choice!r}",
                        field=f"surrogate.{choice_field}")
                if ste.kind == "none":
                    raise ContractError(f"the forward quantizes the {role}: its STE must be "
                                        "'identity' or 'clipped', not 'none'",
                                        field=f"surrogate.{ste_field}.kind")
            else:
                if choice != "not_applicable":
                    raise ContractError(
                        f"{choice_field} {choice!r} is meaningless: the forward quantizes no "
                        f"{role}; use 'not_applicable'", field=f"surrogate.{choice_field}")
                if ste.kind != "none":
                    raise ContractError(f"{ste.kind!r} STE on a {role} the forward does not "
                                        "quantize; use 'none'",
                                        field=f"surrogate.{ste_field}.kind")

    def _check_case(self) -> None:
        quantized = bool(self.visible_forward.quantize_positions)
        kind = self.backward.kind
        if self.case in ("B", "B+C") and not quantized:
            raise ContractError(f"case {self.case!r} needs a quantized forward with at least one "
                                "identity or clipped STE; quantize_positions is empty and both "
                                "STEs are 'none'", field="case")
        if self.case in ("A", "C") and quantized:
            raise ContractError(f"case {self.case!r} has no quantization, but quantize_positions "
                                "lists "
                                f"{[p.tensor for p in self.visible_forward.quantize_positions]}; "
                                f"use {'B' if self.case == 'A' else 'B+C'!r}", field="case")
        if self.case in ("C", "B+C") and kind != "glue":
            raise ContractError(f"case {self.case!r} chains operators with glue; backward.kind "
                                f"must be 'glue', got {kind!r}", field="backward.kind")
        if self.case == "B" and kind == "glue":
            raise ContractError("case 'B' reuses a packaged backward or a custom VJP; glue over "
                                "a composite is case 'B+C'", field="backward.kind")

    def _check_tolerances(self) -> None:
        variables = self.trainable.variables
        for key in self.reference.tolerances:
            if key != ANY_GRADIENT and key not in variables:
                raise ContractError(f"tolerance for {key!r}, which is not a trainable variable "
                                    f"(variables: {', '.join(variables)})",
                                    field=f"reference.tolerances.{key}")
        if ANY_GRADIENT not in self.reference.tolerances:
            missing = [v for v in variables if v not in self.reference.tolerances]
            if missing:
                raise ContractError(f"no tolerance for gradient(s) {missing}; add them or a "
                                    f"{ANY_GRADIENT!r} entry", field="reference.tolerances")

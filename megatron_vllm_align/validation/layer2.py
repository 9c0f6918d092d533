"""Layer 2 (docs/method.md#layer-2-contract-comparison): is the gradient contract reasonable? dX and dW
of every quantized linear under the default convention and under the approximation, on a fixed
checkpoint and batch.

The same upstream ``dY`` of one real forward / backward feeds the production FP8 backward twice per
projection: the default (``dx_weight="dequantized"``, ``dw_activation="dequantized"``) and the
alternative (``dx_weight="master"``, ``dw_activation="original"``). Per projection, precision
combination (``fp8_per_channel``, ``fp8_per_tensor``, ``fp8_block128``) and gradient: cosine, norm
ratio, relative L2, max abs error, feature-wise cosine median, and the three-way ``sigma_ratio`` / ``bc``
against the exact derivative of the visible forward (docs/method.md#three-way-comparison). A fixed
:class:`OutlierRule` (cosine floor 0.99, norm-ratio tolerance 0.05, 5 scaled MADs and 2x above the group
median) flags projections. :func:`convention_gradients`, :func:`convention_row` and
:func:`apply_outlier_rule` are shared with the training hook (``train.layer2``). Setup, definitions and
why a feature-wise cosine: docs/layer2_facts.md#what-the-layer-2-comparison-computes-validationlayer2py.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from megatron_vllm_align.accuracy import bhattacharyya_coefficient, sigma_ratio
from megatron_vllm_align.accuracy.three_way import bc_from_counts, histograms
from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.fp8_linear.emulated import FP8Linear, FP8LinearConfig
from megatron_vllm_align.ops.fp8_linear.vjp import fp8_linear_vjp, saved_tensor_names
from megatron_vllm_align.quant import DequantFP8Gemm, FP8Scheme, dequantize_fp8, quantize_fp8
from megatron_vllm_align.utils.quantization_names import Quantization

from .grad_metrics import EPS

#: precision label -> default contract measured under it
PRECISIONS: dict[str, str] = {
    Quantization.FP8_PER_CHANNEL.value: "fp8_linear_per_channel",  # the engine quantization of that name
    "fp8_per_tensor": "fp8_linear_per_tensor",
    "fp8_block128": "fp8_linear_block128",
}
#: module classes: the quantized projections of one decoder layer (attribute paths under the layer)
PROJECTIONS: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GRADIENTS: dict[str, str] = {"dX": "dx_weight master vs dequantized",
                             "dW": "activation_ref original vs quantized"}
NOT_MEASURED = ("NVFP4: not measured on this Hugging Face model (its projections become FP8 linears only); the "
                "training hook (train.layer2) compares master vs dequantized dX of ops.nvfp4_linear's "
                "VllmNVFP4Linear modules where a model has them.",)
MAX_SAMPLES = 50_000  # pooled elements kept per (precision, gradient) for plots and histograms
#: elements per float64 chunk of :func:`_row_figures` (2^17: 1 MiB per temporary)
CHUNK_ELEMENTS = 1 << 17


@dataclass(frozen=True)
class OutlierRule:
    """The outlier rule, fixed before measuring (module docstring)."""

    cosine_floor: float = 0.99
    norm_ratio_tol: float = 0.05
    k_mad: float = 5.0
    min_factor: float = 2.0
    group_by_class: bool = False  # True: the group is (precision, gradient, module class): a layer vs its class

    def describe(self) -> str:
        group = "precision, gradient and module class" if self.group_by_class else "precision and gradient"
        return (f"flagged when cosine or feature cosine < {self.cosine_floor}, or |norm ratio - 1| > "
                f"{self.norm_ratio_tol}, or 1 - cosine (or 1 - feature cosine) exceeds the median of its {group} "
                f"group by more than {self.k_mad} x 1.4826 MAD and is at least {self.min_factor} x that median")


@dataclass(frozen=True)
class Layer2Row:
    """One projection, one precision combination, one gradient: alternative vs reference convention."""

    precision: str
    gradient: str
    module_class: str
    layer: int
    cosine: float | None
    norm_ratio: float | None
    rel_l2: float
    max_abs_err: float
    feature_cosine_median: float
    sigma_ratio: float
    bc: float
    flagged: bool = False
    reasons: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"layers.{self.layer}.{self.module_class}"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "reasons": list(self.reasons), "name": self.name}


@dataclass(frozen=True)
class Layer2Samples:
    """Pooled, subsampled elements of one (precision, gradient) over all projections, float64:
    ``exact`` (float64 derivative of the visible forward), ``reference`` and ``alternative``."""

    exact: torch.Tensor
    reference: torch.Tensor
    alternative: torch.Tensor

    @property
    def reference_error(self) -> torch.Tensor:
        return self.reference - self.exact

    @property
    def alternative_error(self) -> torch.Tensor:
        return self.alternative - self.exact


@dataclass
class Layer2Result:
    """All rows, the rule that flagged them, what was not measured, and samples for plots."""

    rows: list[Layer2Row]
    rule: OutlierRule
    batch: str
    notes: list[str] = field(default_factory=list)
    samples: dict[tuple[str, str], Layer2Samples] = field(default_factory=dict)

    @property
    def outliers(self) -> list[Layer2Row]:
        return [r for r in self.rows if r.flagged]

    def select(self, precision: str | None = None, gradient: str | None = None,
               module_class: str | None = None) -> list[Layer2Row]:
        return [r for r in self.rows if (precision is None or r.precision == precision)
                and (gradient is None or r.gradient == gradient)
                and (module_class is None or r.module_class == module_class)]

    def class_summary(self) -> list[dict]:
        """Per (precision, gradient, module class): layer count, min / median cosine, min feature cosine,
        norm-ratio range, max rel L2, max sigma ratio, min BC, flagged count."""
        groups: dict[tuple[str, str, str], list[Layer2Row]] = {}
        for r in self.rows:
            groups.setdefault((r.precision, r.gradient, r.module_class), []).append(r)
        summary = []
        for (precision, gradient, module_class), rows in groups.items():
            cosines = [r.cosine if r.cosine is not None else 0.0 for r in rows]
            ratios = [r.norm_ratio if r.norm_ratio is not None else math.inf for r in rows]
            summary.append({
                "precision": precision, "gradient": gradient, "module_class": module_class, "layers": len(rows),
                "min_cosine": min(cosines), "median_cosine": statistics.median(cosines),
                "min_feature_cosine": min(r.feature_cosine_median for r in rows),
                "min_norm_ratio": min(ratios), "max_norm_ratio": max(ratios),
                "max_rel_l2": max(r.rel_l2 for r in rows), "max_sigma_ratio": max(r.sigma_ratio for r in rows),
                "min_bc": min(r.bc for r in rows), "flagged": sum(r.flagged for r in rows)})
        return summary

    def to_dict(self) -> dict:
        return {"rule": dataclasses.asdict(self.rule), "rule_text": self.rule.describe(), "batch": self.batch,
                "notes": list(self.notes), "rows": [r.to_dict() for r in self.rows],
                "class_summary": self.class_summary(), "outliers": [r.name + f" [{r.precision} {r.gradient}]"
                                                                    for r in self.outliers]}

    def to_markdown(self) -> str:
        lines = [f"Batch: {self.batch}", "", f"Outlier rule (fixed in advance): {self.rule.describe()}.", "",
                 "Per module class (alternative convention vs the contract's default, same dY):", "",
                 "| precision | gradient | module class | layers | min cosine | median cosine | min feature cosine "
                 "| norm ratio range | max rel L2 | max sigma ratio | min BC | flagged |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in self.class_summary():
            lines.append(f"| {s['precision']} | {s['gradient']} | {s['module_class']} | {s['layers']} | "
                         f"{s['min_cosine']:.6f} | {s['median_cosine']:.6f} | {s['min_feature_cosine']:.6f} | "
                         f"{s['min_norm_ratio']:.4f} - {s['max_norm_ratio']:.4f} | {s['max_rel_l2']:.4g} | "
                         f"{s['max_sigma_ratio']:.4g} | {s['min_bc']:.4f} | {s['flagged']} |")
        lines += ["", "Per layer:", "",
                  "| precision | gradient | projection | cosine | feature cosine | norm ratio | rel L2 | "
                  "sigma ratio | BC | flagged |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r.precision} | {r.gradient} | {r.name} | {_fmt(r.cosine, '.6f')} | "
                         f"{r.feature_cosine_median:.6f} | {_fmt(r.norm_ratio, '.4f')} | {r.rel_l2:.4g} | "
                         f"{r.sigma_ratio:.4g} | {r.bc:.4f} | {'**yes**' if r.flagged else 'no'} |")
        lines += ["", "Outlier layers:", ""]
        lines += [f"- {r.name} [{r.precision} {r.gradient}]: {'; '.join(r.reasons)}" for r in self.outliers] or \
            ["- none"]
        if self.notes:
            lines += ["", "Not measured:", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def load_checkpoint_model(checkpoint_dir: str | Path) -> nn.Module:
    """The Hugging Face causal LM in ``checkpoint_dir``, bf16, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.bfloat16)
    return model.eval()


def install_fp8_linears(model: nn.Module, config: FP8LinearConfig) -> dict[str, FP8Linear]:
    """Replace every projection of ``PROJECTIONS`` in ``model.model.layers`` by an ``FP8Linear`` with
    ``config`` that holds the same weight Parameter (bias-free projections only); returns them by
    name ``layers.<i>.<projection>``. Already-installed ones just get ``config``."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("model: expected a Hugging Face decoder with model.model.layers")
    installed = {}
    for index, layer in enumerate(layers):
        for path in PROJECTIONS:
            parent_path, attr = path.rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            linear = getattr(parent, attr)
            if not isinstance(linear, FP8Linear):
                if not isinstance(linear, nn.Linear) or linear.bias is not None:
                    raise ValueError(f"layers.{index}.{path}: expected a bias-free nn.Linear, got {linear}")
                fp8 = FP8Linear(linear.in_features, linear.out_features, bias=False, config=config,
                                dtype=linear.weight.dtype)
                fp8.weight = linear.weight
                setattr(parent, attr, fp8)
                linear = fp8
            linear.config = config
            installed[f"layers.{index}.{path}"] = linear
    return installed


def _capture(model: nn.Module, linears: dict[str, FP8Linear], input_ids: torch.Tensor
             ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(X [M, K], dY [M, N]) of every linear from one forward + next-token CE backward."""
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def hook(name):
        def forward_hook(module, args, output):
            inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])
            output.register_hook(lambda g: grads.__setitem__(name, g.detach().reshape(-1, g.shape[-1])))
        return forward_hook

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        logits = model(input_ids=input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 input_ids[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            raise ValueError(f"layer 2: the loss of the fixed batch is not finite ({loss.item()})")
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    missing = sorted(set(linears) - set(grads))
    if missing:
        raise RuntimeError(f"layer 2: no upstream gradient reached {missing}")
    return {n: (inputs[n], grads[n]) for n in linears}


#: gradient -> (the contract surrogate field it varies, the default choice, the alternative); the
#: FP8 linear's own option names for the same choices are in :data:`VJP_CHOICES`
CONVENTIONS: dict[str, tuple[str, str, str]] = {"dX": ("dx_weight", "dequantized", "master"),
                                                "dW": ("activation_ref", "quantized", "original")}
#: gradient -> (FP8 linear option, default choice, alternative choice) (``ops.fp8_linear.vjp``)
VJP_CHOICES: dict[str, tuple[str, str, str]] = {"dX": ("dx_weight", "dequantized", "master"),
                                                "dW": ("dw_activation", "dequantized", "original")}
#: the tensors :func:`convention_gradients` needs for one projection (what its forward saw)
SAVED_NAMES: tuple[str, ...] = ("weight_fp8", "weight_scale", "master_weight", "input_fp8", "input_scale", "input")


def _vjp(dy: torch.Tensor, saved: dict[str, torch.Tensor], choices: dict[str, str], gradients: Sequence[str],
         weight_scheme: FP8Scheme, activation_scheme: FP8Scheme, dtypes: tuple[torch.dtype, torch.dtype, None]
         ) -> dict[str, torch.Tensor]:
    """{gradient: value} from the project's FP8 linear backward (``fp8_linear_vjp``) under ``choices``
    (``dx_weight`` / ``dw_activation``), given the tensors the FP8 linear saves for them."""
    need_dx, need_dw = "dX" in gradients, "dW" in gradients
    names = saved_tensor_names(choices["dx_weight"], choices["dw_activation"], need_dx, need_dw)
    dx, dw, _ = fp8_linear_vjp(dy, {n: saved[n] for n in names}, weight_scheme, activation_scheme, dtypes,
                               (need_dx, need_dw, False))
    return {g: v for g, v in (("dX", dx), ("dW", dw)) if g in gradients}


def _production_values(production: Mapping[str, torch.Tensor] | None, gradients: Sequence[str],
                       expected: Mapping[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
    """The given production tensors of ``gradients`` (shape-checked against ``expected``)."""
    taken = {g: v for g, v in (production or {}).items() if g in gradients and v is not None}
    for gradient, value in taken.items():
        if tuple(value.shape) != expected[gradient]:
            raise ValueError(f"{what} {gradient} has shape {tuple(value.shape)}, expected {expected[gradient]}")
    return taken


def convention_gradients(dy: torch.Tensor, saved: dict[str, torch.Tensor], weight_scheme: FP8Scheme,
                         activation_scheme: FP8Scheme, gradients: Sequence[str] = tuple(CONVENTIONS),
                         production: Mapping[str, torch.Tensor] | None = None,
                         exact_dtype: torch.dtype = torch.float64
                         ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{gradient: (default, alternative, exact)} of one FP8 projection from the SAME upstream
    gradient ``dy`` [M, N] (the value its backward received).

    ``saved`` holds :data:`SAVED_NAMES`: the deployed FP8 weight and its scales, the master weight
    in the same row order, and the input [M, K] with its FP8 bytes and scales, as the forward saw
    them. Default and alternative are the production backward (``fp8_linear_vjp``) under the
    contract's default references and under the alternative ones (:data:`VJP_CHOICES`); exact is
    the derivative of the visible forward (``dY @ dequant(W_q)``, ``dY^T @ dequant(X_q)``, the
    dequantized values in fp32) from a GEMM in ``exact_dtype`` (float64 by default; the training
    hook asks for float32).

    ``production``: {gradient: the value the production backward already computed under the
    default references} (the training hook takes them from the step's own backward), returned as
    the default instead of being recomputed (bitwise the same value: tested)."""
    unknown = sorted(set(gradients) - set(CONVENTIONS))
    if unknown or not gradients:
        raise ValueError(f"gradients must be a non-empty subset of {list(CONVENTIONS)}, got {list(gradients)}")
    missing = sorted(set(SAVED_NAMES) - set(saved))
    if missing:
        raise ValueError(f"convention_gradients: saved lacks {missing}")
    dtypes = (saved["input"].dtype, saved["master_weight"].dtype, None)
    shapes = {"dX": tuple(saved["input"].shape), "dW": tuple(saved["master_weight"].shape)}
    default = _production_values(production, gradients, shapes, "production")
    recompute = [g for g in gradients if g not in default]
    if recompute:
        default.update(_vjp(dy, saved, {c[0]: c[1] for c in VJP_CHOICES.values()}, recompute, weight_scheme,
                            activation_scheme, dtypes))
    alternative = _vjp(dy, saved, {c[0]: c[2] for c in VJP_CHOICES.values()}, gradients, weight_scheme,
                       activation_scheme, dtypes)
    exact = {}
    if "dX" in gradients:
        exact["dX"] = dy.to(exact_dtype) @ dequantize_fp8(saved["weight_fp8"], saved["weight_scale"],
                                                          weight_scheme).to(exact_dtype)
    if "dW" in gradients:
        exact["dW"] = dy.to(exact_dtype).t() @ dequantize_fp8(saved["input_fp8"], saved["input_scale"],
                                                              activation_scheme).to(exact_dtype)
    return {g: (default[g], alternative[g], exact[g]) for g in gradients}


#: the tensors :func:`nvfp4_dx_gradients` needs (``ops.nvfp4_linear.vjp`` names; the clip mask optional)
NVFP4_SAVED_NAMES: tuple[str, ...] = ("weight_fp4", "weight_block_scale", "weight_global_scale", "master_weight")


def nvfp4_dx_gradients(dy: torch.Tensor, saved: dict[str, torch.Tensor], model_dtype: torch.dtype,
                       dtypes: tuple[torch.dtype, torch.dtype, None],
                       production: Mapping[str, torch.Tensor] | None = None,
                       exact_dtype: torch.dtype = torch.float64
                       ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{"dX": (default, alternative, exact)}`` of one NVFP4 linear (``ops.nvfp4_linear``, contract
    ``nvfp4_linear``) from the SAME ``dy``: the production backward (``nvfp4_linear_vjp``) with
    ``W_ref`` = the dequantized deployed weight (default) and with the master weight (alternative),
    both through the activation STE's pass mask ``input_clip_mask`` when ``saved`` has it; exact =
    the mask times ``dY @ W_deq`` (``W_deq`` is bitwise the forward GEMM's operand) from a GEMM in
    ``exact_dtype``. ``production`` as in :func:`convention_gradients` (dX only)."""
    from megatron_vllm_align.ops.nvfp4_linear.vjp import (
        WEIGHT_NAMES,
        dequantize_weight,
        nvfp4_linear_vjp,
    )

    missing = sorted(set(NVFP4_SAVED_NAMES) - set(saved))
    if missing:
        raise ValueError(f"nvfp4_dx_gradients: saved lacks {missing}")
    mask = {"input_clip_mask": saved["input_clip_mask"]} if "input_clip_mask" in saved else {}
    needs = (True, False, False)
    shapes = {"dX": (dy.shape[0], saved["master_weight"].shape[1])}
    default = _production_values(production, ("dX",), shapes, "production")
    if "dX" not in default:
        default["dX"] = nvfp4_linear_vjp(dy, {**{n: saved[n] for n in WEIGHT_NAMES}, **mask}, model_dtype, dtypes,
                                         needs)[0]
    alternative = nvfp4_linear_vjp(dy, {"master_weight": saved["master_weight"], **mask}, model_dtype, dtypes,
                                   needs)[0]
    exact = dy.to(exact_dtype) @ dequantize_weight(*(saved[n] for n in WEIGHT_NAMES), model_dtype).to(exact_dtype)
    if mask:
        exact = torch.where(mask["input_clip_mask"], exact, torch.zeros_like(exact))
    return {"dX": (default["dX"], alternative, exact)}


def convention_row(precision: str, gradient: str, module_class: str, layer: int, reference: torch.Tensor,
                   alternative: torch.Tensor, exact: torch.Tensor) -> Layer2Row:
    """The unflagged row of one projection and gradient: alternative vs reference (module docstring),
    every figure over every element (:func:`_row_figures`)."""
    f = _row_figures(alternative, reference, exact)
    return Layer2Row(precision=precision, gradient=gradient, module_class=module_class, layer=int(layer),
                     cosine=f.cosine, norm_ratio=f.norm_ratio, rel_l2=f.rel_l2, max_abs_err=f.max_abs_err,
                     feature_cosine_median=f.feature_cosine_median, sigma_ratio=f.sigma_ratio, bc=f.bc)


@dataclass(frozen=True)
class _Figures:
    """A row's figures (:func:`_row_figures`); sigma ratio and BC are None without an exact."""

    cosine: float | None
    norm_ratio: float | None
    rel_l2: float
    max_abs_err: float
    feature_cosine_median: float
    sigma_ratio: float | None = None
    bc: float | None = None


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, columns] (1-D: one column), detached, no copy where a view does."""
    t = t.detach()
    return t.reshape(-1, 1) if t.dim() < 2 else t.reshape(-1, t.shape[-1])


def _row_figures(grad: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor | None = None,
                 bins: int = 100) -> _Figures:
    """Every figure of ``grad`` (alternative) against ``ref`` (default) and, with ``exact``, of both
    errors ``ref - exact`` and ``grad - exact``, over every element, in chunks of about
    :data:`CHUNK_ELEMENTS` elements written into a few buffers reused by every chunk (measured
    faster than a fresh temporary per op; the ops are memory-bound, about 13 ns per element in all).

    The definitions are those of ``grad_metrics`` (cosine and norm ratio None where a norm is zero,
    rel L2 over max(||ref||, EPS)), :func:`feature_cosine_median`, ``accuracy.sigma_ratio`` (RMS
    ratio; 0/0 -> 1, x/0 -> inf) and ``accuracy.bhattacharyya_coefficient`` (``bins`` bins over the
    errors' shared [min, max], ``accuracy.histograms``); the whole-tensor sums are the per-column
    sums added up, all in float64. The errors are formed in ``exact``'s dtype when it is float32
    (the training hook's exact P, a float32 GEMM): then ``ref - P`` and ``grad - P`` are exact
    wherever ``ref`` / ``grad`` is within a factor 2 of P (Sterbenz; both approximate P to about
    1 %), elsewhere rounded by 2^-24 of themselves; their sums
    of squares use float32 cascade summation (relative error ~1e-7, tested against float64) and
    their histogram positions float32 arithmetic (a value within ~1e-7 of a bin edge may land in
    the neighbour bin). Non-finite errors: ``accuracy``'s ValueError naming them."""
    if grad.shape != ref.shape or (exact is not None and exact.shape != ref.shape):
        raise ValueError(f"shape {tuple(grad.shape)} vs reference {tuple(ref.shape)}"
                         + ("" if exact is None else f" vs exact {tuple(exact.shape)}"))
    g2, r2 = _as_2d(grad), _as_2d(ref)
    e2 = None if exact is None else _as_2d(exact)
    rows, cols = g2.shape
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    chunk = min(rows, step) * cols
    gr, gg, rr = (torch.zeros(cols, dtype=torch.float64) for _ in range(3))
    dd, max_abs = torch.zeros((), dtype=torch.float64), 0.0
    wide = torch.empty(3, chunk, dtype=torch.float64)   # g, r, scratch
    if e2 is not None:
        error_dtype = torch.float32 if e2.dtype == torch.float32 else torch.float64
        narrow = torch.empty(2, chunk, dtype=error_dtype)   # scratch for the errors' squares
        errors = torch.empty(2, rows * cols, dtype=error_dtype)   # (reference, alternative) errors
        squares = [0.0, 0.0]
    for start in range(0, rows, step):
        n = min(step, rows - start) * cols
        shape = (n // cols, cols)
        g, r, scratch = (b[:n].view(shape) for b in wide)
        g.copy_(g2[start:start + step])
        r.copy_(r2[start:start + step])
        gr += torch.mul(g, r, out=scratch).sum(dim=0)
        gg += torch.mul(g, g, out=scratch).sum(dim=0)
        rr += torch.mul(r, r, out=scratch).sum(dim=0)
        flat = torch.sub(g, r, out=scratch).reshape(-1)
        dd += torch.dot(flat, flat)
        if n:
            low_diff, high_diff = torch.aminmax(flat)
            max_abs = max(max_abs, -float(low_diff), float(high_diff))
        if e2 is not None:
            e = e2[start:start + step]
            for i, values in enumerate((r2, g2)):
                destination = errors[i, start * cols:start * cols + n].view(shape)
                error = torch.sub(values[start:start + step], e, out=destination)
                squares[i] += float(torch.mul(error, error, out=narrow[i, :n].view(shape)).sum())
    g_norm, r_norm = math.sqrt(float(gg.sum())), math.sqrt(float(rr.sum()))
    both = g_norm > 0 and r_norm > 0
    norms = (gg * rr).sqrt()
    cos = torch.where(norms > 0, gr / norms, 0.0)[(gg + rr) > 0]   # zero on exactly one side: 0; both: skipped
    figures = _Figures(cosine=float(gr.sum()) / (g_norm * r_norm) if both else None,
                       norm_ratio=g_norm / r_norm if r_norm > 0 else None,
                       rel_l2=math.sqrt(float(dd)) / max(r_norm, EPS), max_abs_err=max_abs,
                       feature_cosine_median=float(cos.median()) if cos.numel() else 1.0)
    if e2 is None:
        return figures
    ref_ss, alt_ss = squares
    if not (math.isfinite(ref_ss) and math.isfinite(alt_ss)) or not errors.numel():
        # accuracy's own checks name the non-finite values (or the empty tensor)
        ref_errors, alt_errors = (ref.double() - exact.double()), (grad.double() - exact.double())
        return dataclasses.replace(figures, sigma_ratio=sigma_ratio(ref_errors, alt_errors),
                                   bc=bhattacharyya_coefficient(ref_errors, alt_errors, bins))
    sigma = math.sqrt(alt_ss / ref_ss) if ref_ss > 0 else (1.0 if alt_ss == 0 else math.inf)
    low, high = (float(v) for v in torch.aminmax(errors))
    if low == high:
        return dataclasses.replace(figures, sigma_ratio=sigma, bc=1.0)
    counts = histograms(errors, bins, low, high, overwrite=True)
    return dataclasses.replace(figures, sigma_ratio=sigma, bc=bc_from_counts(counts[0], counts[1]))


def feature_cosine_median(grad: torch.Tensor, ref: torch.Tensor) -> float:
    """Median over columns k of cos(grad[:, k], ref[:, k]) in float64; a column zero on exactly one
    side counts as 0, zero on both sides is skipped (1.0 when every column is zero on both)."""
    return _row_figures(grad, ref).feature_cosine_median


def _subsample(values: list[torch.Tensor]) -> torch.Tensor:
    """All elements pooled, or ``MAX_SAMPLES`` of them at evenly spaced positions."""
    pooled = torch.cat([v.double().flatten() for v in values])
    if pooled.numel() <= MAX_SAMPLES:
        return pooled
    return pooled[torch.linspace(0, pooled.numel() - 1, MAX_SAMPLES).long()]


def apply_outlier_rule(rows: Sequence[Layer2Row], rule: OutlierRule) -> list[Layer2Row]:
    """``rows`` with ``flagged`` / ``reasons`` set by ``rule`` within each (precision, gradient) group
    (with ``rule.group_by_class``: each (precision, gradient, module class) group)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, r in enumerate(rows):
        key = (r.precision, r.gradient, r.module_class) if rule.group_by_class else (r.precision, r.gradient)
        groups.setdefault(key, []).append(i)
    reasons: list[list[str]] = [[] for _ in rows]
    for members in groups.values():
        for label, value in (("cosine", lambda r: r.cosine if r.cosine is not None else 0.0),
                             ("feature cosine", lambda r: r.feature_cosine_median)):
            errors = [1.0 - value(rows[i]) for i in members]
            median = statistics.median(errors)
            mad = 1.4826 * statistics.median(abs(e - median) for e in errors)
            for i, err in zip(members, errors):
                if value(rows[i]) < rule.cosine_floor:
                    reasons[i].append(f"{label} {value(rows[i]):.6f} < floor {rule.cosine_floor}")
                elif err > median + rule.k_mad * mad and err >= rule.min_factor * median:
                    reasons[i].append(f"1 - {label} = {err:.3g} > group median {median:.3g} + "
                                      f"{rule.k_mad} x MAD {mad:.3g}")
        for i in members:
            ratio = rows[i].norm_ratio
            if ratio is None or abs(ratio - 1.0) > rule.norm_ratio_tol:
                reasons[i].append(f"norm ratio {_fmt(ratio, '.4f')} outside 1 +- {rule.norm_ratio_tol}")
    return [dataclasses.replace(r, flagged=bool(why), reasons=tuple(why)) for r, why in zip(rows, reasons)]


def measure_precision(model: nn.Module, precision: str, input_ids: torch.Tensor,
                      native_forward: bool = False
                      ) -> tuple[list[Layer2Row], dict[tuple[str, str], Layer2Samples]]:
    """Unflagged rows and pooled samples of one precision combination (module docstring).
    ``native_forward``: the forward GEMM is ``quant.DequantFP8Gemm`` instead of the contract's."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    config = FP8LinearConfig.from_contract(get_default_contract(PRECISIONS[precision]))
    if native_forward:
        config = dataclasses.replace(config, visible_gemm=DequantFP8Gemm(config.activation_scheme,
                                                                         config.weight_scheme))
    reference = dataclasses.replace(config, dx_weight="dequantized", dw_activation="dequantized")
    linears = install_fp8_linears(model, reference)
    captured = _capture(model, linears, input_ids)
    rows: list[Layer2Row] = []
    pools: dict[str, tuple[list, list, list]] = {g: ([], [], []) for g in GRADIENTS}
    for name, (x, dy) in captured.items():
        weight = linears[name].weight.detach()
        w_q, w_scale = quantize_fp8(weight, config.weight_scheme, config.weight_scale)
        x_q, x_scale = quantize_fp8(x, config.activation_scheme, config.activation_scale)
        saved = {"weight_fp8": w_q, "weight_scale": w_scale, "master_weight": weight,
                 "input_fp8": x_q, "input_scale": x_scale, "input": x}
        _, layer, module_class = name.split(".", 2)
        values = convention_gradients(dy, saved, config.weight_scheme, config.activation_scheme, tuple(GRADIENTS))
        for gradient, (ref, alt, exact) in values.items():
            rows.append(convention_row(precision, gradient, module_class, int(layer), ref, alt, exact))
            for pool, value in zip(pools[gradient], (exact, ref, alt)):
                pool.append(value)
    samples = {(precision, g): Layer2Samples(*(_subsample(p) for p in pools[g])) for g in GRADIENTS}
    return rows, samples


def fixed_batch(vocab_size: int, batch: int = 4, tokens: int = 32, seed: int = 0) -> torch.Tensor:
    """The fixed token batch [batch, tokens] (uniform random ids from ``seed``)."""
    return torch.randint(0, vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def run_layer2(model: nn.Module, input_ids: torch.Tensor, precisions: Sequence[str] = tuple(PRECISIONS),
               rule: OutlierRule = OutlierRule(), native_forward: bool = False) -> Layer2Result:
    """Layer 2 over ``precisions`` on ``model`` (a Hugging Face decoder, modified in place: its
    projections become ``FP8Linear``) and the fixed batch ``input_ids`` [B, T].

    ``native_forward=True`` runs the forward through ``quant.DequantFP8Gemm`` instead of each
    contract's GEMM (the forward only produces X and dY; the conventions differ in the backward).
    vLLM's CPU FP8 GEMM takes seconds per call on CPUs without AMX, so quick runs use it."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be a [batch, tokens >= 2] tensor, got {getattr(input_ids, 'shape', None)}")
    rows: list[Layer2Row] = []
    samples: dict[tuple[str, str], Layer2Samples] = {}
    for precision in precisions:
        precision_rows, precision_samples = measure_precision(model, precision, input_ids, native_forward)
        rows += precision_rows
        samples.update(precision_samples)
    batch = (f"{input_ids.shape[0]} sequences x {input_ids.shape[1]} tokens; loss = next-token cross-entropy; "
             "dY of every projection from one backward under the default contract, the same dY for both "
             "conventions")
    return Layer2Result(rows=apply_outlier_rule(rows, rule), rule=rule, batch=batch, notes=list(NOT_MEASURED),
                        samples=samples)

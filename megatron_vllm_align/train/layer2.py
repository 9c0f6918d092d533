"""Layer 2 (seed 000) as a recipe hook: the gradient contract's default convention against the
alternative, on the trained model's own FP8 linears and the step's own batch (recipe ``layer2``).

Every ``layer2.every`` optimizer steps, on rank 0 only:

1. **capture** (:meth:`Layer2Hook.capture`, around the step's forward and backward): a forward hook
   on every ``VllmMegatronFP8Linear`` / ``VllmMegatronFP8QKVLinear`` copies its input X [M, K], the
   deployed FP8 weight with its per-channel scales and the master weight in the same (vLLM) row
   order, and a tensor hook on its output copies the dY [M, N] the real backward delivers. The
   hooks return nothing, so no value of the forward, the backward or the gradients changes; they
   are removed when the step's backward is done, and other steps run without them.
2. **measure** (:meth:`Layer2Hook.measure`, after the optimizer step, outside the step's timing):
   from the SAME dY, the project's FP8 backward (``ops.fp8_linear.vjp``) under the contract's
   default (dX from the dequantized FP8 weight, dW from the dequantized FP8 input; bitwise the
   production backward, tested) and under the alternative (``layer2.conventions``: dX from the
   master weight, dW from the original input), and the float64 exact derivative of the visible
   forward; the figures and the outlier rule are ``validation.layer2``'s (cosine, feature cosine,
   norm ratio, rel L2, sigma ratio, BC, flagged), the rule's constants the recipe's.
3. **publish** (:meth:`Layer2Hook.publish`): TensorBoard panels per module class and layer over
   optimizer steps (``layer2_train.*`` in docs/panels.md), ``<run_dir>/layer2.md`` (one section
   per measured step, rewritten atomically) and one warning line per flagged layer on the console.

NVFP4 linears (``ops.nvfp4_linear.VllmNVFP4Linear``, W4A4, clipped activation STE) inside a
model's decoder layers are measured too, dX only (``dx_weight``: master vs dequantized deployed
weight, precision ``nvfp4``); the Megatron vLLM spec builds none (the CPU engine does not serve
NVFP4), so on a recipe's model the hook sees the FP8 linears alone.

The batch is rank 0's data-parallel share of the step's global batch (the dY it received: the
gradient of the global mean loss with respect to its activations). Identity vs clipped STE is not
compared: the ``fp8_linear_per_channel`` contract allows only the identity STE (its amax scales
never saturate), and the recipe refuses ``ste``. Cost on a measured step: one copy of the FP8
linears' weights (bf16 and FP8), of their inputs and of their dY, then per linear four backward
GEMMs, two float64 ones and float64 metric passes (``benchmarks/layer2_overhead.py``: about 1.1-4
plain steps per measured step at tiny widths, ratio 1.13 at ``every: 10``).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.megatron.vllm_linear import VllmMegatronFP8Linear
from megatron_vllm_align.ops.fp8_linear.kernel import FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME
from megatron_vllm_align.train.config import LAYER2_CONVENTIONS, Layer2Section
from megatron_vllm_align.utils.atomic_io import atomic_write_text
from megatron_vllm_align.validation.layer2 import (
    Layer2Result,
    Layer2Row,
    OutlierRule,
    apply_outlier_rule,
    convention_gradients,
    convention_row,
    nvfp4_dx_gradients,
)

PRECISION = "fp8_per_channel"
NVFP4_PRECISION = "nvfp4"
CONTRACT = "fp8_linear_per_channel"
CONTRACTS = {"fp8": CONTRACT, "nvfp4": "nvfp4_linear"}
NOTES = ("identity vs clipped STE: not compared; the fp8_linear_per_channel contract allows only the identity STE "
         "(per-token / per-channel amax scales never saturate, so a clipped STE would clip nothing)",
         "NVFP4: no NVFP4 linear in the trained model (the CPU engine does not serve NVFP4; align.quantization "
         "has no NVFP4 choice)")
NVFP4_NOTE = ("NVFP4 linears: dX from the master weight vs the dequantized deployed weight only (both through the "
              "contract's clipped activation STE); their dW conventions are not compared")


@dataclass
class _Call:
    """One forward call of one quantized linear on a measured step: its input, master weight (deployed
    row order) and deployed weight tensors (FP8: ``weight_fp8``, ``weight_scale``; NVFP4: the three
    of ``ops.nvfp4_linear.vjp.WEIGHT_NAMES``), and the dY its output received."""

    x: torch.Tensor
    master_weight: torch.Tensor
    deployed: dict[str, torch.Tensor]
    dy: torch.Tensor | None = None


@dataclass
class LinearCapture:
    """What one quantized linear's forward saw and its backward received on one step: ``saved`` holds
    what its backward's references are rebuilt from (FP8: ``validation.layer2.SAVED_NAMES``, master
    weight in the deployed row order; NVFP4: ``NVFP4_SAVED_NAMES`` and the clip mask), ``dy`` [M, N];
    ``kind`` is ``"fp8"`` or ``"nvfp4"``."""

    name: str
    module_class: str
    layer: int
    saved: dict[str, torch.Tensor]
    dy: torch.Tensor
    kind: str = "fp8"


@dataclass
class _Linear:
    module: nn.Module
    module_class: str
    layer: int
    kind: str  # "fp8" (VllmMegatronFP8Linear and its QKV form) or "nvfp4" (ops.nvfp4_linear.VllmNVFP4Linear)


def quantized_linears(model: nn.Module) -> dict[str, _Linear]:
    """The model's FP8 and NVFP4 linears by name (``...layers.<i>.<...>.<class>``), in model order."""
    from megatron_vllm_align.ops.nvfp4_linear.module import VllmNVFP4Linear

    found = {}
    for name, module in model.named_modules():
        kind = "fp8" if isinstance(module, VllmMegatronFP8Linear) else \
            "nvfp4" if isinstance(module, VllmNVFP4Linear) else None
        if kind is None:
            continue
        parts = name.split(".")
        if "layers" not in parts[:-1] or not parts[parts.index("layers") + 1].isdigit():
            raise ValueError(f"layer2: quantized linear {name!r} is not inside a decoder layer (layers.<i>)")
        found[name] = _Linear(module, parts[-1], int(parts[parts.index("layers") + 1]), kind)
    return found


def _console(line: str) -> None:
    """A line on the console above rank 0's progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)


@dataclass
class Layer2Hook:
    """The recipe's ``layer2`` section on ``model`` (module docstring). ``active``: this rank
    measures (rank 0); elsewhere :meth:`capture` and :meth:`after_step` do nothing."""

    model: nn.Module
    section: Layer2Section
    run_dir: Path
    active: bool = True
    console: Callable[[str], None] = _console
    results: list[tuple[int, Layer2Result]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.linears = quantized_linears(self.model)
        if not self.linears:
            raise ValueError("layer2: the model has no FP8 or NVFP4 linear (VllmMegatronFP8Linear, VllmNVFP4Linear); "
                             "build it with align.enabled: true and align.quantization: fp8_per_channel")
        self.gradients = tuple(LAYER2_CONVENTIONS[c] for c in self.section.conventions)
        self.rule = OutlierRule(cosine_floor=self.section.cosine_floor, norm_ratio_tol=self.section.norm_ratio_tol,
                                k_mad=self.section.k_mad, min_factor=self.section.min_factor,
                                group_by_class=self.section.group_by_class)
        self._calls: dict[str, list[_Call]] = {}
        self._sections: list[str] = []

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is measured on this rank."""
        return self.active and step % self.section.every == 0

    def _forward_hook(self, name: str, linear: _Linear) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not (torch.is_grad_enabled() and out.requires_grad):
                return
            x = args[0]
            with torch.no_grad():
                if linear.kind == "fp8":
                    master = linear.module._deployed_operands()[0]
                    deployed = dict(zip(("weight_fp8", "weight_scale"), linear.module.kernel.fp8_weight()))
                else:
                    from megatron_vllm_align.ops.nvfp4_linear.vjp import WEIGHT_NAMES

                    master = linear.module.weight
                    deployed = dict(zip(WEIGHT_NAMES, linear.module.kernel.deployed_weight()))
                call = _Call(x=x.detach().reshape(-1, x.shape[-1]).clone(), master_weight=master.detach().clone(),
                             deployed={n: t.clone() for n, t in deployed.items()})
            self._calls.setdefault(name, []).append(call)

            def keep_dy(grad: torch.Tensor) -> None:
                call.dy = grad.detach().reshape(-1, grad.shape[-1]).clone()

            out.register_hook(keep_dy)
        return hook

    @contextlib.contextmanager
    def capture(self, step: int) -> Iterator[None]:
        """Around one optimizer step's forward and backward: the hooks of the module docstring when
        the step is due (:meth:`due`), nothing otherwise."""
        if not self.due(step):
            yield
            return
        self._calls = {}
        handles = [linear.module.register_forward_hook(self._forward_hook(name, linear))
                   for name, linear in self.linears.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def take_captures(self) -> list[LinearCapture]:
        """The captured tensors of the last :meth:`capture` (calls of one linear joined along the
        token rows), emptied; RuntimeError naming a linear that no dY reached. The input's quantized
        form (FP8) or the STE's clip mask (NVFP4) is rebuilt here with the module's own quantizer /
        fixed input scale, as its forward did."""
        calls, self._calls = self._calls, {}
        captures = []
        for name, linear in self.linears.items():
            reached = [c for c in calls.get(name, []) if c.dy is not None]
            if not reached:
                raise RuntimeError(f"layer2: no upstream gradient reached {name} in the step's backward")
            x = torch.cat([c.x for c in reached])
            saved = {"input": x, "master_weight": reached[0].master_weight, **reached[0].deployed}
            if linear.kind == "fp8":
                saved["input_fp8"], saved["input_scale"] = linear.module.kernel.quantize_activation(x)
            elif linear.module.activation_ste.kind == "clipped":
                from megatron_vllm_align.quant.ste import ste_pass_mask

                saved["input_clip_mask"] = ste_pass_mask(linear.module.activation_ste, x,
                                                         linear.module.kernel.input_scale())
            captures.append(LinearCapture(name, linear.module_class, linear.layer, saved,
                                          torch.cat([c.dy for c in reached]), linear.kind))
        return captures

    def measure(self, step: int, captures: list[LinearCapture], batch: str = "") -> Layer2Result:
        """The step's :class:`Layer2Result`: one row per linear and gradient, flagged by the rule. NVFP4
        linears give their ``dx_weight`` (dX) rows only, under precision ``nvfp4``."""
        rows: list[Layer2Row] = []
        for c in captures:
            if c.kind == "fp8":
                precision = PRECISION
                values = convention_gradients(c.dy, c.saved, FP8_WEIGHT_SCHEME, FP8_ACTIVATION_SCHEME,
                                              self.gradients)
            elif "dX" in self.gradients:
                precision = NVFP4_PRECISION
                module = self.linears[c.name].module
                values = nvfp4_dx_gradients(c.dy, c.saved, module.kernel.context.model_dtype,
                                            (c.saved["input"].dtype, c.saved["master_weight"].dtype, None))
            else:
                continue
            rows += [convention_row(precision, gradient, c.module_class, c.layer, ref, alt, exact)
                     for gradient, (ref, alt, exact) in values.items()]
        tokens = captures[0].dy.shape[0] if captures else 0
        kinds = sorted({c.kind for c in captures})
        contracts = ", ".join(CONTRACTS[k] for k in kinds)
        text = (f"optimizer step {step}: {batch or 'the step batch'} ({tokens} tokens); dY of every quantized linear "
                "from the step's own backward, the same dY for both conventions; contract "
                f"{contracts}, conventions {', '.join(self.section.conventions)}")
        notes = list(NOTES) if "nvfp4" not in kinds else [NOTES[0], NVFP4_NOTE]
        return Layer2Result(rows=apply_outlier_rule(rows, self.rule), rule=self.rule, batch=text, notes=notes)

    def publish(self, step: int, result: Layer2Result, writer: Any = None) -> None:
        """TensorBoard (``writer``: a ``logging.PanelWriter`` or None), ``layer2.md``, console warnings."""
        self.results.append((step, result))
        markdown = result.to_markdown()
        self._sections.append(f"## Step {step}\n\n{markdown}")
        if writer is not None:
            writer.write_layer2_step(result, step, markdown)
        head = ("# Layer 2 during training\n\n"
                f"Recipe: layer2.every = {self.section.every}, conventions = {', '.join(self.section.conventions)}; "
                f"precision {PRECISION} (contract `{CONTRACT}`); rank 0's share of each measured step's batch.\n\n")
        atomic_write_text(self.run_dir / "layer2.md", head + "\n".join(self._sections), what="layer-2 report")
        for r in result.outliers:
            self.console(f"layer2 WARNING: step {step}: {r.module_class} layer {r.layer} flagged "
                         f"[{r.precision} {r.gradient}]: {'; '.join(r.reasons)}")

    def after_step(self, step: int, writer: Any = None, batch: str = "") -> Layer2Result | None:
        """:meth:`take_captures`, :meth:`measure` and :meth:`publish` when the step was due."""
        if not self.due(step):
            return None
        result = self.measure(step, self.take_captures(), batch)
        self.publish(step, result, writer)
        return result

    def to_json(self) -> list[dict]:
        """Every measured step's result as plain data (``metrics.json`` key ``layer2``)."""
        return [{"step": step, **result.to_dict()} for step, result in self.results]

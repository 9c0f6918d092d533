"""Layer 2 (docs/method.md#layer-2-contract-comparison) as a recipe hook: the gradient contract's default
convention against the alternative, on the trained model's own FP8 linears and the step's own batch
(recipe ``layer2``), every ``layer2.every`` optimizer steps, over the whole step batch and the whole layers: every
rank captures and measures its share, and each gradient is assembled on rank 0 (:func:`whole_gradient`), where
the figures are computed and published.

:meth:`Layer2Hook.capture` keeps, without copying, each FP8 linear's input X [M, K], master weight
(deployed row order), saved tensors and the real backward's dY [M, N], dX and dW; the step is unchanged
(tested bitwise) and a kept tensor changed in place is refused. :meth:`Layer2Hook.measure` (between
backward and optimizer step, outside ``tokens_per_s``) reuses the production dX, dW as the default,
runs ``ops.fp8_linear.vjp`` on the same dY for the alternative (``layer2.conventions``) and one float32
GEMM per gradient for the exact derivative; figures and outlier rule are ``validation.layer2``'s, over
every element. :meth:`Layer2Hook.publish` writes ``layer2_train.*`` panels (docs/panels.md),
``<run_dir>/layer2.md`` (atomically) and one console warning per flagged layer. ``VllmNVFP4Linear``
modules are measured for dX only; identity against clipped STE is not compared (the recipe refuses
``ste``). Why float32 and no sampling, measured: docs/layer2_facts.md; cost: docs/benchmarks.md.
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
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8LinearFunction
from megatron_vllm_align.train.config import LAYER2_CONVENTIONS, Layer2Section
from megatron_vllm_align.utils.atomic_io import atomic_write_text
from megatron_vllm_align.utils.quantization_names import Quantization
from megatron_vllm_align.validation.layer2 import (
    Layer2Result,
    Layer2Row,
    OutlierRule,
    apply_outlier_rule,
    convention_gradients,
    convention_row,
    nvfp4_dx_gradients,
)

PRECISION = Quantization.FP8_PER_CHANNEL.value
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
    """One forward call of one quantized linear on a measured step, nothing copied: its input, master
    weight (deployed row order) and deployed weight tensors (FP8: ``weight_fp8``, ``weight_scale``;
    NVFP4: the three of ``ops.nvfp4_linear.vjp.WEIGHT_NAMES``; a refresh builds new ones), what its
    Function saved of the input, the version counters of the input and the weight parameter (so
    that an in-place change before the measure is caught), and what the step's backward gave its
    autograd node: the dY it received and the dX and dW it returned (None where not computed)."""

    x: torch.Tensor
    master_weight: torch.Tensor
    deployed: dict[str, torch.Tensor]
    versions: tuple[int, int]   # of x and of the module's weight parameter at the forward
    input_saved: dict[str, torch.Tensor] = field(default_factory=dict)
    dy: torch.Tensor | None = None
    dx: torch.Tensor | None = None
    dw: torch.Tensor | None = None


@dataclass
class LinearCapture:
    """What one quantized linear's forward saw and its backward received on one step: ``saved`` holds
    what its backward's references are rebuilt from (FP8: ``validation.layer2.SAVED_NAMES``, master
    weight in the deployed row order; NVFP4: ``NVFP4_SAVED_NAMES`` and the clip mask), ``dy`` [M, N];
    ``kind`` is ``"fp8"`` or ``"nvfp4"``; ``production``: {gradient: the value the step's own
    backward computed} (``"dX"``, ``"dW"``; NVFP4 ``"dX"`` only) where that is the contract's default
    convention (module docstring), else empty and the default is recomputed."""

    name: str
    module_class: str
    layer: int
    saved: dict[str, torch.Tensor]
    dy: torch.Tensor
    kind: str = "fp8"
    production: dict[str, torch.Tensor] = field(default_factory=dict)


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


FP8_WEIGHT_NAMES = ("weight_fp8", "weight_scale")
#: kind -> what the measure needs of the input, as the linear's Function saves it for its backward
#: (FP8: the input's FP8 bytes and per-token scales; NVFP4: the clipped STE's pass mask, when clipped)
INPUT_NAMES: dict[str, tuple[str, ...]] = {"fp8": ("input_fp8", "input_scale"), "nvfp4": ("input_clip_mask",)}
#: the dtype of the exact derivative's GEMM (module docstring: why float32 suffices)
EXACT_DTYPE = torch.float32
#: (dx_weight, dw_activation) of the contract's default convention, both FP8 and NVFP4
DEFAULT_REFERENCES = ("dequantized", "dequantized")


def _backward_node_type(kind: str) -> type:
    """The autograd node class of the Function a ``kind`` linear applies (the node the capture hooks)."""
    if kind == "fp8":
        return VllmFP8LinearFunction._backward_cls
    from megatron_vllm_align.ops.nvfp4_linear.module import VllmNVFP4LinearFunction

    return VllmNVFP4LinearFunction._backward_cls


def _function_node(out: torch.Tensor, node_type: type, name: str, depth: int = 4) -> Any:
    """The autograd node of type ``node_type`` (the linear's Function) behind ``out``, the module's
    output (a reshape of the Function's), searched ``depth`` nodes deep; RuntimeError naming the
    linear when it is not there."""
    frontier = [out.grad_fn]
    for _ in range(depth):
        for node in frontier:
            if isinstance(node, node_type):
                return node
        frontier = [nxt for node in frontier if node is not None for nxt, _ in node.next_functions]
    raise RuntimeError(f"layer2: no {node_type.__name__} node behind the output of {name}")


def _console(line: str) -> None:
    """A line on the console above rank 0's progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)


def whole_gradient(gradient: str, tensor: torch.Tensor, shard: Any, data_parallel_group: Any) -> torch.Tensor | None:
    """One linear's ``gradient`` (``"dX"`` [M, K] or ``"dW"`` [N, K]) as this rank computed it (its tokens, its
    tensor-parallel shard), assembled over the whole layer and the whole step batch on rank 0 (None elsewhere).
    Over the tensor-parallel ``shard`` (``TensorParallelShard``; None: unsharded): a column-parallel dX is a
    partial sum (summed), a column-parallel dW holds rows [N / T, K] (joined along dim 0), a row-parallel dX and dW
    hold input columns [., K / T] (joined along the last dim); the rows' order (e.g. QKV's per-rank heads) is
    not the TP 1 layer's, which no figure depends on. Then over ``data_parallel_group``: dX rows are the ranks'
    tokens (joined), dW the sum the trainer's all-reduce makes. Collective over both groups."""
    from megatron_vllm_align.train.distributed import gather_to_first, sum_to_first

    if shard is not None and shard.world_size > 1:
        if gradient == "dX" and shard.mode == "column":
            tensor = sum_to_first(tensor, shard.group)
        else:
            tensor = gather_to_first(tensor, 0 if shard.mode == "column" else -1, shard.group)
        if tensor is None:
            return None
    return gather_to_first(tensor, 0, data_parallel_group) if gradient == "dX" else \
        sum_to_first(tensor, data_parallel_group)


@dataclass
class Layer2Hook:
    """The recipe's ``layer2`` section on ``model`` (module docstring). Every rank of the run holds one and
    calls :meth:`capture` and :meth:`after_step` on every step (collective on measured steps); ``is_main``:
    the rank that computes the figures and publishes them (rank 0); ``data_parallel_group``: the groups
    over which the step batch is split (None: one replica)."""

    model: nn.Module
    section: Layer2Section
    run_dir: Path
    is_main: bool = True
    data_parallel_group: Any = None
    console: Callable[[str], None] = _console
    results: list[tuple[int, Layer2Result]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.linears = quantized_linears(self.model)
        if not self.linears:
            raise ValueError("layer2: the model has no FP8 or NVFP4 linear (VllmMegatronFP8Linear, VllmNVFP4Linear); "
                             "build it with align.enabled: true and align.quantization: "
                             f"{Quantization.FP8_PER_CHANNEL}")
        self.gradients = tuple(LAYER2_CONVENTIONS[c] for c in self.section.conventions)
        self.rule = OutlierRule(cosine_floor=self.section.cosine_floor, norm_ratio_tol=self.section.norm_ratio_tol,
                                k_mad=self.section.k_mad, min_factor=self.section.min_factor,
                                group_by_class=self.section.group_by_class)
        self._calls: dict[str, list[_Call]] = {}
        self._sections: list[str] = []

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is measured."""
        return step % self.section.every == 0

    def _forward_hook(self, name: str, linear: _Linear) -> Callable[..., None]:
        backward_node = _backward_node_type(linear.kind)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not (torch.is_grad_enabled() and out.requires_grad):
                return
            node = _function_node(out, backward_node, name)
            # What the Function saved for its backward, under the contract's names (the node is its ctx)
            from_node = dict(zip(getattr(node, "saved_names", ()), node.saved_tensors))
            x = args[0]
            with torch.no_grad():
                if linear.kind == "fp8":
                    master = linear.module._deployed_operands()[0].detach()
                    names, deployed_weight = FP8_WEIGHT_NAMES, linear.module.kernel.fp8_weight
                else:
                    from megatron_vllm_align.ops.nvfp4_linear.vjp import WEIGHT_NAMES

                    master = linear.module.weight.detach()
                    names, deployed_weight = WEIGHT_NAMES, linear.module.kernel.deployed_weight
                deployed = {n: from_node[n] for n in names} if set(names) <= set(from_node) else \
                    dict(zip(names, deployed_weight()))
            # No copies: x, the master weight (the parameter itself, or QKV's fresh row gather) and the
            # deployed tensors stay as they are until measured, before the optimizer step (version-checked)
            call = _Call(x=x.detach().reshape(-1, x.shape[-1]), master_weight=master, deployed=deployed,
                         versions=(x._version, linear.module.weight._version),
                         input_saved={n: from_node[n] for n in INPUT_NAMES[linear.kind] if n in from_node})
            self._calls.setdefault(name, []).append(call)

            shard = getattr(linear.module, "tp_shard", None)
            # a column-parallel linear's dX at TP > 1 is a partial sum that Megatron's all-reduce then
            # overwrites in place with the whole: the one tensor kept as a copy
            copy_dx = shard is not None and shard.mode == "column" and shard.world_size > 1

            def keep(grad_inputs: tuple, grad_outputs: tuple) -> None:
                # Node post-hook: the gradients the production backward returned for (x, weight, ...) and
                # the dY it received; nothing is returned, so no value changes.
                call.dy = grad_outputs[0]
                dx = grad_inputs[0]
                call.dx, call.dw = dx.clone() if copy_dx and dx is not None else dx, grad_inputs[1]

            node.register_hook(keep)
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
        token rows), emptied; RuntimeError naming a linear that no dY reached or whose input was
        modified in place after its forward. The deployed weight, the input's quantized form (FP8)
        and the STE's clip mask (NVFP4) are the tensors the linear's Function saved for its backward;
        where it saved none (other reference choices, an input without gradient) they are rebuilt
        with the module's own kernel, quantizer and fixed input scale, as its forward did. The
        production gradients are kept where one call of the linear reached the backward and the
        module runs the contract's default references."""
        calls, self._calls = self._calls, {}
        captures = []
        for name, linear in self.linears.items():
            reached = [c for c in calls.get(name, []) if c.dy is not None]
            if not reached:
                raise RuntimeError(f"layer2: no upstream gradient reached {name} in the step's backward")
            if any(c.x._version != c.versions[0] for c in reached):
                raise RuntimeError(f"layer2: the input of {name} was modified in place after its forward; the "
                                   "hook keeps it without a copy and cannot measure this step")
            if any(linear.module.weight._version != c.versions[1] for c in reached):
                raise RuntimeError(f"layer2: the weight of {name} changed since the step's forward: take the "
                                   "captures (after_step) before the optimizer step")
            x = reached[0].x if len(reached) == 1 else torch.cat([c.x for c in reached])
            dy = reached[0].dy if len(reached) == 1 else torch.cat([c.dy for c in reached])
            saved = {"input": x, "master_weight": reached[0].master_weight, **reached[0].deployed}
            input_names = INPUT_NAMES[linear.kind]
            if all(set(input_names) <= set(c.input_saved) for c in reached):
                # per-token FP8 scales and the STE mask are row-wise: the calls' rows join as the tokens do
                saved.update({n: reached[0].input_saved[n] if len(reached) == 1 else
                              torch.cat([c.input_saved[n] for c in reached]) for n in input_names})
            elif linear.kind == "fp8":
                saved["input_fp8"], saved["input_scale"] = linear.module.kernel.quantize_activation(x)
            elif linear.module.activation_ste.kind == "clipped":
                from megatron_vllm_align.quant.ste import ste_pass_mask

                saved["input_clip_mask"] = ste_pass_mask(linear.module.activation_ste, x,
                                                         linear.module.kernel.input_scale())
            production = {}
            if len(reached) == 1 and (linear.module.dx_weight, linear.module.dw_activation) == DEFAULT_REFERENCES:
                production = {g: v for g, v in (("dX", reached[0].dx), ("dW", reached[0].dw))
                              if v is not None and (linear.kind == "fp8" or g == "dX")}
            captures.append(LinearCapture(name, linear.module_class, linear.layer, saved, dy, linear.kind,
                                          production))
        return captures

    def measure(self, step: int, captures: list[LinearCapture], batch: str = "") -> Layer2Result | None:
        """The step's :class:`Layer2Result` on the main rank (None elsewhere): one row per linear and
        gradient over the whole layer and step batch (:func:`whole_gradient`), flagged by the rule. NVFP4
        linears give their ``dx_weight`` (dX) rows only, under precision ``nvfp4``. Collective."""
        from megatron_vllm_align.train.distributed import sum_to_first

        rows: list[Layer2Row] = []
        for c in captures:
            if c.kind == "fp8":
                precision = PRECISION
                values = convention_gradients(c.dy, c.saved, FP8_WEIGHT_SCHEME, FP8_ACTIVATION_SCHEME,
                                              self.gradients, production=c.production, exact_dtype=EXACT_DTYPE)
            elif "dX" in self.gradients:
                precision = NVFP4_PRECISION
                module = self.linears[c.name].module
                values = nvfp4_dx_gradients(c.dy, c.saved, module.kernel.context.model_dtype,
                                            (c.saved["input"].dtype, c.saved["master_weight"].dtype, None),
                                            production=c.production, exact_dtype=EXACT_DTYPE)
            else:
                continue
            shard = getattr(self.linears[c.name].module, "tp_shard", None)
            for gradient, local in values.items():
                ref, alt, exact = (None if t is None else whole_gradient(gradient, t, shard, self.data_parallel_group)
                                   for t in local)
                if self.is_main:
                    rows.append(convention_row(precision, gradient, c.module_class, c.layer, ref, alt, exact))
        tokens = sum_to_first(torch.tensor(captures[0].dy.shape[0] if captures else 0), self.data_parallel_group)
        if not self.is_main:
            return None
        kinds = sorted({c.kind for c in captures})
        contracts = ", ".join(CONTRACTS[k] for k in kinds)
        text = (f"optimizer step {step}: {batch or 'the step batch'} ({int(tokens)} tokens); dY of every quantized "
                "linear from the step's own backward, the same dY for both conventions; contract "
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
                f"precision {PRECISION} (contract `{CONTRACT}`); each measured step's whole batch (every rank's "
                "share), each gradient over the whole layer (every tensor-parallel shard).\n\n")
        atomic_write_text(self.run_dir / "layer2.md", head + "\n".join(self._sections), what="layer-2 report")
        for r in result.outliers:
            self.console(f"layer2 WARNING: step {step}: {r.module_class} layer {r.layer} flagged "
                         f"[{r.precision} {r.gradient}]: {'; '.join(r.reasons)}")

    def after_step(self, step: int, writer: Any = None, batch: str = "") -> Layer2Result | None:
        """:meth:`take_captures`, :meth:`measure` and (main rank) :meth:`publish` when the step was due; call
        it on every rank after the step's backward and before its optimizer step (the captures are not copies).
        The result on the main rank, None elsewhere."""
        if not self.due(step):
            return None
        result = self.measure(step, self.take_captures(), batch)
        if result is not None:
            self.publish(step, result, writer)
        return result

    def to_json(self) -> list[dict]:
        """Every measured step's result as plain data (``metrics.json`` key ``layer2``)."""
        return [{"step": step, **result.to_dict()} for step, result in self.results]

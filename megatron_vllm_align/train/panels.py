"""TensorBoard of a training run (rank 0, ``<run_dir>/tensorboard``): the per-step training scalars,
the gradient norm per module and layer, the trained model's gradient contracts as text and the
guards' findings (tags in docs/panels.md, written by ``logging.PanelWriter``)."""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.contracts import GradientContract, get_default_contract
from megatron_vllm_align.logging.tensorboard import PanelWriter

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
NATIVE_NOTE = ("Megatron's local spec (align.enabled: false): native kernels and native backward, no gradient "
               "contract of this project applies.")


def module_of(parameter_name: str) -> tuple[str, int | None]:
    """(module, decoder layer or None) owning ``parameter_name``: the path under the layer with numeric
    parts (expert indices) dropped, e.g. ``decoder.layers.1.mlp.linear_fc1.weight`` ->
    ``("mlp.linear_fc1", 1)``; outside the layers the module path, e.g. ``("output_layer", None)``."""
    module = parameter_name.rsplit(".", 1)[0] if "." in parameter_name else parameter_name
    found = _LAYER.search(module)
    if found is None:
        return module, None
    inner = ".".join(part for part in found.group(2).split(".") if not part.isdigit())
    return inner, int(found.group(1))


def grad_norms(squares: Mapping[str, torch.Tensor]) -> dict[tuple[str, int | None], float]:
    """``{(module, layer): L2 norm}`` from per-parameter sums of squares (``Trainer.last_grad_squares``)."""
    totals: dict[tuple[str, int | None], float] = {}
    for name, square in squares.items():
        key = module_of(name)
        totals[key] = totals.get(key, 0.0) + float(square)
    return {key: math.sqrt(total) for key, total in totals.items()}


def model_contracts(model: nn.Module) -> list[GradientContract]:
    """The default contracts of the module classes the model runs, in model order: every module's
    ``contract_name``, the attention Function of ``VllmDotProductAttention`` and, for a vLLM-forward
    model, the selected-logprob module its logprobs use."""
    from megatron_vllm_align.megatron.logprobs import uses_vllm_forward
    from megatron_vllm_align.ops.attention.module import VllmCausalAttentionFunction, VllmDotProductAttention
    from megatron_vllm_align.ops.selected_logprob.module import VllmSelectedLogprob

    names: list[str] = []
    for module in model.modules():
        name = getattr(module, "contract_name", None)
        if isinstance(module, VllmDotProductAttention):
            name = VllmCausalAttentionFunction.contract_name
        if name and name not in names:
            names.append(name)
    if names and uses_vllm_forward(model) and VllmSelectedLogprob.contract_name not in names:
        names.append(VllmSelectedLogprob.contract_name)
    return [get_default_contract(name) for name in names]


class TrainingPanels:
    """The run's panels; every method is a no-op off rank 0 (``active`` False)."""

    def __init__(self, run_dir: Path, active: bool) -> None:
        self.writer = PanelWriter(run_dir / "tensorboard") if active else None

    def start(self, model: nn.Module, guards: Any = None) -> None:
        """Step 0: the contracts as text; the guards' summary and identity findings (``guards``: the
        ``train.run.InstalledGuards`` of an SFT run, None where no guards run)."""
        if self.writer is None:
            return
        self.writer.write_contracts(model_contracts(model), NATIVE_NOTE)
        if guards is not None:
            self.writer.write_guards(0, summary=guards.summary(), identity_findings=guards.identity_findings)

    def step(self, metrics: Mapping[str, Any], squares: Mapping[str, torch.Tensor], guards: Any = None) -> None:
        """One optimizer step: the training scalars, the gradient norms, the guards' per-step findings."""
        if self.writer is None:
            return
        step = int(metrics["step"])
        self.writer.write_training_step(metrics)
        self.writer.write_grad_norms(grad_norms(squares), step)
        if guards is not None:
            self.writer.write_guards(step, frozen_unchanged=guards.frozen_unchanged(step),
                                     gradient_dump=guards.dumped(step))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

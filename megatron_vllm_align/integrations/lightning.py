"""The recipe's alignment guards as a Lightning callback (NeMo 2's trainer is a Lightning trainer).

Where each guard runs in Lightning's automatic optimization (torch's step pre-hooks fire
*before* Lightning's closure runs forward and backward, so they cannot see this step's
gradients):

* train start (optimizers exist, checkpoint restored): the linears' backward set to
  ``align.backward_precision`` (restored at train end or on an exception), deployed values refreshed, optimizer
  identity checked (:class:`~megatron_vllm_align.train.run.GuardError` on any finding), a step
  post-hook registered that refreshes the deployed values after every ``optimizer.step()``.
* ``on_before_optimizer_step`` (after backward and AMP unscaling, before Lightning's clipping
  and the update): gradient dump, freeze check entered.
* ``on_train_batch_end`` (after the update): freeze check closed (raises
  :class:`~megatron_vllm_align.guards.FreezeViolation`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import nn

from megatron_vllm_align.guards import (
    GradientDumper,
    check_optimizer_identity,
    validate_freeze,
)
from megatron_vllm_align.ops.dense_linear.vjp import set_backward_precision
from megatron_vllm_align.ops.refresh import (
    refresh_deployed_weights,
    register_deployed_refresh,
)
from megatron_vllm_align.train.config import AlignSection, GuardsSection
from megatron_vllm_align.train.run import GuardError


class AlignmentCallback(pl.Callback):
    """Alignment flag and guards of a recipe inside a Lightning ``Trainer``.

    align: the recipe's ``align`` section; ``enabled=True`` requires the model to have deployed
        values (built with the vLLM-forward spec), else GuardError at train start.
    guards: the recipe's ``guards`` section; ``freeze`` names are relative to the model below.
    model_attr: dotted path of the Megatron model inside the LightningModule ("" = the
        LightningModule itself), e.g. ``"module"`` for NeMo 2's ``MegatronGPTModel``.
    dump_dir: gradient dumps go to ``<dump_dir>/optimizer_<i>/step_<N>/`` (N: ``trainer.global_step``
        before the update, so resumed runs continue the numbering); required when
        ``guards.gradient_dump_every`` > 0. Dumps are taken before Lightning's gradient clipping,
        so dumps together with ``Trainer(gradient_clip_val=...)`` are refused.
    """

    def __init__(self, align: AlignSection, guards: GuardsSection, *, model_attr: str = "",
                 dump_dir: str | Path | None = None) -> None:
        if not isinstance(align, AlignSection):
            raise TypeError(f"AlignmentCallback: align must be an AlignSection, got {type(align).__name__}")
        if not isinstance(guards, GuardsSection):
            raise TypeError(f"AlignmentCallback: guards must be a GuardsSection, got {type(guards).__name__}")
        if guards.gradient_dump_every and dump_dir is None:
            raise ValueError("AlignmentCallback: guards.gradient_dump_every > 0 needs dump_dir")
        self.align, self.guards, self.model_attr, self.dump_dir = align, guards, model_attr, dump_dir
        self.refresh_handles: list[Any] = []
        self.dumpers: list[GradientDumper] = []
        self._freeze_checks: list[contextlib.AbstractContextManager] = []
        self._previous_precision: str | None = None

    def model_of(self, pl_module: pl.LightningModule) -> nn.Module:
        """The Megatron model inside ``pl_module`` (``model_attr``)."""
        return pl_module.get_submodule(self.model_attr) if self.model_attr else pl_module

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = self.model_of(pl_module)
        if self.align.enabled:
            self._previous_precision = set_backward_precision(self.align.backward_precision)
        refreshed = refresh_deployed_weights(model)
        if self.align.enabled and refreshed == 0:
            raise GuardError("align.enabled is true but the model has no deployed vLLM values: build it with "
                             "integrations.spec_hook.transformer_layer_spec_hook (or build_gpt_from_hf(align=True))")
        if self.guards.gradient_dump_every and trainer.gradient_clip_val:
            raise GuardError(f"guards.gradient_dump_every with Trainer.gradient_clip_val={trainer.gradient_clip_val}: "
                             "Lightning clips after on_before_optimizer_step, so the dumps would not be the "
                             "gradients the optimizer uses")
        for index, optimizer in enumerate(trainer.optimizers):
            if self.guards.optimizer_identity:
                findings = check_optimizer_identity(model, optimizer)
                if findings:
                    raise GuardError(f"guards.optimizer_identity (optimizer {index}): "
                                     + "; ".join(str(finding) for finding in findings))
            if refreshed:
                self.refresh_handles.append(register_deployed_refresh(optimizer, model))
            if self.guards.gradient_dump_every:
                dumper = GradientDumper(optimizer, Path(self.dump_dir) / f"optimizer_{index}",
                                        self.guards.gradient_dump_every, model=model)
                dumper.remove()  # its step pre-hook runs before Lightning's closure; dumped below instead
                self.dumpers.append(dumper)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step  # optimizer steps already taken (0-based index of this one)
        if self.dumpers and step % self.guards.gradient_dump_every == 0:
            index = next(i for i, candidate in enumerate(trainer.optimizers) if candidate is optimizer)
            self.dumpers[index].dump(step)
        if self.guards.freeze:
            check = validate_freeze(self.model_of(pl_module), optimizer, self.guards.freeze)
            check.__enter__()
            self._freeze_checks.append(check)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        checks, self._freeze_checks = self._freeze_checks, []
        for check in checks:
            check.__exit__(None, None, None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._freeze_checks = []
        self._detach()

    def _detach(self) -> None:
        if self._previous_precision is not None:
            set_backward_precision(self._previous_precision)
            self._previous_precision = None
        for handle in self.refresh_handles:
            handle.remove()
        self.refresh_handles, self.dumpers = [], []

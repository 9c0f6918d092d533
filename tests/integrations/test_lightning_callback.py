"""AlignmentCallback inside a real Lightning Trainer (CPU) fitting the aligned tiny Megatron model:
deployed values equal vLLM's processing of the master after every step, and each guard catches
its planted bug. No vLLM engine is started."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from megatron_vllm_align.guards import FreezeViolation, load_gradient_dump
from megatron_vllm_align.integrations.lightning import AlignmentCallback
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.ops.refresh import refresh_deployed_weights
from megatron_vllm_align.train.config import AlignSection, GuardsSection, RecipeError
from megatron_vllm_align.train.run import GuardError

BATCH = [[5, 9, 200, 31, 7, 7, 100, 3, 1, 64, 65], list(range(40, 53)), [12, 400, 401, 3, 90, 18, 250]]
ALIGN = AlignSection(enabled=True)
NORM = "model.decoder.final_layernorm.weight"


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return -torch.cat(token_logprobs(model, BATCH)).mean()


class AlignedLM(pl.LightningModule):
    """The aligned GPTModel as ``self.model``; AdamW over the trainable parameters (+ ``extra``)."""

    def __init__(self, model: torch.nn.Module, extra: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.model, self.extra = model, list(extra)

    def training_step(self, batch, batch_idx):
        return loss_of(self.model)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad] + self.extra
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(16), batch_size=1)


def fit(module: pl.LightningModule, callbacks: list[pl.Callback], steps: int = 3, **trainer_args) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **trainer_args)
    trainer.fit(module)


@pytest.fixture
def aligned(megatron_cpu, llama_dir):
    return build_gpt_from_hf(llama_dir, align=True)


class FreshComparison(pl.Callback):
    """After every step: a separately built aligned model given the trained masters and rebuilt
    deployed values must give bitwise the trained model's logprobs (whose forward also refuses
    stale deployed values)."""

    def __init__(self, reference: torch.nn.Module) -> None:
        self.reference, self.checked = reference, 0

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for name, param in self.reference.named_parameters():
            param.copy_(pl_module.model.get_parameter(name))
        refresh_deployed_weights(self.reference)
        trained, fresh = token_logprobs(pl_module.model, BATCH), token_logprobs(self.reference, BATCH)
        assert all(torch.equal(a, b) for a, b in zip(trained, fresh, strict=True)), f"step {trainer.global_step}"
        self.checked += 1


def test_deployed_values_follow_every_step(aligned, llama_dir):
    start = {name: p.detach().clone() for name, p in aligned.named_parameters()}
    comparison = FreshComparison(build_gpt_from_hf(llama_dir, align=True))
    module = AlignedLM(aligned)
    initial = float(loss_of(aligned).detach())
    fit(module, [AlignmentCallback(ALIGN, GuardsSection()), comparison])
    assert comparison.checked == 3
    assert all(not torch.equal(p, start[name]) for name, p in aligned.named_parameters()), "a master did not move"
    final = float(loss_of(aligned).detach())
    print(f"loss {initial:.4f} -> {final:.4f} over 3 Lightning steps")
    assert final < initial


class RecordsBackwardPrecision(pl.Callback):
    """The linear backward's precision in force when each step's gradients reach the optimizer."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from megatron_vllm_align.ops.dense_linear import current_backward_precision

        self.seen.append(current_backward_precision())


def test_the_backward_precision_of_the_align_section_holds_during_fit_only(aligned):
    """``AlignSection(backward_precision="fp32")`` is in force for every step's backward of the fit and
    the library's precision is back after it (also after a failed fit)."""
    from megatron_vllm_align.ops.dense_linear import current_backward_precision

    record = RecordsBackwardPrecision()
    fit(AlignedLM(aligned), [AlignmentCallback(AlignSection(backward_precision="fp32"), GuardsSection()), record])
    assert record.seen == ["fp32"] * 3 and current_backward_precision() == "library"
    with pytest.raises(RuntimeError, match="changed since the deployed value was built"):
        fit(AlignedLM(aligned), [SkipsRefresh(AlignSection(backward_precision="fp32"), GuardsSection())])
    assert current_backward_precision() == "library"
    with pytest.raises(RecipeError, match=r"align\.backward_precision: must be one of"):
        AlignSection(backward_precision="bf16")


class SkipsRefresh(AlignmentCallback):
    """Planted bug: the refresh hook is detached right after it is registered."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        for handle in self.refresh_handles:
            handle.remove()


def test_a_skipped_refresh_is_refused(aligned):
    with pytest.raises(RuntimeError, match="changed since the deployed value was built"):
        fit(AlignedLM(aligned), [SkipsRefresh(ALIGN, GuardsSection())])


def test_identity_check_reports_an_unknown_optimizer_tensor(aligned):
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(GuardError, match=r"not_a_model_parameter.*shape \[3, 5\]"):
        fit(AlignedLM(aligned, extra=[stray]), [AlignmentCallback(ALIGN, GuardsSection())])


def test_identity_check_reports_a_parameter_missing_from_the_optimizer(aligned):
    module = AlignedLM(aligned)
    module.configure_optimizers = lambda: torch.optim.AdamW(
        [p for n, p in module.named_parameters() if n != NORM], lr=3e-3)
    with pytest.raises(GuardError, match=f"{NORM}: \\[not_in_optimizer\\]"):
        fit(module, [AlignmentCallback(ALIGN, GuardsSection())])


def test_freeze_validator_catches_a_frozen_but_moving_parameter(aligned):
    with pytest.raises(FreezeViolation, match=f"{NORM}: moved"):
        fit(AlignedLM(aligned), [AlignmentCallback(ALIGN, GuardsSection(freeze=[NORM]))], steps=1)


def test_a_real_freeze_passes(aligned):
    norm = aligned.get_parameter(NORM.removeprefix("model."))
    norm.requires_grad_(False)
    before = norm.detach().clone()
    fit(AlignedLM(aligned), [AlignmentCallback(ALIGN, GuardsSection(freeze=[NORM]))], steps=2)
    assert torch.equal(norm, before)


def test_gradient_dump_holds_the_gradients_of_the_step(aligned, tmp_path):
    aligned.zero_grad(set_to_none=True)
    loss_of(aligned).backward()
    expected = {f"model.{name}": p.grad.clone() for name, p in aligned.named_parameters()}
    aligned.zero_grad(set_to_none=True)
    fit(AlignedLM(aligned), [AlignmentCallback(ALIGN, GuardsSection(gradient_dump_every=1), dump_dir=tmp_path)],
        steps=2)
    first, second = load_gradient_dump(tmp_path / "optimizer_0", 0), load_gradient_dump(tmp_path / "optimizer_0", 1)
    assert sorted(first.grads) == sorted(expected)
    assert all(torch.equal(first.grads[name], grad) for name, grad in expected.items())
    assert any(not torch.equal(second.grads[name], grad) for name, grad in expected.items())


def test_dumps_with_lightning_clipping_are_refused(aligned, tmp_path):
    with pytest.raises(GuardError, match="gradient_clip_val"):
        fit(AlignedLM(aligned), [AlignmentCallback(ALIGN, GuardsSection(gradient_dump_every=1), dump_dir=tmp_path)],
            gradient_clip_val=1.0)


def test_align_enabled_on_a_native_model_is_refused(megatron_cpu, llama_dir):
    native = build_gpt_from_hf(llama_dir, align=False)
    with pytest.raises(GuardError, match="align.enabled is true"):
        fit(AlignedLM(native), [AlignmentCallback(ALIGN, GuardsSection())])

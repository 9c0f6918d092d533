"""fp32 main copies of bf16 parameters (train/main_params.py) through the real Trainer, guards and
checkpoints, on a toy bf16 language model (embedding -> RMS norm -> head)."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from megatron_vllm_align.guards import (
    FreezeViolation,
    GradientDumper,
    check_optimizer_identity,
    load_gradient_dump,
    validate_freeze,
)
from megatron_vllm_align.guards.optimizer_identity import NOT_A_MODEL_PARAMETER, NOT_IN_OPTIMIZER
from megatron_vllm_align.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_vllm_align.train.config import OptimizerSection, RecipeError, load_recipe
from megatron_vllm_align.train.data import SFTExample
from megatron_vllm_align.train.trainer import Trainer

VOCAB, HIDDEN, LR = 16, 8, 1.0e-3
NORM = "norm_weight"


class _ToyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, HIDDEN, dtype=torch.bfloat16)
        self.norm_weight = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight.float()
        return torch.log_softmax(self.head(h.bfloat16()).float(), dim=-1)


def _logprobs_fn(model: _ToyLM):
    def logprobs(rows: list[torch.Tensor]) -> list[torch.Tensor]:
        return [model(row[:-1]).gather(-1, row[1:, None])[:, 0] for row in rows]
    return logprobs


def _examples(step: int) -> list[SFTExample]:
    g = torch.Generator().manual_seed(step)
    rows = [torch.randint(0, VOCAB, (12,), generator=g) for _ in range(4)]
    return [SFTExample(row, torch.arange(11) >= 3) for row in rows]


def _trainer(main: str, *, clip: float = 0.0, frozen: tuple[str, ...] = (), steps: int = 8) -> Trainer:
    section = OptimizerSection(lr=LR, min_lr=LR, warmup_steps=0, weight_decay=0.0, clip_grad=clip,
                               main_params_dtype=main)
    model = _ToyLM()
    return Trainer(model, _logprobs_fn(model), section, total_steps=steps, frozen=frozen, keep_tensors=True)


def _step(trainer: Trainer, step: int) -> dict:
    examples = _examples(step)
    tokens = sum(int(e.loss_mask.sum()) for e in examples)
    return trainer.train_step(step, examples, tokens, tokens)


def test_norm_weight_near_one_moves_with_main_params_and_not_without():
    """AdamW moves every element by ~lr = 1e-3 per step, below half a bf16 ulp at 1.0 (2^-9 below,
    2^-8 above): stepping bf16 directly loses it; the fp32 main copy accumulates it."""
    without, with_main = _trainer("none"), _trainer("float32")
    norm_without, norm_with = without.named_params[NORM], with_main.named_params[NORM]
    assert not hasattr(norm_without, "main_param") and norm_with.main_param.dtype == torch.float32
    _step(without, 1), _step(with_main, 1)
    assert torch.equal(norm_with, torch.ones_like(norm_with))  # one step is below half an ulp in both
    first_move = (norm_with.main_param - 1).abs()
    assert torch.allclose(first_move, torch.full_like(first_move, LR), rtol=1e-3)  # Adam step 1: lr * sign(g)
    for step in range(2, 5):
        _step(without, step), _step(with_main, step)
    assert torch.equal(norm_without, torch.ones_like(norm_without))  # the bug: four steps, nothing moved
    assert (norm_with.main_param - 1).abs().max() > 2.5e-3
    assert int((norm_with != 1).sum()) >= 1  # the accumulated update reached the bf16 parameter
    assert without.last_gradients[NORM].dtype == torch.bfloat16
    assert with_main.last_gradients[NORM].dtype == torch.float32


def test_bf16_param_is_the_rounded_main_after_each_step_and_post_hooks_see_it():
    trainer = _trainer("float32")
    at_hook = []
    trainer.optimizer.register_step_post_hook(lambda *_: at_hook.append(
        all(torch.equal(p, p.main_param.to(p.dtype)) for p in trainer.params)))
    for step in range(1, 4):
        _step(trainer, step)
        for name, p in trainer.named_params.items():
            assert torch.equal(p, p.main_param.to(torch.bfloat16)), (step, name)
        assert any(not torch.equal(p.float(), p.main_param) for p in trainer.params)  # main keeps more bits
    assert at_hook == [True, True, True]  # the refresh hook runs after the copy-back


def test_clipping_uses_the_fp32_gradients_and_the_dump_sees_them(tmp_path):
    trainer = _trainer("float32", clip=1e-3)
    with GradientDumper(trainer.optimizer, tmp_path, every=1, model=trainer.model):
        metrics = _step(trainer, 1)
    fp32 = trainer.last_gradients
    expected_norm = float(torch.sqrt(sum((g ** 2).sum() for g in fp32.values())))
    assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-6) and metrics["clipped"]
    dump = load_gradient_dump(tmp_path, 0)
    for name, grad in fp32.items():
        dumped = dump.grads[name]
        assert dumped.dtype == torch.float32
        assert torch.equal(dumped, grad * metrics["clip_coef"]), name


def test_guards_recognise_main_params_and_still_catch_their_traps():
    trainer = _trainer("float32", frozen=("embedding.weight",))
    for step in (1, 2):
        _step(trainer, step)
    model, optimizer = trainer.model, trainer.optimizer
    assert check_optimizer_identity(model, optimizer) == []
    assert check_optimizer_identity(model, optimizer, forward=lambda: model(torch.arange(5))) == []

    trainer.forward_backward(_examples(3), 20)
    trainer.step_guard = lambda: validate_freeze(model, optimizer, ["embedding.weight", NORM])
    with pytest.raises(FreezeViolation, match=NORM) as caught:  # planted: declared frozen, but trained
        trainer.apply_update(3, 20, 20)
    report, = caught.value.reports
    assert report.name == NORM and report.moved and "it has a gradient" in report.reasons[0]

    model.head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.bfloat16)  # planted: swapped after build
    kinds = {(f.name, f.kind) for f in check_optimizer_identity(model, optimizer)}
    assert ("head.weight", NOT_IN_OPTIMIZER) in kinds
    assert any(kind == NOT_A_MODEL_PARAMETER for _, kind in kinds)  # the stale fp32 main copy


def test_resume_restores_main_params_bitwise(tmp_path):
    uninterrupted = _trainer("float32")
    for step in range(1, 5):
        _step(uninterrupted, step)
    first = _trainer("float32")
    for step in (1, 2):
        _step(first, step)
    save_checkpoint(tmp_path / "ckpt", model=first.model, optimizer=first.optimizer, step=2, fit={}, history={},
                    data_state={})
    resumed = _trainer("float32")
    load_checkpoint(tmp_path / "ckpt", model=resumed.model, optimizer=resumed.optimizer, fit={}, world_size=1, rank=0)
    assert all(torch.equal(a.main_param, b.main_param) for a, b in zip(first.params, resumed.params))
    for step in (3, 4):
        _step(resumed, step)
    for a, b in zip(uninterrupted.params, resumed.params):
        assert torch.equal(a, b) and torch.equal(a.main_param, b.main_param)

    plain = _trainer("none")
    with pytest.raises(ValueError, match="main_params holds parameter indices"):
        load_checkpoint(tmp_path / "ckpt", model=plain.model, optimizer=plain.optimizer, fit={}, world_size=1, rank=0)


def test_recipe_switch():
    assert load_recipe(None).optimizer.main_params_dtype == "float32"
    assert load_recipe(None, ["optimizer.main_params_dtype=none"]).optimizer.main_params_dtype == "none"
    with pytest.raises(RecipeError, match=r"optimizer\.main_params_dtype: must be one of"):
        load_recipe(None, ["optimizer.main_params_dtype=float16"])


def test_a_checkpoint_that_cannot_be_written_is_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A failing state write (here: torch.save raising) is a CheckpointError naming the rank, and neither the
    checkpoint directory nor a staging directory is left behind; an existing checkpoint stays as it was."""
    from megatron_vllm_align.train import checkpoint

    trainer = _trainer("float32")
    _step(trainer, 1)
    save = functools.partial(save_checkpoint, model=trainer.model, optimizer=trainer.optimizer, step=1, fit={},
                             history={}, data_state={})
    kept = save(tmp_path / "kept")
    before = (kept / "state.pt").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"not written: rank 0: OSError: .*No space left on device"):
        save(tmp_path / "new")
    with pytest.raises(CheckpointError, match="not written"):
        save(kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert (kept / "state.pt").read_bytes() == before

"""GradientDumper in one process: when it fires, what it records, how it fails."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_vllm_align.guards import GradientDumper, GradientDumpError, GradientScaling, load_gradient_dump
from megatron_vllm_align.guards.dump_format import index_path, tensor_path


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3, bias=False))


def _backward(model: nn.Module, seed: int) -> None:
    model(torch.randn(6, 5, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()


class _HalvingWrapper:
    """A wrapper that changes gradients inside its step() before the inner step (as Megatron's
    optimizers do with unscaling and clipping)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @torch.no_grad()
    def step(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.grad.mul_(0.5)
        self.optimizer.step()


def test_dumps_every_n_steps_the_gradient_the_optimizer_steps(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dumper = GradientDumper(optimizer, tmp_path, every=3, model=model)
    seen = {}
    for step in range(7):
        optimizer.zero_grad()
        _backward(model, step)
        seen[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    assert dumper.dumped_steps == [0, 3, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000000", "step_00000003", "step_00000006"]
    for step in (0, 3, 6):
        dump = load_gradient_dump(tmp_path, step)
        assert dump.world_size == 1 and sorted(dump.grads) == sorted(seen[step])
        for name, grad in seen[step].items():
            assert torch.equal(dump.grads[name], grad), name
    record = load_gradient_dump(tmp_path, 0).records["2.weight"]
    assert (record.module_class, record.optimizer_slot, record.global_shape, record.dtype) == (
        "Linear", [0, 0, 2], [3, 4], "torch.float32")
    assert record.placement == {"kind": "full"} and record.is_expert is False
    assert record.tensor_id == id(model[2].weight)


def test_hook_sits_on_the_inner_optimizer_after_the_wrapper_changed_the_gradient(tmp_path):
    model = _model()
    wrapper = _HalvingWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    GradientDumper(wrapper, tmp_path, model=model, scaling=GradientScaling(dense_grad_factor=0.5))
    _backward(model, 0)
    after_backward = {n: p.grad.clone() for n, p in model.named_parameters()}
    wrapper.step()
    dump = load_gradient_dump(tmp_path, 0)
    for name, grad in after_backward.items():
        assert torch.equal(dump.grads[name], grad * 0.5), name
        assert dump.records[name].grad_factor == 0.5
    assert dump.scaling == GradientScaling(dense_grad_factor=0.5)


def test_megatron_chained_optimizer_members_are_all_dumped_at_the_first_members_step(tmp_path):
    from megatron.core.optimizer import ChainedOptimizer

    model = _model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    chained = ChainedOptimizer([first, second])  # real class; its step() needs CUDA optimizers
    GradientDumper(chained, tmp_path, model=model)
    _backward(model, 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    first.step()
    second.step()
    dump = load_gradient_dump(tmp_path, 0)
    assert sorted(dump.grads) == sorted(grads)
    assert dump.records["2.weight"].optimizer_slot == [1, 0, 0]
    assert all(torch.equal(dump.grads[n], g) for n, g in grads.items())


def test_default_scaling_of_a_plain_optimizer_is_unknown_and_names_fall_back_to_slots(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    GradientDumper(optimizer, tmp_path)
    _backward(model, 0)
    optimizer.step()
    dump = load_gradient_dump(tmp_path, 0)
    assert dump.scaling.source == "unknown" and dump.scaling.loss_scale is None
    assert "<unnamed optimizer[0].param_groups[0][2]>" in dump.grads


def test_parameters_without_gradient_are_skipped(tmp_path):
    model = _model()
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    GradientDumper(optimizer, tmp_path, model=model)
    _backward(model, 0)
    optimizer.step()
    assert sorted(load_gradient_dump(tmp_path, 0).grads) == ["0.weight", "2.weight"]


def test_bad_arguments_are_refused(tmp_path):
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(GradientDumpError, match="a_file.*cannot be written"):
        GradientDumper(optimizer, blocker / "dumps")
    with pytest.raises(ValueError, match="every must be a positive integer"):
        GradientDumper(optimizer, tmp_path, every=0)
    with pytest.raises(TypeError, match="neither a torch.optim.Optimizer"):
        GradientDumper(object(), tmp_path)


def test_failed_write_leaves_nothing_that_looks_complete(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dumper = GradientDumper(optimizer, tmp_path, model=model)
    _backward(model, 0)
    dumper.dump(0)  # an earlier, complete dump of step 0
    load_gradient_dump(tmp_path, 0)
    tensor_path(tmp_path, 0, 0).unlink()
    tensor_path(tmp_path, 0, 0).mkdir()  # the tensor file cannot be moved into place now
    with pytest.raises(GradientDumpError, match="cannot write the gradient dump of rank 0, step 0"):
        optimizer.step()
    assert dumper.dumped_steps == [0]  # only the manual dump
    assert not index_path(tmp_path, 0, 0).exists()  # the stale index went first
    assert [p.name for p in index_path(tmp_path, 0, 0).parent.iterdir()] == ["rank_00000.safetensors"]
    with pytest.raises(GradientDumpError, match="no rank wrote its index"):
        load_gradient_dump(tmp_path, 0)


def test_remove_detaches_the_hook(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradientDumper(optimizer, tmp_path, model=model) as dumper:
        _backward(model, 0)
        optimizer.step()
    optimizer.step()
    assert dumper.dumped_steps == [0] and dumper.next_step == 1

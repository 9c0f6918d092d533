"""validate_freeze in one process (the FSDP2 + AdamW trap runs under torchrun)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_vllm_align.guards import FreezeViolation, validate_freeze


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _backward(model: nn.Module) -> None:
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(0))).pow(2).mean().backward()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),   # decoupled weight decay
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),         # momentum from the previous step
])
def test_zeroed_gradient_is_reported_with_its_move(optimizer_class, options):
    model = _model()
    optimizer = optimizer_class(model.parameters(), **options)
    _backward(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # grads zeroed, not None
    before = _values(model)
    with pytest.raises(FreezeViolation) as caught:
        with validate_freeze(model, optimizer, ["0.weight", "0.bias"]):
            optimizer.step()
    after = _values(model)
    reports = {r.name: r for r in caught.value.reports}
    assert sorted(reports) == ["0.bias", "0.weight"]
    for name, report in reports.items():
        assert report.moved
        assert report.max_abs_change == float((after[name].double() - before[name].double()).abs().max()) > 0
        assert "zeroed, not None" in report.reasons[0]
    assert "0.weight: moved, max |change| =" in str(caught.value)


def test_correct_freezes_pass_bitwise_unchanged():
    model = _model()
    model[0].weight.requires_grad_(False)                   # grad stays None
    trained = [p for n, p in model.named_parameters() if p.requires_grad and n != "0.bias"]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)  # 0.bias: absent from the optimizer
    for _ in range(2):
        optimizer.zero_grad()
        _backward(model)
        before = _values(model)
        with validate_freeze(model, optimizer, ["0.weight", "0.bias"]):
            optimizer.step()
        after = _values(model)
        assert torch.equal(before["0.weight"], after["0.weight"]) and torch.equal(before["0.bias"], after["0.bias"])
        assert not torch.equal(before["1.weight"], after["1.weight"])  # the step did run
    assert model[0].bias.grad is not None  # it has a gradient, but no optimizer can use it


def test_gradient_in_optimizer_is_a_violation_even_when_nothing_moved_yet():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # no decay, no momentum
    _backward(model)
    model[1].bias.grad.zero_()
    with pytest.raises(FreezeViolation) as caught:
        with validate_freeze(model, optimizer, ["1.bias"]):
            optimizer.step()
    (report,) = caught.value.reports
    assert (report.name, report.moved, report.max_abs_change) == ("1.bias", False, 0.0)
    assert "optimizer[0].param_groups[0][3]" in report.reasons[0]


def test_unknown_name_and_errors_inside_the_block():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"no parameter named \['2.weight'\]"):
        with validate_freeze(model, optimizer, ["2.weight"]):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with validate_freeze(model, optimizer, ["0.weight"]):
            raise RuntimeError("boom")

"""Layer 1 for the FP8 linear: FP8Linear against ReferenceFP8Linear, built from each default FP8
contract, with the contract's own tolerances; planted bugs are caught."""
import dataclasses

import pytest
import torch

from megatron_vllm_align.contracts import STE, ContractError, contract_mismatches, get_default_contract
from megatron_vllm_align.ops.fp8_linear.case import CONTRACTS, OUT_FEATURES, TINY_IN_FEATURES, fp8_linear_builder
from megatron_vllm_align.ops.fp8_linear.emulated import FP8Linear, FP8LinearConfig, FP8LinearFunction
from megatron_vllm_align.ops.fp8_linear.reference import FP8_LINEAR_VARIABLES, ReferenceFP8Linear
from megatron_vllm_align.validation import DY_KINDS, compare_one_step_update, compare_vjp
from megatron_vllm_align.validation.tolerances import contract_tolerances

ITEMS = set(FP8_LINEAR_VARIABLES)


def make_pair(contract, m, seed, config=None, candidate_cls=FP8Linear, static_scales=None):
    """Candidate (``config``, default from the contract), its reference from the contract, and x [m, K]
    (the registered case's builder at K = 200, not a multiple of 128)."""
    n = OUT_FEATURES.get(contract.module_class, 32)
    candidate, reference, (x,) = fp8_linear_builder(contract, TINY_IN_FEATURES, n, config, candidate_cls,
                                                    static_scales)(seed, m)
    return candidate, reference, x


def compare(contract, candidate, reference, x, seed=0):
    return compare_vjp(candidate, reference, [x], tolerances=contract_tolerances(contract, FP8_LINEAR_VARIABLES),
                       seed=seed,
                       name=f"{contract.module_class} seed {seed} M {x.shape[0]}",
                       tolerance_reasoning=contract.reference.reasoning,
                       contract_check=lambda module: contract_mismatches(contract, **module.declared_surrogate()))


def failing(report):
    return {(c.item, c.status) for c in report.checks if not c.passed}


@pytest.mark.parametrize("m", [1, 257])
@pytest.mark.parametrize("name", CONTRACTS)
def test_correct_fp8_linear_passes(name, m):
    contract = get_default_contract(name)
    worst = {item: 0.0 for item in ITEMS}
    for seed in range(5):
        candidate, reference, x = make_pair(contract, m, seed)
        report = compare(contract, candidate, reference, x, seed)
        assert report.passed, report.failures
        assert {(c.item, c.dy_kind) for c in report.checks} == {(i, k) for i in ITEMS for k in DY_KINDS}
        assert all(note.endswith("= 0") for note in report.notes), "the value must be the candidate's, bitwise"
        for c in report.checks:
            worst[c.item] = max(worst[c.item], c.metrics.rel_l2)
    print(f"{name} M={m}: worst rel_l2 over 5 seeds x {DY_KINDS}: "
          + ", ".join(f"{item} {value:.2e}" for item, value in sorted(worst.items()))
          + f" (bound {contract.reference.tolerance_for('input').rel_l2:.3g})")


@pytest.mark.parametrize("name", CONTRACTS)
def test_one_step_update_matches(name):
    contract = get_default_contract(name)
    candidate, reference, x = make_pair(contract, 257, seed=7)
    report = compare_one_step_update(candidate, reference, [x], tolerance=contract.reference.tolerance_for("*"))
    assert report.passed, report.failures
    assert {c.item for c in report.checks} == {"weight", "bias"}


@pytest.mark.parametrize("name", CONTRACTS)
def test_planted_master_dx_is_caught_numerically_and_by_the_contract(name):
    contract = get_default_contract(name)
    config = dataclasses.replace(FP8LinearConfig.from_contract(contract), dx_weight="master")
    candidate, reference, x = make_pair(contract, 257, seed=0, config=config)
    report = compare(contract, candidate, reference, x)
    bad = failing(report)
    assert ("input[0]", "tolerance") in bad, report.failures
    assert not {item for item, status in bad} & {"weight", "bias"}, "dW and db do not depend on W_ref"
    worst = max(c.metrics.rel_l2 for c in report.checks if c.item == "input[0]" and c.dy_kind == "random")
    print(f"{name}: master dX vs dequantized reference rel_l2 = {worst:.3e}")
    contract_lines = [c.message for c in report.checks if c.status == "contract"]
    assert any("surrogate.dx_weight: implementation declares 'master'" in line for line in contract_lines)


def clipped_activation_contract():
    """The per-channel contract with a calibrated (fixed) per-tensor input scale and an input STE
    clipped where that scale saturates (|x / s| = 448, derivative 1 at the threshold)."""
    contract = get_default_contract("fp8_linear_per_channel")
    forward = contract.visible_forward
    positions = tuple(dataclasses.replace(p, scale_granularity="per_tensor", scale_rule="fixed from calibration")
                      if p.tensor == "input" else p for p in forward.quantize_positions)
    return dataclasses.replace(
        contract,
        visible_forward=dataclasses.replace(forward, quantize_positions=positions),
        trainable=dataclasses.replace(contract.trainable, scales={"weight": "stop_gradient", "input": "fixed"}),
        surrogate=dataclasses.replace(contract.surrogate,
                                      activation_ste=STE("clipped", threshold=448.0, value_at_threshold=1.0)),
        save_recompute=dataclasses.replace(contract.save_recompute,
                                           save=(*contract.save_recompute.save, "input_clip_mask")))


def test_planted_clipped_threshold_is_caught():
    contract = clipped_activation_contract()
    scales = {"input": torch.tensor([2.0 / 448])}
    candidate, reference, x = make_pair(contract, 257, seed=0, static_scales=scales)
    ratio = x.detach().double().abs() / scales["input"].double()
    between = ((ratio > 300) & (ratio <= 448)).float().mean().item()
    assert 0.1 < between and (ratio > 448).any(), "inputs must lie between the thresholds and beyond"
    report = compare(contract, candidate, reference, x)
    assert report.passed, report.failures

    config = dataclasses.replace(candidate.config, activation_ste=STE("clipped", threshold=300.0,
                                                                      value_at_threshold=1.0))
    candidate, reference, x = make_pair(contract, 257, seed=0, config=config, static_scales=scales)
    report = compare(contract, candidate, reference, x)
    bad = failing(report)
    assert ("input[0]", "tolerance") in bad and ("weight", "tolerance") not in bad, report.failures
    print(f"{between:.1%} of inputs between the thresholds; dX rel_l2 = "
          f"{max(c.metrics.rel_l2 for c in report.checks if c.item == 'input[0]'):.3e}")
    assert ("contract", "contract") in bad
    assert any("surrogate.activation_ste.threshold: implementation declares 300.0, contract says 448.0"
               in line for line in report.failures)


class _HalfWeightGrad(FP8LinearFunction):
    """Planted bug: dW halved; everything else is FP8LinearFunction."""

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w, grad_b, none = FP8LinearFunction.backward(ctx, grad_out)
        return grad_x, None if grad_w is None else grad_w * 0.5, grad_b, none


class HalfWeightGradFP8Linear(FP8Linear):
    def forward(self, x):
        return _HalfWeightGrad.apply(x, self.weight, self.bias, self.config)


@pytest.mark.parametrize("m", [1, 257])
def test_planted_half_dw_is_caught(m):
    contract = get_default_contract("fp8_linear_per_channel")
    candidate, reference, x = make_pair(contract, m, seed=0, candidate_cls=HalfWeightGradFP8Linear)
    report = compare(contract, candidate, reference, x)
    assert failing(report) == {("weight", "tolerance")}, report.failures
    assert all(c.dy_kind == "zero" for c in report.checks if c.item == "weight" and c.passed)


def test_reference_never_runs_the_candidate_backward(monkeypatch):
    contract = get_default_contract("fp8_linear_block128")
    candidate, reference, x = make_pair(contract, 5, seed=0)

    def forbidden(ctx, grad_out):
        raise AssertionError("FP8LinearFunction.backward ran")

    monkeypatch.setattr(FP8LinearFunction, "backward", staticmethod(forbidden))
    y = reference(x)
    assert torch.equal(y, candidate(x.detach()))
    y.backward(torch.ones_like(y))
    assert x.grad is not None and reference.weight.grad is not None and reference.bias.grad is not None
    with pytest.raises(AssertionError, match="FP8LinearFunction.backward ran"):
        candidate(x).sum().backward()


def test_reference_refuses_what_the_contract_does_not_fix():
    contract = clipped_activation_contract()
    with pytest.raises(ContractError, match="fixed scale of 'input' must be given") as caught:
        ReferenceFP8Linear(contract, TINY_IN_FEATURES, 16)
    assert caught.value.field == "trainable.scales.input"
    dynamic = dataclasses.replace(get_default_contract("fp8_linear_per_channel"), surrogate=contract.surrogate)
    with pytest.raises(ContractError, match="clipped STE on 'input' is relative to a fixed per-tensor scale"):
        ReferenceFP8Linear(dynamic, TINY_IN_FEATURES, 16)
    renamed = dataclasses.replace(contract, trainable=dataclasses.replace(
        contract.trainable, variables=("x", "master_weight", "bias")))
    with pytest.raises(ContractError, match="needs the trainable variable 'input'"):
        contract_tolerances(renamed, FP8_LINEAR_VARIABLES)
    reference = ReferenceFP8Linear(get_default_contract("fp8_linear_per_channel"), TINY_IN_FEATURES, 16)
    with pytest.raises(ValueError, match=r"x must be a tensor \[..., 200\]"):
        reference(torch.randn(3, TINY_IN_FEATURES + 1))

"""Layer 1 for the NVFP4 linear: VllmNVFP4Linear against ReferenceNVFP4Linear, built from the
``nvfp4_linear`` contract, with the contract's own tolerances (atol 0, rtol = rel_l2 = 3u) over 5 seeds;
planted bugs in the surrogate (the clipped STE's threshold off by 2x either way, identity instead of
clipped, derivative 0 at the threshold, dX from the master weight) each fail layer 1 on dX alone."""
import pytest
import torch

from megatron_vllm_align.contracts import STE, contract_mismatches, get_default_contract
from megatron_vllm_align.ops.nvfp4_linear.case import (
    INPUT_SCALE,
    TINY_IN_FEATURES,
    nvfp4_linear_builder,
    with_dx_weight,
)
from megatron_vllm_align.ops.nvfp4_linear.reference import NVFP4_LINEAR_VARIABLES
from megatron_vllm_align.ops.registry import graph_functions
from megatron_vllm_align.validation import DY_KINDS, compare_one_step_update, compare_vjp
from megatron_vllm_align.validation.tolerances import contract_tolerances

CONTRACT = get_default_contract("nvfp4_linear")
ITEMS = set(NVFP4_LINEAR_VARIABLES)
N = 96


def make_pair(context, m, seed, contract=CONTRACT, **module_kwargs):
    """Candidate (``module_kwargs``: a planted surrogate), the reference from ``contract``, x [m, 272]
    (the registered case's builder)."""
    candidate, reference, (x,) = nvfp4_linear_builder(context, contract, TINY_IN_FEATURES, N, **module_kwargs)(seed, m)
    return candidate, reference, x


def compare(candidate, reference, x, seed=0, contract=CONTRACT, check_contract=True):
    check = (lambda module: contract_mismatches(contract, **module.declared_surrogate())) if check_contract else None
    return compare_vjp(candidate, reference, [x], tolerances=contract_tolerances(contract, NVFP4_LINEAR_VARIABLES),
                       seed=seed, name=f"nvfp4_linear seed {seed} M {x.shape[0]}",
                       tolerance_reasoning=contract.reference.reasoning, contract_check=check)


def failing(report):
    return {(c.item, c.status) for c in report.checks if not c.passed}


def worst_input_rel_l2(report):
    return max(c.metrics.rel_l2 for c in report.checks if c.item == "input[0]" and c.metrics is not None)


@pytest.mark.parametrize("m", [1, 257])
def test_correct_nvfp4_linear_passes_across_5_seeds(bf16_context, m):
    worst = {item: 0.0 for item in ITEMS}
    for seed in range(5):
        candidate, reference, x = make_pair(bf16_context, m, seed)
        report = compare(candidate, reference, x, seed)
        assert report.passed, report.failures
        assert {(c.item, c.dy_kind) for c in report.checks} == {(i, k) for i in ITEMS for k in DY_KINDS}
        assert all(note.endswith("= 0") for note in report.notes), "the value must be the candidate's, bitwise"
        for c in report.checks:
            worst[c.item] = max(worst[c.item], c.metrics.rel_l2)
    print(f"M={m}: worst rel_l2 over 5 seeds x {DY_KINDS}: "
          + ", ".join(f"{item} {value:.2e}" for item, value in sorted(worst.items()))
          + f" (bound {CONTRACT.reference.tolerance_for('input').rel_l2:.3g})")


def test_master_dx_variant_passes_against_its_own_surrogate(bf16_context):
    """The registered ``dx=master`` case's numerics (its contract differs from the default only in the
    surrogate, so its save list still names the dequantized weight: not compared here)."""
    contract = with_dx_weight(CONTRACT, "master")
    for seed in range(5):
        candidate, reference, x = make_pair(bf16_context, 257, seed, contract, dx_weight="master")
        report = compare(candidate, reference, x, seed, contract, check_contract=False)
        assert report.passed, report.failures


def test_one_step_update_matches(bf16_context):
    candidate, reference, x = make_pair(bf16_context, 257, seed=7)
    report = compare_one_step_update(candidate, reference, [x], tolerance=CONTRACT.reference.tolerance_for("*"))
    assert report.passed, report.failures
    assert {c.item for c in report.checks} == {"weight", "bias"}


def test_inputs_lie_on_both_sides_of_the_threshold_and_on_it(bf16_context):
    _, _, x = make_pair(bf16_context, 257, seed=0)
    ratio = x.detach().double().abs() / INPUT_SCALE
    assert (ratio == 2688).sum() >= 2 * 257
    assert 0.005 < float((ratio > 2688).double().mean()) < 0.03
    assert float(((ratio > 1344) & (ratio < 2688)).double().mean()) > 0.1
    assert float(((ratio > 2688) & (ratio <= 5376)).double().mean()) > 0.005


@pytest.mark.parametrize("threshold", [2688.0 / 2, 2688.0 * 2])
def test_planted_threshold_off_by_2x_is_caught(bf16_context, threshold):
    candidate, reference, x = make_pair(bf16_context, 257, seed=0,
                                        activation_ste=STE("clipped", threshold=threshold, value_at_threshold=1.0))
    report = compare(candidate, reference, x)
    bad = failing(report)
    assert ("input[0]", "tolerance") in bad, report.failures
    assert not {item for item, _ in bad} & {"weight", "bias"}, "dW and db do not see the activation STE"
    assert any(f"surrogate.activation_ste.threshold: implementation declares {threshold}, contract says 2688.0"
               in line for line in report.failures)
    print(f"threshold {threshold:g}: dX rel_l2 = {worst_input_rel_l2(report):.3e}")


def test_planted_identity_instead_of_clipped_is_caught(bf16_context):
    candidate, reference, x = make_pair(bf16_context, 257, seed=0, activation_ste=STE("identity"))
    report = compare(candidate, reference, x)
    bad = failing(report)
    assert ("input[0]", "tolerance") in bad and not {item for item, _ in bad} & {"weight", "bias"}, report.failures
    assert any("surrogate.activation_ste.kind: implementation declares 'identity', contract says 'clipped'" in line
               for line in report.failures), report.failures
    print(f"identity STE: dX rel_l2 = {worst_input_rel_l2(report):.3e}")


def test_planted_zero_derivative_at_the_threshold_is_caught(bf16_context):
    candidate, reference, x = make_pair(bf16_context, 257, seed=0,
                                        activation_ste=STE("clipped", threshold=2688.0, value_at_threshold=0.0))
    report = compare(candidate, reference, x)
    assert ("input[0]", "tolerance") in failing(report), report.failures
    print(f"derivative 0 at the threshold: dX rel_l2 = {worst_input_rel_l2(report):.3e}")


def test_planted_master_dx_is_caught(bf16_context):
    candidate, reference, x = make_pair(bf16_context, 257, seed=0, dx_weight="master")
    report = compare(candidate, reference, x)
    bad = failing(report)
    assert ("input[0]", "tolerance") in bad, report.failures
    assert not {item for item, _ in bad} & {"weight", "bias"}, "dW and db do not depend on W_ref"
    assert any("surrogate.dx_weight: implementation declares 'master'" in line for line in report.failures)
    print(f"master dX vs dequantized reference rel_l2 = {worst_input_rel_l2(report):.3e}")


def test_reference_graph_never_reaches_the_candidate_backward(bf16_context):
    candidate, reference, x = make_pair(bf16_context, 5, seed=0)
    y = reference(x)
    assert torch.equal(y, candidate(x.detach()))
    assert "VllmNVFP4LinearFunctionBackward" not in graph_functions(y)
    assert "VllmNVFP4LinearFunctionBackward" in graph_functions(candidate(x))
    y.backward(torch.ones_like(y))
    assert x.grad is not None and reference.weight.grad is not None and reference.bias.grad is not None

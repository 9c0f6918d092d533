"""The op registry drives layer 1: every registered case passes with its contract's tolerances across
5 seeds, every default dY kind (DY_KINDS) and M = 1 / 37 / 300; the coverage check fails when a case
is removed, a home is unregistered or a contract name is misspelled; every case runs the autograd
function it names."""
import dataclasses
import os

import pytest

from megatron_vllm_align.contracts import default_contracts
from megatron_vllm_align.ops import registry
from megatron_vllm_align.ops.registry import (
    CaseContexts,
    Op,
    coverage_gaps,
    graph_functions,
    layer1_cases,
    op_names,
    registered_ops,
)
from megatron_vllm_align.validation import DY_KINDS
from megatron_vllm_align.validation.layer1_suite import run_layer1_suite

OPS = registered_ops()
UNBUILT = CaseContexts(bf16=None, fp8=None, moe=None)   # listing cases touches no context
CASE_NAMES = [case.name for case in layer1_cases(UNBUILT)]


@pytest.fixture(scope="module")
def cases(case_contexts):
    return {case.name: case for case in layer1_cases(case_contexts)}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_registered_case_passes_layer1(cases, name):
    case = cases[name]
    reports = run_layer1_suite([case], seeds=range(5))
    assert len(reports) == len(case.token_counts) * 5
    failures = [line for r in reports for line in r.failures]
    assert not failures, "\n".join(failures[:20])
    expected_kinds = set(DY_KINDS)
    assert {c.dy_kind for r in reports for c in r.checks} == expected_kinds
    assert {c.item for r in reports for c in r.checks} == set(case.variables)


#: the first case of each autograd function whose backward is the linear VJP (``ops.dense_linear.vjp``)
LINEAR_VJP_CASES = list({case.function.__name__: case.name for case in reversed(layer1_cases(UNBUILT))
                         if case.function.__name__ in {
                             "DenseLinearFunction", "VllmFP8LinearFunction", "FP8LinearFunction", "MoERouterFunction",
                             "VllmNVFP4LinearFunction", "OutputLogitsFunction", "RoutedExpertsFunction",
                             "SharedExpertFunction"}}.values())


@pytest.mark.parametrize("name", LINEAR_VJP_CASES)
def test_linear_case_passes_layer1_with_the_fp32_backward_precision(cases, name):
    """``align.backward_precision: fp32`` is held to the same contract tolerances as the library's
    backward (2 seeds, every dY kind and token count), and the precision is restored after the block."""
    from megatron_vllm_align.ops.dense_linear import backward_precision, current_backward_precision

    case = cases[name]
    with backward_precision("fp32"):
        reports = run_layer1_suite([case], seeds=range(2))
    assert current_backward_precision() == "library"
    failures = [line for r in reports for line in r.failures]
    assert not failures, "\n".join(failures[:20])
    assert len(reports) == len(case.token_counts) * 2


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_runs_the_function_it_names(cases, name):
    case = cases[name]
    candidate, _, inputs = case.build(0, case.token_counts[-1])
    assert f"{case.function.__name__}Backward" in graph_functions(candidate(*inputs))


def test_every_op_home_is_registered_and_covered(cases):
    assert sorted(OPS) == op_names()
    assert coverage_gaps(OPS, cases.values()) == []
    registered_contracts = sorted(c for op in OPS.values() for c in op.contracts)
    assert registered_contracts == sorted(default_contracts()), "every default contract has one op home"


def test_removing_a_case_is_a_coverage_gap():
    without = [case for case in layer1_cases(UNBUILT) if case.function.__name__ != "OutputLogitsFunction"]
    assert coverage_gaps(OPS, without) == ["ops/output_layer: OutputLogitsFunction has no layer-1 case"]
    fused_only = [case for case in layer1_cases(UNBUILT) if case.function.__name__ != "RMSNormFunction"]
    assert coverage_gaps(OPS, fused_only) == ["ops/rms_norm: RMSNormFunction has no layer-1 case"]


def test_unregistered_home_and_misspelled_names_are_gaps():
    cases = layer1_cases(UNBUILT)
    missing = {name: op for name, op in OPS.items() if name != "attention"}
    assert "ops/attention: no OP registered in its case.py" in coverage_gaps(missing, cases)
    renamed = {**OPS, "rms_norm": dataclasses.replace(OPS["rms_norm"], contracts=("rmsnorm",))}
    gaps = coverage_gaps(renamed, cases)
    assert any("VllmRMSNorm.contract_name = 'rms_norm' is not one of ('rmsnorm',)" in gap for gap in gaps)
    assert any("ops/rms_norm: OP is named 'rms_norm' with contracts ('rmsnorm',)" in gap for gap in gaps)
    silent = {**OPS, "nvfp4_linear": Op("nvfp4_linear", ("nvfp4_linear",), None)}
    assert "ops/nvfp4_linear: no layer-1 cases and no reason why" in coverage_gaps(silent, cases)


def test_op_names_are_the_package_folders():
    root = os.path.dirname(registry.__file__)
    folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("_"))
    assert op_names() == folders

"""Declared implementation attributes compared with a contract."""

from __future__ import annotations

import pytest

from megatron_vllm_align.contracts import (
    STE,
    ContractError,
    contract_mismatches,
    get_default_contract,
)

FP8 = get_default_contract("fp8_linear_per_channel")
NVFP4 = get_default_contract("nvfp4_linear")


def test_consistent_declarations_give_no_mismatch():
    assert contract_mismatches(
        FP8, case="B", dx_weight="dequantized", activation_ref="quantized",
        weight_ste=STE("identity"), activation_ste={"kind": "identity"}, backward_kind="reused",
        backward_implementation="torch:matmul",
        scales={"input": "stop_gradient", "weight": "stop_gradient"},
        saved=["weight_scale", "weight_fp8", "input_scale", "input_fp8"]) == []
    assert contract_mismatches(
        NVFP4, activation_ste=STE("clipped", threshold=2688, value_at_threshold=1),
        weight_ste={"kind": "identity", "threshold": None}) == []
    assert contract_mismatches(FP8) == []


def test_dx_from_master_where_the_contract_says_dequantized():
    lines = contract_mismatches(FP8, dx_weight="master", activation_ref="quantized")
    assert lines == ["fp8_linear_per_channel: surrogate.dx_weight: implementation declares "
                     "'master', contract says 'dequantized'"]


def test_clipped_threshold_that_differs_from_the_contract():
    lines = contract_mismatches(NVFP4, activation_ste={"kind": "clipped", "threshold": 448.0,
                                                       "value_at_threshold": 1.0})
    assert lines == ["nvfp4_linear: surrogate.activation_ste.threshold: implementation declares "
                     "448.0, contract says 2688.0"]
    lines = contract_mismatches(NVFP4, activation_ste=STE("clipped", threshold=2688.0,
                                                          value_at_threshold=0.0))
    assert len(lines) == 1 and "value_at_threshold" in lines[0]


def test_every_kind_of_difference_is_reported():
    lines = contract_mismatches(
        FP8, case="A", weight_ste=STE("clipped", threshold=448.0, value_at_threshold=1.0),
        backward_kind="custom_vjp", backward_implementation="transformer_engine:te_linear",
        scales={"weight": "trainable", "input": "stop_gradient"},
        saved=["input", "weight_fp8", "weight_scale"])
    fields = [line.split(": ")[1] for line in lines]
    assert fields == ["case", "surrogate.weight_ste.kind", "surrogate.weight_ste.threshold",
                      "surrogate.weight_ste.value_at_threshold", "backward.kind",
                      "backward.implementations", "trainable.scales", "save_recompute.save"]
    assert "missing ['input_fp8', 'input_scale'], extra ['input']" in lines[-1]


def test_unknown_declarations_are_errors_not_silent_passes():
    with pytest.raises(ContractError, match="unknown declaration 'dx_wieght'; declarable: case"):
        contract_mismatches(FP8, dx_wieght="master")
    with pytest.raises(ContractError, match="unknown STE attribute 'thresh'") as caught:
        contract_mismatches(NVFP4, activation_ste={"thresh": 6.0})
    assert caught.value.field == "surrogate.activation_ste"
    assert caught.value.contract == "nvfp4_linear"

"""Validation of gradient contracts: every rule fails with a ContractError naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_vllm_align.contracts import (
    STE,
    ContractError,
    Surrogate,
    contract_from_dict,
    get_default_contract,
)


def _set(path: str, value):
    """Mutation that sets the value at a dotted path ("a.b[1].c") of a contract dict."""
    def mutate(data):
        *parents, last = path.replace("[", ".[").split(".")
        node = data
        for part in parents:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        if last.startswith("["):
            node[int(last[1:-1])] = value
        else:
            node[last] = value
    return mutate


def _delete(path: str):
    def mutate(data):
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        del node[last]
    return mutate


# (base contract, mutation, field named by the error, fragment of the message)
CASES = {
    "unknown top-level field": (
        "dense_linear", _set("colour", "red"), "colour", "allowed: module_class, case"),
    "unknown nested field": (
        "fp8_linear_per_channel", _set("surrogate.weight_ste.thresh", 448.0),
        "surrogate.weight_ste.thresh", "allowed: kind, threshold, value_at_threshold"),
    "unknown field in a list item": (
        "fp8_linear_per_channel", _set("visible_forward.quantize_positions[1].scale", 1.0),
        "visible_forward.quantize_positions[1].scale", "QuantizePosition"),
    "missing dx_weight": (
        "fp8_linear_per_channel", _delete("surrogate.dx_weight"), "surrogate.dx_weight",
        "missing required field"),
    "missing reasoning": (
        "rms_norm", _delete("reference.reasoning"), "reference.reasoning", "missing required"),
    "wrong type: text for a number": (
        "dense_linear", _set("reference.tolerances.*.rtol", "1e-3"),
        "reference.tolerances.*.rtol", "write 1.0e-6"),
    "wrong type: text for a list": (
        "dense_linear", _set("trainable.variables", "input"), "trainable.variables",
        "expected a list of a string"),
    "wrong type: list for a record": (
        "dense_linear", _set("surrogate", []), "surrogate", "expected a mapping for Surrogate"),
    "wrong type: bool for a number": (
        "dense_linear", _set("reference.tolerances.*.atol", True),
        "reference.tolerances.*.atol", "expected a number"),
    "infinite tolerance": (
        "dense_linear", _set("reference.tolerances.*.rel_l2", float("inf")),
        "reference.tolerances.*.rel_l2", "finite"),
    "negative tolerance": (
        "dense_linear", _set("reference.tolerances.*.rtol", -1.0),
        "reference.tolerances.*.rtol", ">= 0"),
    "invalid dx_weight value": (
        "fp8_linear_per_channel", _set("surrogate.dx_weight", "dequant"), "surrogate.dx_weight",
        "allowed: master, dequantized, not_applicable"),
    "invalid case": ("dense_linear", _set("case", "D"), "case", "allowed: A, B, C, B+C"),
    "invalid STE kind": (
        "fp8_linear_per_channel", _set("surrogate.weight_ste.kind", "straight"),
        "surrogate.weight_ste.kind", "allowed: identity, clipped, none"),
    "invalid metric": (
        "dense_linear", _set("reference.metrics", ["rel_l2", "max_abs_error", "l1"]),
        "reference.metrics[2]", "allowed: max_abs_error"),
    "clipped STE without threshold": (
        "fp8_linear_per_channel", _set("surrogate.activation_ste", {"kind": "clipped",
                                                                    "value_at_threshold": 1.0}),
        "surrogate.activation_ste.threshold", "positive threshold"),
    "clipped STE without value_at_threshold": (
        "fp8_linear_per_channel", _set("surrogate.activation_ste", {"kind": "clipped",
                                                                    "threshold": 448.0}),
        "surrogate.activation_ste.value_at_threshold", "0.0 or 1.0"),
    "clipped STE with value 0.5 at the threshold": (
        "nvfp4_linear", _set("surrogate.activation_ste.value_at_threshold", 0.5),
        "surrogate.activation_ste.value_at_threshold", "0.0 or 1.0"),
    "threshold on an identity STE": (
        "fp8_linear_per_channel", _set("surrogate.weight_ste.threshold", 448.0),
        "surrogate.weight_ste.threshold", "only a clipped STE"),
    "dx_weight not stated for a quantized weight": (
        "fp8_linear_per_channel", _set("surrogate.dx_weight", "not_applicable"),
        "surrogate.dx_weight", "must be stated as 'master' or 'dequantized'"),
    "dx_weight master without a quantized weight": (
        "dense_linear", _set("surrogate.dx_weight", "master"), "surrogate.dx_weight",
        "meaningless: the forward quantizes no weight"),
    "dx_weight dequantized without a quantized weight": (
        "rms_norm", _set("surrogate.dx_weight", "dequantized"), "surrogate.dx_weight",
        "meaningless"),
    "activation_ref without a quantized activation": (
        "dense_linear", _set("surrogate.activation_ref", "quantized"),
        "surrogate.activation_ref", "quantizes no activation"),
    "no STE for a quantized weight": (
        "fp8_linear_per_channel", _set("surrogate.weight_ste", {"kind": "none"}),
        "surrogate.weight_ste.kind", "'identity' or 'clipped'"),
    "STE on an unquantized activation": (
        "dense_linear", _set("surrogate.activation_ste", {"kind": "identity"}),
        "surrogate.activation_ste.kind", "does not quantize"),
    "case B without any STE": ("dense_linear", _set("case", "B"), "case", "at least one"),
    "case A with quantization": ("fp8_linear_block128", _set("case", "A"), "case", "use 'B'"),
    "case C with a reused backward": (
        "routed_experts", _set("backward.kind", "reused"), "backward.kind", "must be 'glue'"),
    "case B with glue": (
        "fp8_linear_per_tensor", _set("backward.kind", "glue"), "backward.kind", "'B+C'"),
    "scale handling missing for a quantized tensor": (
        "fp8_linear_per_channel", _set("trainable.scales", {"weight": "stop_gradient"}),
        "trainable.scales", "['input']"),
    "scale handling for an unquantized tensor": (
        "dense_linear", _set("trainable.scales", {"weight": "fixed"}), "trainable.scales",
        "does not quantize"),
    "invalid scale handling": (
        "fp8_linear_per_channel", _set("trainable.scales.weight", "frozen"),
        "trainable.scales.weight", "allowed: fixed, stop_gradient, trainable"),
    "clamp that is not the format maximum": (
        "fp8_linear_per_channel", _set("visible_forward.quantize_positions[0].clamp", "±488"),
        "visible_forward.quantize_positions[0].clamp", "±448"),
    "invalid scale granularity": (
        "fp8_linear_per_channel",
        _set("visible_forward.quantize_positions[0].scale_granularity", "per_row"),
        "visible_forward.quantize_positions[0].scale_granularity", "block_<rows>x<cols>"),
    "quantized forward without a dequantize position": (
        "fp8_linear_per_tensor", _set("visible_forward.dequantize_positions", []),
        "visible_forward.dequantize_positions", "must state where it dequantizes"),
    "kernel without a library": (
        "rms_norm", _set("visible_forward.kernel", "rms_norm"), "visible_forward.kernel",
        "'library:name'"),
    "tolerance for a gradient that is not trainable": (
        "rms_norm", _set("reference.tolerances.weight", {"atol": 0.0, "rtol": 0.1,
                                                         "rel_l2": 0.1}),
        "reference.tolerances.weight", "not a trainable variable"),
    "gradient without a tolerance": (
        "dense_linear", _set("reference.tolerances", {"input": {"atol": 0.0, "rtol": 0.1,
                                                                "rel_l2": 0.1}}),
        "reference.tolerances", "['master_weight', 'bias']"),
    "metrics without rel_l2": (
        "dense_linear", _set("reference.metrics", ["max_abs_error", "cosine"]),
        "reference.metrics", "'rel_l2'"),
    "empty reasoning": (
        "dense_linear", _set("reference.reasoning", "  \n"), "reference.reasoning",
        "non-empty"),
    "fixed discrete state that is also trainable": (
        "moe_router", _set("discrete_state.fixed", ["topk_ids", "input"]),
        "discrete_state.fixed", "['input']"),
    "duplicate variable": (
        "dense_linear", _set("trainable.variables", ["input", "input"]), "trainable.variables",
        "duplicate"),
    "quantized tensor name that is not an identifier": (
        "fp8_linear_per_tensor", _set("visible_forward.quantize_positions[0].tensor", "w 1"),
        "visible_forward.quantize_positions[0].tensor", "not an identifier"),
    "implementation without a library": (
        "dense_linear", _set("backward.implementations", ["general_gemm"]),
        "backward.implementations[0]", "'library:name'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_contract_names_the_field(name, contract_data):
    base, mutate, field, fragment = CASES[name]
    data = contract_data(base)
    mutate(data)
    with pytest.raises(ContractError) as caught:
        contract_from_dict(data)
    assert caught.value.field == field
    assert caught.value.contract == base
    assert fragment in str(caught.value)
    assert f"contract {base!r}, field {field!r}" in str(caught.value)


def test_module_class_must_be_an_identifier(contract_data):
    data = contract_data("rms_norm")
    data["module_class"] = "rms norm"
    with pytest.raises(ContractError, match="not an identifier") as caught:
        contract_from_dict(data)
    assert (caught.value.contract, caught.value.field) == ("rms norm", "module_class")


def test_dx_weight_has_no_default():
    dx_weight = {f.name: f for f in dataclasses.fields(Surrogate)}["dx_weight"]
    assert dx_weight.default is dataclasses.MISSING
    with pytest.raises(TypeError, match="dx_weight"):
        Surrogate(activation_ref="quantized", weight_ste=STE("identity"),  # type: ignore[call-arg]
                  activation_ste=STE("identity"))


def test_python_construction_is_validated_and_names_the_contract():
    with pytest.raises(ContractError, match="positive threshold") as caught:
        STE("clipped", value_at_threshold=1.0)
    assert caught.value.field == "threshold"
    dense = get_default_contract("dense_linear")
    master = dataclasses.replace(dense.surrogate, dx_weight="master")
    with pytest.raises(ContractError) as caught:
        dataclasses.replace(dense, surrogate=master)
    assert (caught.value.contract, caught.value.field) == ("dense_linear", "surrogate.dx_weight")


def test_records_are_frozen_and_normalised():
    ste = STE("clipped", threshold=448, value_at_threshold=1)
    assert ste.threshold == 448.0 and isinstance(ste.threshold, float)
    assert isinstance(ste.value_at_threshold, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ste.threshold = 6.0  # type: ignore[misc]
    contract = get_default_contract("dense_linear")
    assert contract.trainable.variables == ("input", "master_weight", "bias")


def test_tolerance_for_uses_the_specific_entry_then_the_wildcard():
    experts = get_default_contract("routed_experts").reference
    assert experts.tolerance_for("input").rel_l2 == 2.0 ** -8 * 4
    assert experts.tolerance_for("expert_w2").rel_l2 == 2.0 ** -8 * 3
    with pytest.raises(ContractError, match="no tolerance for gradient 'bias'"):
        experts.tolerance_for("bias")
    assert get_default_contract("dense_linear").reference.tolerance_for("bias").rel_l2 == 2.0 ** -7

"""FP8 linear <-> gradient contract: configs built from the default contracts, refused contracts,
and what a module declares, checked with contract_mismatches."""
import dataclasses

import pytest
import torch

from megatron_vllm_align.contracts import STE, ContractError, contract_mismatches, get_default_contract
from megatron_vllm_align.ops.fp8_linear.emulated import (
    FP8Linear,
    FP8LinearConfig,
    default_fp8_linear_config,
)
from megatron_vllm_align.quant import DequantFP8Gemm, FP8Scheme, fp8_position, vllm_fp8_scaled_mm

CLIPPED = STE("clipped", threshold=448.0, value_at_threshold=1.0)


def with_position(contract, tensor, **changes):
    """``contract`` with fields of quantize position ``tensor`` replaced (re-validated)."""
    forward = contract.visible_forward
    positions = tuple(dataclasses.replace(p, **changes) if p.tensor == tensor else p
                      for p in forward.quantize_positions)
    return dataclasses.replace(contract, visible_forward=dataclasses.replace(forward, quantize_positions=positions))


def with_fields(contract, record, **changes):
    """``contract`` with fields of its sub-record ``record`` (e.g. "surrogate") replaced."""
    return dataclasses.replace(contract, **{record: dataclasses.replace(getattr(contract, record), **changes)})


def static_weight_contract(weight_ste=CLIPPED):
    """The per-tensor contract with a fixed (calibrated) weight scale and the given weight STE."""
    contract = with_fields(get_default_contract("fp8_linear_per_tensor"), "trainable",
                           scales={"weight": "fixed", "input": "stop_gradient"})
    contract = with_fields(contract, "surrogate", weight_ste=weight_ste)
    return with_fields(contract, "save_recompute",
                       save=(*contract.save_recompute.save, "master_weight"))


@pytest.mark.parametrize("name, activation, weight, gemm", [
    ("fp8_linear_per_channel", FP8Scheme("per_token"), FP8Scheme("per_channel"), vllm_fp8_scaled_mm),
    ("fp8_linear_per_tensor", FP8Scheme("per_token"), FP8Scheme("per_tensor"), vllm_fp8_scaled_mm),
    ("fp8_linear_block128", FP8Scheme("per_token_group", block_shape=(1, 128)),
     FP8Scheme("block", block_shape=(128, 128)), None),
])
def test_default_contracts_build_configs_that_declare_no_mismatch(name, activation, weight, gemm):
    contract = get_default_contract(name)
    config = FP8LinearConfig.from_contract(contract)
    assert (config.activation_scheme, config.weight_scheme) == (activation, weight)
    assert (config.dx_weight, config.dw_activation) == ("dequantized", "dequantized")
    assert config.activation_ste == config.weight_ste == STE("identity")
    assert config.activation_scale is None and config.weight_scale is None
    if gemm is None:
        assert config.visible_gemm == DequantFP8Gemm(activation, weight)
    else:
        assert config.visible_gemm is gemm
    layer = FP8Linear(200, 96, config=config)
    assert contract_mismatches(contract, **layer.declared_surrogate()) == []
    assert layer.declared_surrogate()["saved"] == ("weight_fp8", "weight_scale", "input_fp8", "input_scale")


def test_default_config_is_the_per_channel_contract():
    config = default_fp8_linear_config()
    contract_config = FP8LinearConfig.from_contract(get_default_contract("fp8_linear_per_channel"))
    for field in dataclasses.fields(FP8LinearConfig):
        assert getattr(config, field.name) == getattr(contract_config, field.name), field.name
    assert default_fp8_linear_config("master").dx_weight == "master"


def test_conventions_and_visible_gemm_follow_the_contract():
    contract = with_fields(get_default_contract("fp8_linear_per_channel"), "surrogate",
                           dx_weight="master", activation_ref="original")
    config = FP8LinearConfig.from_contract(contract, visible_gemm=DequantFP8Gemm(FP8Scheme("per_token"),
                                                                                 FP8Scheme("per_channel")))
    assert (config.dx_weight, config.dw_activation) == ("master", "original")
    assert isinstance(config.visible_gemm, DequantFP8Gemm)
    declared = config.declared_surrogate()
    assert declared["saved"] == ("master_weight", "input")
    assert contract_mismatches(contract, **declared) == [
        "fp8_linear_per_channel: save_recompute.save: implementation saves ['input', 'master_weight'], contract "
        "says ['input_fp8', 'input_scale', 'weight_fp8', 'weight_scale'] (missing ['input_fp8', 'input_scale', "
        "'weight_fp8', 'weight_scale'], extra ['input', 'master_weight'])"]


def test_master_candidate_against_the_dequantized_contract_is_reported():
    contract = get_default_contract("fp8_linear_per_channel")
    layer = FP8Linear(64, 32, config=default_fp8_linear_config("master"))
    lines = contract_mismatches(contract, **layer.declared_surrogate())
    assert lines[0] == ("fp8_linear_per_channel: surrogate.dx_weight: implementation declares 'master', "
                        "contract says 'dequantized'")
    assert len(lines) == 2 and "save_recompute.save" in lines[1]


def test_clipped_ste_with_a_fixed_scale():
    contract = static_weight_contract()
    scale = torch.tensor([0.001])
    config = FP8LinearConfig.from_contract(contract, static_scales={"weight": scale})
    assert config.weight_scheme == FP8Scheme("per_tensor", static=True) and config.weight_scale is scale
    assert config.weight_ste == CLIPPED and config.visible_gemm is vllm_fp8_scaled_mm
    assert contract_mismatches(contract, **config.declared_surrogate()) == []
    layer = FP8Linear(64, 32, config=config)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-1, 1, 32 * 64).reshape(32, 64))
    layer(torch.randn(5, 64)).sum().backward()
    inside = layer.weight.detach().double().abs() <= 448 * scale.double()
    assert 0 < inside.float().mean() < 1
    assert (layer.weight.grad[~inside] == 0).all() and (layer.weight.grad[inside] != 0).all()
    other = dataclasses.replace(config, weight_ste=STE("clipped", threshold=300.0, value_at_threshold=1.0))
    assert contract_mismatches(contract, **other.declared_surrogate()) == [
        "fp8_linear_per_tensor: surrogate.weight_ste.threshold: implementation declares 300.0, contract says 448.0"]


def test_static_activation_uses_the_native_gemm():
    contract = with_position(get_default_contract("fp8_linear_per_channel"), "input", scale_granularity="per_tensor")
    contract = with_fields(contract, "trainable", scales={"weight": "stop_gradient", "input": "fixed"})
    config = FP8LinearConfig.from_contract(contract, static_scales={"input": torch.tensor([0.01])})
    assert config.activation_scheme == FP8Scheme("per_tensor", static=True)
    assert config.visible_gemm == DequantFP8Gemm(FP8Scheme("per_tensor", static=True), FP8Scheme("per_channel"))
    y = FP8Linear(64, 32, config=config)(torch.randn(5, 64))
    assert y.shape == (5, 32) and torch.isfinite(y).all()


def refusal(contract, field, message, **kwargs):
    with pytest.raises(ContractError, match=message) as caught:
        FP8LinearConfig.from_contract(contract, **kwargs)
    assert caught.value.field == field
    return caught.value


def test_contracts_it_cannot_honour_are_refused_naming_the_field():
    per_channel = get_default_contract("fp8_linear_per_channel")
    refusal(get_default_contract("dense_linear"), "case", "FP8Linear is case 'B'")
    refusal(get_default_contract("nvfp4_linear"), "visible_forward.quantize_positions[1].format",
            "an FP8 activation needs format one of fp8_e4m3, fp8_e5m2, got 'nvfp4_e2m1'")
    refusal(with_fields(per_channel, "backward", implementations=("transformer_engine:general_gemm",)),
            "backward.implementations", "'torch:matmul', which the contract does not allow")
    refusal(with_fields(per_channel, "backward", accumulation="bf16"), "backward.accumulation", "fp32")
    refusal(with_fields(per_channel, "backward", kind="custom_vjp"), "backward.kind", "'reused'")
    refusal(with_position(per_channel, "input", rounding="stochastic"),
            "visible_forward.quantize_positions[1].rounding", "needs rounding 'rne'")
    refusal(with_position(per_channel, "weight", scale_granularity="block_128"),
            "visible_forward.quantize_positions[0].scale_granularity", "got 'block_128'")
    refusal(with_fields(per_channel, "trainable", scales={"weight": "trainable", "input": "stop_gradient"}),
            "trainable.scales.weight", "'stop_gradient' \\(dynamic\\) or 'fixed' \\(static\\)")
    refusal(with_fields(per_channel, "surrogate", activation_ste=CLIPPED), None,
            "FP8Linear cannot honour it: .*activation_ste is clipped .* amax scaling never saturates")
    refusal(static_weight_contract(), "trainable.scales", r"exactly the tensors with a 'fixed' scale, \['weight'\]")
    refusal(per_channel, "trainable.scales", r"got \['weight'\]", static_scales={"weight": torch.ones(1)})
    static_channel = with_fields(per_channel, "trainable", scales={"weight": "fixed", "input": "stop_gradient"})
    refusal(static_channel, None, "a static scheme must be 'per_tensor'", static_scales={"weight": torch.ones(1)})
    with pytest.raises(TypeError, match="GradientContract"):
        FP8LinearConfig.from_contract({"case": "B"})


def test_fp8_position_reads_the_contract():
    position = fp8_position(get_default_contract("fp8_linear_block128"), "activation")
    assert position.tensor == "input"
    assert position.scheme == FP8Scheme("per_token_group", block_shape=(1, 128))
    e5m2 = with_position(get_default_contract("fp8_linear_per_channel"), "weight", format="fp8_e5m2",
                         clamp="±57344")
    assert fp8_position(e5m2, "weight").scheme == FP8Scheme("per_channel", dtype=torch.float8_e5m2)
    with pytest.raises(ContractError, match="needs exactly one quantized weight, found 0"):
        fp8_position(get_default_contract("dense_linear"), "weight")

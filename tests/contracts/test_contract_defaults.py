"""The shipped default contracts: the decisions they state, and how to look them up."""

from __future__ import annotations

import pytest

from megatron_vllm_align.contracts import (
    ContractError,
    contracts_from_yaml,
    default_contracts,
    get_default_contract,
)
from megatron_vllm_align.contracts.defaults import default_contract_files

U = 2.0 ** -8  # bf16 unit roundoff
EXPECTED = {"dense_linear", "fp8_linear_per_channel", "fp8_linear_per_tensor",
            "fp8_linear_block128", "nvfp4_linear", "rms_norm", "silu_and_mul", "rotary_embedding",
            "attention", "moe_router", "routed_experts", "selected_logprob", "processed_logprob", "shared_expert",
            "output_layer"}
FP8 = {"fp8_linear_per_channel": ("per_channel", "per_token"),
       "fp8_linear_per_tensor": ("per_tensor", "per_token"),
       "fp8_linear_block128": ("block_128x128", "per_token_group_128")}


def test_all_expected_defaults_exist():
    assert set(default_contracts()) == EXPECTED


def test_each_file_holds_the_contract_it_is_named_after_in_its_op_home():
    files = default_contract_files()
    assert len(files) == len(EXPECTED)
    for op, file_name, text in files:
        assert list(contracts_from_yaml(text)) == [file_name.removesuffix(".yaml")]
        assert file_name.startswith(op), f"ops/{op}/{file_name}: a contract lives in the home of its name"


def test_lookup_errors_list_the_available_names():
    with pytest.raises(ContractError, match="available: attention, dense_linear") as caught:
        get_default_contract("dense_linaer")
    assert caught.value.contract == "dense_linaer"


def test_default_contracts_returns_a_new_dict():
    first = default_contracts()
    first.pop("attention")
    assert "attention" in default_contracts()


def test_dense_linear_reuses_te_gemm_else_torch():
    dense = get_default_contract("dense_linear")
    assert dense.case == "A"
    assert dense.backward.kind == "reused"
    assert dense.backward.implementations == ("transformer_engine:general_gemm", "torch:matmul")
    assert dense.surrogate.dx_weight == "not_applicable"


@pytest.mark.parametrize("name", sorted(FP8))
def test_fp8_linears_state_their_quantizers_and_surrogate(name):
    contract = get_default_contract(name)
    weight, activation = contract.visible_forward.quantize_positions
    assert (weight.tensor, weight.role, activation.tensor, activation.role) == (
        "weight", "weight", "input", "activation")
    assert (weight.scale_granularity, activation.scale_granularity) == FP8[name]
    assert {weight.format, activation.format} == {"fp8_e4m3"}
    assert {weight.rounding, activation.rounding} == {"rne"}
    assert activation.clamp == "±448"
    assert contract.case == "B"
    assert contract.surrogate.dx_weight == "dequantized"
    assert contract.surrogate.activation_ref == "quantized"
    surrogate = contract.surrogate
    assert surrogate.weight_ste.kind == surrogate.activation_ste.kind == "identity"
    assert contract.trainable.scales == {"weight": "stop_gradient", "input": "stop_gradient"}
    assert contract.reference.tolerance_for("input").rel_l2 == 3 * U


def test_nvfp4_two_level_scales_and_clipped_activation_ste():
    contract = get_default_contract("nvfp4_linear")
    for position in contract.visible_forward.quantize_positions:
        assert (position.format, position.scale_granularity, position.scale_dtype,
                position.global_scale, position.clamp) == (
            "nvfp4_e2m1", "block_16", "fp8_e4m3", "fp32_per_tensor", "±6")
    assert contract.trainable.scales["input.global"] == "fixed"
    ste = contract.surrogate.activation_ste
    assert (ste.kind, ste.threshold, ste.value_at_threshold) == ("clipped", 6.0 * 448.0, 1.0)
    assert "input_clip_mask" in contract.save_recompute.save


def test_case_a_modules_use_vllm_kernels_and_closed_forms():
    for name, kernel in [("rms_norm", "vllm:RMSNorm.forward_native"),
                         ("silu_and_mul", "vllm:SiluAndMul.forward_native"),
                         ("rotary_embedding", "vllm:_C.rotary_embedding")]:
        contract = get_default_contract(name)
        assert contract.case == "A"
        assert contract.visible_forward.kernel == kernel
        assert contract.visible_forward.accumulation == "fp32"
        assert contract.backward.kind == "custom_vjp"
        assert contract.backward.implementations == ("torch:closed_form",)
    assert get_default_contract("rotary_embedding").discrete_state.fixed == ("positions",)


def test_norm_and_activation_state_what_the_cpu_engine_runs():
    """docs/engine_facts.md: vLLM's native RMSNorm and SiluAndMul (two bf16 roundings), not
    _C.rms_norm / _C.silu_and_mul; the fused residual add normalises the unrounded fp32 sum."""
    for name in ("rms_norm", "silu_and_mul"):
        layout = get_default_contract(name).visible_forward.layout
        assert "two roundings" in layout and "is not called" in layout, name
    rms_norm = get_default_contract("rms_norm")
    assert "fused_add_rms_norm" in rms_norm.visible_forward.layout
    assert "unrounded fp32 s" in rms_norm.visible_forward.layout
    assert "residual" in rms_norm.trainable.variables and "residual" in rms_norm.save_recompute.save


def test_attention_recomputes_when_no_lse_is_output():
    attention = get_default_contract("attention")
    assert attention.trainable.variables == ("q", "k", "v")
    assert "GQA" in attention.visible_forward.layout
    assert "natural log" in attention.visible_forward.layout
    assert "outputs no LSE" in attention.save_recompute.recompute
    assert attention.reference.tolerance_for("q").rel_l2 == 4 * U


def test_moe_router_fixes_ids_and_differentiates_scores():
    router = get_default_contract("moe_router")
    assert router.discrete_state.fixed == ("topk_ids",)
    assert "topk_weights" in router.discrete_state.continuous_with_gradient
    assert "topk_ids" in router.save_recompute.save


def test_routed_experts_are_case_c_glue():
    experts = get_default_contract("routed_experts")
    assert (experts.case, experts.backward.kind) == ("C", "glue")
    assert "topk_weights" in experts.trainable.variables
    # The glue reuses the dense linear VJP per expert (ops.routed_experts.vjp -> ops.dense_linear.vjp).
    assert experts.backward.implementations == get_default_contract("dense_linear").backward.implementations


def test_selected_logprob_is_fp32_at_temperature_one():
    logprob = get_default_contract("selected_logprob")
    assert (logprob.visible_forward.input_dtype, logprob.visible_forward.output_dtype) == (
        "bf16", "fp32")
    assert "temperature 1" in logprob.visible_forward.layout
    assert "not vocab-parallel" in logprob.visible_forward.layout
    assert logprob.discrete_state.fixed == ("target_token_ids",)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_tolerances_are_whole_multiples_of_u_with_reasoning(name):
    reference = get_default_contract(name).reference
    for tolerance in reference.tolerances.values():
        assert tolerance.atol == 0.0
        assert tolerance.rtol == tolerance.rel_l2
        assert tolerance.rel_l2 / U in (2.0, 3.0, 4.0)
    assert "2^-8" in reference.reasoning
    assert "Measured" in reference.reasoning or "fails" in reference.reasoning

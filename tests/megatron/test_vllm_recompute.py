"""Activation recompute and gradient accumulation on the vLLM-forward model, on CPU.

Tolerance, fixed before running: recompute reruns the same deterministic forward (same vLLM
kernels, same inputs, same thread count) and the same backward on what it saves, so on CPU the
gradients must be bitwise equal to the run without recompute; likewise the gradients accumulated
over micro-batches must equal the bf16 sum of the per-micro-batch gradients (autograd accumulates
with one bf16 add). Every comparison below is therefore ``torch.equal``. No engine is started.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import PATCHES, cpu_patches
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear
from megatron_vllm_align.ops.vllm_context import EngineSpec, vllm_context

RECOMPUTE_CONFIGS = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective_core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective_core_attn_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}
# Forward calls per step of the modules each config reruns (2 layers; block recomputes layer 0 only).
EXPECTED_CALLS = {
    None: {"core_attention": 2, "mlp": 2, "layer": 2},
    "full_uniform": {"core_attention": 4, "mlp": 4, "layer": 4},
    "full_block": {"core_attention": 3, "mlp": 3, "layer": 3},
    "selective_core_attn": {"core_attention": 4, "mlp": 2, "layer": 2},
    "selective_core_attn_mlp": {"core_attention": 4, "mlp": 4, "layer": 2},
}
MICRO_BATCHES = ([[5, 9, 200, 31, 7, 7, 100, 3, 1, 64], list(range(40, 57))], [[11, 300, 2, 2, 500, 17, 99]])


def digest(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, sha1 of the bytes) of a tensor saved for backward."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha1(data).hexdigest()


def train_step(model: torch.nn.Module, micro_batches=MICRO_BATCHES) -> tuple[dict, Counter, Counter]:
    """Forward + backward of every micro-batch (loss = mean negative logprob / number of
    micro-batches); returns (grads, forward calls per module kind, saved-tensor digests)."""
    calls: Counter = Counter()
    saved: Counter = Counter()
    handles = []
    for layer in model.decoder.layers:
        for kind, module in (("core_attention", layer.self_attention.core_attention), ("mlp", layer.mlp),
                             ("layer", layer)):
            handles.append(module.register_forward_hook(lambda *_, kind=kind: calls.update([kind])))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[digest(tensor)] += 1
        return tensor

    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for batch in micro_batches:
            loss = -torch.cat(token_logprobs(model, batch)).mean() / len(micro_batches)
            loss.backward()
    for handle in handles:
        handle.remove()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return grads, calls, saved


@pytest.fixture(scope="module")
def plain_step(megatron_cpu, llama_dir, engine_context):
    return train_step(build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context), MICRO_BATCHES[:1])


def test_recompute_on_cpu_needs_the_checkpoint_rng_patch(megatron_cpu):
    others = [patch.name for patch in PATCHES if patch.name != "checkpoint_rng_states"]
    x = torch.randn(8, requires_grad=True)
    with cpu_patches(others), pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled") as raised:
        tensor_parallel.checkpoint(torch.sin, False, x)
    frames = [frame.name for frame in raised.traceback if "/megatron/core/" in str(frame.path)]
    assert frames[-1] == "_get_cuda_rng_state"


def test_recompute_replays_the_forward_random_numbers(megatron_cpu):
    """With the patch, the recomputed forward draws the same dropout mask (CPU generator and the
    tracker's states are restored); a wrong replay gives a different gradient."""
    def dropout_in_tracker(t: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            masked = F.dropout(t, 0.5, training=True)
        return F.dropout(masked, 0.5, training=True) * t

    x = torch.randn(256, dtype=torch.float64)
    grads = []
    for checkpointed in (False, True):
        leaf = x.clone().requires_grad_()
        state, tracker_states = torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()
        out = tensor_parallel.checkpoint(dropout_in_tracker, False, leaf) if checkpointed else dropout_in_tracker(leaf)
        torch.rand(1000)  # moves the CPU generator between forward and backward
        out.sum().backward()
        grads.append(leaf.grad)
        torch.set_rng_state(state)
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker_states)
    assert (grads[0] == 0).sum() > 50  # the masks dropped something
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("name", sorted(RECOMPUTE_CONFIGS))
def test_recompute_gives_the_same_gradients_and_saved_tensors(megatron_cpu, llama_dir, engine_context, plain_step,
                                                              name):
    model = build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context, **RECOMPUTE_CONFIGS[name])
    grads, calls, saved = train_step(model, MICRO_BATCHES[:1])
    plain_grads, plain_calls, plain_saved = plain_step
    assert plain_calls == Counter(EXPECTED_CALLS[None])
    assert calls == Counter(EXPECTED_CALLS[name]), "the configured modules were not recomputed"
    for param_name, grad in plain_grads.items():
        assert torch.equal(grads[param_name], grad), f"{param_name}: recompute changed the gradient"
    # Recompute never switches the surrogate: everything the plain step saved for backward is saved,
    # with the same dtype, shape and bytes, by the recomputing step (which also saves the checkpoint inputs).
    missing = plain_saved - saved
    assert not missing, f"{sum(missing.values())} saved tensors differ under recompute, e.g. {next(iter(missing))}"


def test_gradient_accumulation_over_micro_batches(megatron_cpu, llama_dir, engine_context):
    recompute = RECOMPUTE_CONFIGS["full_uniform"]
    accumulated, _, _ = train_step(build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context))
    accumulated_recompute, _, _ = train_step(
        build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context, **recompute))
    model = build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context)
    # Each micro-batch alone, with the same 1/2 loss scale: the accumulated gradient is their bf16 sum.
    parts = []
    for batch in MICRO_BATCHES:
        grads, _, _ = train_step(model, [batch])
        parts.append({name: grad / 2 for name, grad in grads.items()})  # exact: a power-of-two scale
    for name, grad in accumulated.items():
        assert torch.equal(grad, parts[0][name] + parts[1][name]), f"{name}: accumulation is not the sum"
        assert torch.equal(accumulated_recompute[name], grad), f"{name}: recompute changed the accumulated gradient"


def test_layernorm_recompute_is_refused(megatron_cpu, llama_dir, engine_context):
    with pytest.raises(ValueError, match=r"recompute_modules = \['layernorm'\]: \['layernorm'\] cannot be "
                                         r"recomputed by the vLLM-forward layer"):
        build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context, recompute_granularity="selective",
                          recompute_modules=["layernorm"])


@pytest.fixture(scope="module")
def fp8_context(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_engine_config")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16"}))
    return vllm_context(EngineSpec(str(path), quantization="fp8_per_channel"))


@pytest.mark.parametrize("dx_weight,dw_activation", [("dequantized", "dequantized"), ("master", "original")])
def test_fp8_linear_keeps_its_conventions_under_recompute(megatron_cpu, fp8_context, dx_weight, dw_activation):
    """The FP8 spec option does not exist yet; the FP8 module itself under Megatron's checkpoint:
    the recomputed pass saves the same quantized tensors (or master values) and gives the same grads."""
    torch.manual_seed(0)
    layer = VllmFP8Linear(256, 96, bias=True, vllm_context=fp8_context, prefix="model.layers.0.mlp.down_proj",
                          dx_weight=dx_weight, dw_activation=dw_activation)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grad_out = torch.randn(37, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    results = []
    for checkpointed in (False, True):
        saved: Counter = Counter()
        leaf = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.update([digest(t)]) or t, lambda t: t):
            out = tensor_parallel.checkpoint(layer, False, leaf) if checkpointed else layer(leaf)
            out.backward(grad_out)
        results.append((saved, leaf.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    (plain_saved, *plain_grads), (recomputed_saved, *recomputed_grads) = results
    fp8_saved = [key for key in plain_saved if key[0] == "torch.float8_e4m3fn"]
    assert len(fp8_saved) == (2 if dx_weight == "dequantized" else 0)  # weight_fp8 and input_fp8, or none
    assert not plain_saved - recomputed_saved
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, recomputed_grads, strict=True))

"""Training forward = inference forward for a mixture-of-experts model, against a real vLLM engine.

A tiny random Qwen3-MoE and a tiny random Qwen2-MoE (2 layers, both sparse, 8 experts, top-2,
hidden 256, expert FFN 128, bf16; the Qwen2-MoE with q/k/v biases and a sigmoid-gated shared
expert of FFN 192) built with save_pretrained are served, one after the other, by an in-process
engine with a bounded KV cache.
Ten prompts of unaligned lengths are submitted together (one prefill step) and a few alone. The
aligned model (``build_gpt_from_hf(..., align=True)``: vLLM's router and fused experts in the
``mlp`` slot) must give max |delta logprob| == 0.0 on every token. Megatron's native MoE layer
(local spec, ``align=False``) and HF transformers in bf16 are printed beside it (sanity bounds only).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from megatron_vllm_align.engine.hf_reference import hf_token_logprobs
from megatron_vllm_align.engine.tiny_models import (
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import (
    MOE_PATCHES,
    disable_cpu_compat,
    init_single_process_cpu,
)
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_moe import moe_layers

pytestmark = pytest.mark.engine

# Sanity bounds for the native / HF sides (not rounding bounds): besides bf16 rounding (dense stack:
# max 0.05, tests/engine/test_engine_reference.py), a token whose top-k margin is below bf16 noise
# picks another expert there, a discrete change (measured: max 0.044 native, 0.061 HF; means 3e-3).
ROUTING_FLIP_MAX_DELTA = 0.25
BF16_STACK_MEAN_DELTA = 0.01
TINY_MOES = {
    "qwen3_moe": (TinyModelConfig(architecture="qwen3_moe", num_experts=8, top_k=2, moe_intermediate_size=128,
                                  seed=11), "Qwen3MoeSparseMoeBlock"),
    "qwen2_moe": (TinyModelConfig(architecture="qwen2_moe", num_experts=8, top_k=2, moe_intermediate_size=128,
                                  shared_expert_intermediate_size=192, seed=12), "Qwen2MoeSparseMoeBlock"),
}
TINY_MOE = TINY_MOES["qwen3_moe"][0]  # vocabulary and layer count are the same for both
LENGTHS = (1, 7, 16, 17, 31, 33, 37, 64, 2, 5)
KV_CACHE_BYTES = 32 * 1024 * 1024


@pytest.fixture(scope="module", params=sorted(TINY_MOES, reverse=True))
def architecture(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, architecture):
    return build_tiny_hf_model(tmp_path_factory.mktemp("moe_engine") / f"tiny_{architecture}",
                               TINY_MOES[architecture][0])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_token_sequences(LENGTHS, vocab_size=TINY_MOE.vocab_size, seed=13)


@pytest.fixture(scope="module")
def moe_engine(moe_checkpoint):
    llm = start_reference_engine(moe_checkpoint, ReferenceEngineConfig(kv_cache_bytes=KV_CACHE_BYTES))
    yield llm
    shutdown_engine(llm)  # destroys torch.distributed: later users call init_single_process_cpu


@pytest.fixture(scope="module")
def engine_together(moe_engine, prompts) -> list[torch.Tensor]:
    return prompt_logprobs(moe_engine, prompts)


@pytest.fixture(scope="module")
def aligned_moe(moe_engine, moe_checkpoint):
    init_single_process_cpu(seed=1234)
    return build_gpt_from_hf(moe_checkpoint, align=True)


def _mlp_classes(worker) -> list[str]:
    """Runs inside the engine's worker (collective_rpc): the class of every decoder layer's mlp."""
    return [type(layer.mlp).__name__ for layer in worker.model_runner.model.model.layers]


def test_the_engine_runs_vllms_moe_block_in_every_layer(moe_engine, architecture):
    assert moe_engine.collective_rpc(_mlp_classes) == [[TINY_MOES[architecture][1]] * TINY_MOE.num_layers]


def test_the_aligned_layers_have_shared_experts_exactly_for_qwen2_moe(aligned_moe, architecture):
    shared = [layer.shared_experts is not None for layer in moe_layers(aligned_moe)]
    assert shared == [architecture == "qwen2_moe"] * TINY_MOE.num_layers


def test_aligned_moe_equals_the_engine_bitwise_all_at_once(max_delta, aligned_moe, prompts, engine_together,
                                                           architecture):
    assert len(moe_layers(aligned_moe)) == TINY_MOE.num_layers
    with torch.no_grad():
        ours = token_logprobs(aligned_moe, prompts)
    assert max_delta(f"{architecture} Megatron vLLM MoE spec (all at once)", ours, engine_together) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ours, engine_together, strict=True))


def test_aligned_moe_equals_the_engine_bitwise_one_at_a_time(max_delta, moe_engine, aligned_moe, prompts):
    chosen = prompts[1:4]
    engine_alone = [prompt_logprobs(moe_engine, [prompt])[0] for prompt in chosen]
    with torch.no_grad():
        ours = [token_logprobs(aligned_moe, [prompt])[0] for prompt in chosen]
    assert max_delta("Megatron vLLM MoE spec (one at a time)", ours, engine_alone) == 0.0


def test_a_perturbed_shared_expert_gate_is_no_longer_bitwise_equal(max_delta, aligned_moe, prompts, engine_together,
                                                                    architecture):
    """The shared expert takes part in the comparison: its gate moved by about one bf16 ulp shows."""
    if architecture != "qwen2_moe":
        pytest.skip("Qwen3-MoE has no shared expert")
    shared = moe_layers(aligned_moe)[1].shared_experts
    saved = shared.gate_weight.detach().clone()
    try:
        with torch.no_grad():
            shared.gate_weight.mul_(1 + 2 ** -7)
        shared.refresh_deployed()
        with torch.no_grad():
            ours = token_logprobs(aligned_moe, prompts)
        assert max_delta("Megatron vLLM MoE spec, shared-expert gate nudged", ours, engine_together) > 0.0
    finally:
        with torch.no_grad():
            shared.gate_weight.copy_(saved)
        shared.refresh_deployed()


def test_a_perturbed_expert_is_no_longer_bitwise_equal(max_delta, aligned_moe, prompts, engine_together):
    """The comparison can fail: one expert weight moved by about one bf16 ulp changes the logprobs."""
    experts = moe_layers(aligned_moe)[1].experts
    saved = experts.fc2_weight.detach().clone()
    try:
        with torch.no_grad():
            experts.fc2_weight[:, :, :8] *= 1 + 2 ** -7
        experts.refresh_deployed()
        with torch.no_grad():
            ours = token_logprobs(aligned_moe, prompts)
        assert max_delta("Megatron vLLM MoE spec, expert weights nudged", ours, engine_together) > 0.0
    finally:
        with torch.no_grad():
            experts.fc2_weight.copy_(saved)
        experts.refresh_deployed()


def test_native_megatron_moe_and_hf_differ_by_bf16_rounding(delta_stats, moe_engine, moe_checkpoint, prompts,
                                                            engine_together, architecture):
    # Megatron's groups may belong to a torch.distributed world an earlier engine's shutdown destroyed
    # while the new engine made another (init_single_process_cpu then keeps the stale groups): rebuild.
    parallel_state.destroy_model_parallel()
    init_single_process_cpu(seed=1234)
    try:
        native = build_gpt_from_hf(moe_checkpoint)
        with torch.no_grad():
            native_values = token_logprobs(native, prompts)
    finally:
        disable_cpu_compat([patch.name for patch in MOE_PATCHES])
    hf_values = hf_token_logprobs(moe_checkpoint, prompts, torch.bfloat16)
    for name, values in ((f"{architecture} Megatron native MoE (local spec) bf16", native_values),
                         (f"{architecture} HF bf16", hf_values)):
        worst, mean = delta_stats(name, values, engine_together)
        assert 0.0 < worst < ROUTING_FLIP_MAX_DELTA and mean < BF16_STACK_MEAN_DELTA, name

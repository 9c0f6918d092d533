"""Training forward = inference forward: the vLLM-forward Megatron GPTModel against a real engine.

The session engine serves a tiny random Llama (2 layers, hidden 256, 4 query heads of head_dim
64, 2 KV heads, bf16) saved with save_pretrained. Prompts of unaligned lengths are submitted
together (one prefill step) and one at a time. The aligned model (``build_gpt_from_hf(...,
align=True)``, packed like the engine's step) must give max |delta logprob| == 0.0 on every
token. Megatron's local spec and HF transformers (bf16) are printed beside it; they round
differently and are only held to the bf16-stack bound of tests/engine/test_engine_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine.engine_facts import measure_engine_facts
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
from megatron_vllm_align.megatron.logprobs import token_logprobs

pytestmark = pytest.mark.engine

BF16_STACK_MAX_DELTA = 0.05  # derived in tests/engine/test_engine_reference.py
# Weights of 2 MiB take vLLM's oneDNN GEMM (gate_up_proj, lm_head), whose bytes depend on the token
# count; vocabulary 2000 is padded to 2048 rows in vLLM's lm_head (docs/engine_facts.md).
WIDE_LLAMA = TinyModelConfig(hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1024,
                             vocab_size=2000, seed=5)


@pytest.fixture(scope="module")
def engine_together(engine, zero_diff_prompts) -> list[torch.Tensor]:
    return prompt_logprobs(engine, zero_diff_prompts)


@pytest.fixture(scope="module")
def aligned_model(megatron_world, engine_checkpoint):
    return build_gpt_from_hf(engine_checkpoint, align=True)


def test_aligned_megatron_equals_the_engine_bitwise_all_at_once(max_delta, aligned_model, zero_diff_prompts, engine_together):
    with torch.no_grad():
        ours = token_logprobs(aligned_model, zero_diff_prompts)
    for prompt, mine, theirs in zip(zero_diff_prompts, ours, engine_together, strict=True):
        assert mine.dtype == theirs.dtype == torch.float32 and mine.shape == (len(prompt) - 1,)
    assert max_delta("Megatron vLLM spec (all at once)", ours, engine_together) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ours, engine_together, strict=True))


def test_aligned_megatron_equals_the_engine_bitwise_one_at_a_time(max_delta, engine, aligned_model, zero_diff_prompts):
    engine_alone = [prompt_logprobs(engine, [prompt])[0] for prompt in zero_diff_prompts]
    with torch.no_grad():
        ours = [token_logprobs(aligned_model, [prompt])[0] for prompt in zero_diff_prompts]
    assert max_delta("Megatron vLLM spec (one at a time)", ours, engine_alone) == 0.0


def test_a_perturbed_aligned_model_is_no_longer_bitwise_equal(max_delta, aligned_model, zero_diff_prompts, engine_together):
    """The comparison can fail: moving one norm weight by about one bf16 ulp changes the logprobs."""
    weight = aligned_model.decoder.layers[1].pre_mlp_layernorm.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[3] += weight[3].abs() * 2 ** -7
            ours = token_logprobs(aligned_model, zero_diff_prompts)
        assert max_delta("Megatron vLLM spec, one norm weight nudged", ours, engine_together) > 0.0
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_local_spec_and_hf_differ_from_the_engine_by_bf16_rounding(max_delta, 
        megatron_world, engine_checkpoint, zero_diff_prompts, engine_together):
    local = build_gpt_from_hf(engine_checkpoint)
    with torch.no_grad():
        local_values = token_logprobs(local, zero_diff_prompts)
    hf_values = hf_token_logprobs(engine_checkpoint, zero_diff_prompts, torch.bfloat16)
    local_delta = max_delta("Megatron local spec bf16", local_values, engine_together)
    hf_delta = max_delta("HF bf16", hf_values, engine_together)
    assert 0.0 < local_delta < BF16_STACK_MAX_DELTA
    assert 0.0 < hf_delta < BF16_STACK_MAX_DELTA


def test_aligned_megatron_reproduces_a_batch_dependent_engine(megatron_world, tmp_path_factory, zero_diff_lengths, max_delta):
    """Where the engine's GEMM is oneDNN (AVX-512 / AMX CPUs) the wider model's engine gives different
    prompt logprobs batched and alone (measured 4e-3 on an AMX Xeon); where vLLM falls back to
    ``F.linear`` (AVX2: oneDNN cannot create a bf16 matmul) it is batch-invariant here (measured 0).
    Either way the aligned model, fed the same batch, reproduces both bitwise. Last in the file:
    the engine's shutdown destroys torch.distributed (later users call init_single_process_cpu)."""
    checkpoint = build_tiny_hf_model(tmp_path_factory.mktemp("wide") / "wide_llama", WIDE_LLAMA)
    prompts = random_token_sequences(zero_diff_lengths, vocab_size=WIDE_LLAMA.vocab_size, seed=7)
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=32 * 1024 * 1024))
    try:
        gemms = set(measure_engine_facts(llm, prompts[:1]).gemm_by_layer.values())
        together = prompt_logprobs(llm, prompts)
        alone = [prompt_logprobs(llm, [prompt])[0] for prompt in prompts]
        model = build_gpt_from_hf(checkpoint, align=True)
        with torch.no_grad():
            ours_together = token_logprobs(model, prompts)
            ours_alone = [token_logprobs(model, [prompt])[0] for prompt in prompts]
    finally:
        shutdown_engine(llm)
    engine_batch_delta = max_delta("wide engine alone (as reference: batched)", alone, together)
    if any(gemm.startswith("oneDNN") for gemm in gemms):
        assert engine_batch_delta > 0.0
    else:
        assert gemms == {"torch.nn.functional.linear"} and engine_batch_delta == 0.0
    assert max_delta("wide Megatron vLLM spec (all at once)", ours_together, together) == 0.0
    assert max_delta("wide Megatron vLLM spec (one at a time)", ours_alone, alone) == 0.0

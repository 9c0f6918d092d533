"""Training forward = inference forward: the vLLM-forward Megatron GPTModel against a real engine.

The session engine serves a tiny random Llama (2 layers, hidden 256, 4 query heads of head_dim
64, 2 KV heads, bf16) saved with save_pretrained. Prompts of unaligned lengths are submitted
together (one prefill step) and one at a time. The aligned model (``build_gpt_from_hf(...,
align=True)``, packed like the engine's step) must give max |delta logprob| == 0.0 on every
token. Megatron's local spec and HF transformers (bf16) are printed beside it; they round
differently and are only held to the bf16-stack bound of tests/engine/test_engine_reference.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

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
# The batch-dependence test's model: vocabulary 2000 is padded to 2048 rows in vLLM's lm_head
# (docs/engine_facts.md); positions up to 4096 for its long prompts.
WIDE_LLAMA = TinyModelConfig(hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1024,
                             vocab_size=2000, seed=5, max_position_embeddings=4096)
# Two long prompts after the zero-diff ones: their prefill attention is split across the engine's
# threads by total KV length, so batched it is split elsewhere than alone (docs/invariance.md).
LONG_PROMPT_LENGTHS = (1200, 2700)
# One engine step holds the whole batch (no chunked prefill): the trainer reproduces one step.
ONE_STEP_TOKENS = 8192


def _machine() -> str:
    """The CPU facts that decide the engine's kernels: torch's ISA, the bf16 / AMX flags, L2, threads."""
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    l2 = "?"
    with contextlib.suppress(OSError):
        l2 = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
    return (f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}, avx512_bf16 "
            f"{'avx512_bf16' in flags}, amx_bf16 {'amx_bf16' in flags}, L2 {l2} per core, "
            f"{torch.get_num_threads()} threads")


@pytest.fixture(scope="module")
def engine_together(engine, zero_diff_prompts) -> list[torch.Tensor]:
    return prompt_logprobs(engine, zero_diff_prompts)


@pytest.fixture(scope="module")
def aligned_model(megatron_world, engine_checkpoint):
    return build_gpt_from_hf(engine_checkpoint, align=True)


def test_aligned_megatron_equals_the_engine_bitwise_all_at_once(max_delta, aligned_model, zero_diff_prompts,
                                                                engine_together):
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


def test_a_perturbed_aligned_model_is_no_longer_bitwise_equal(max_delta, aligned_model, zero_diff_prompts,
                                                              engine_together):
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


def test_local_spec_and_hf_differ_from_the_engine_by_bf16_rounding(max_delta, megatron_world, engine_checkpoint,
                                                                   zero_diff_prompts, engine_together):
    local = build_gpt_from_hf(engine_checkpoint)
    with torch.no_grad():
        local_values = token_logprobs(local, zero_diff_prompts)
    hf_values = hf_token_logprobs(engine_checkpoint, zero_diff_prompts, torch.bfloat16)
    local_delta = max_delta("Megatron local spec bf16", local_values, engine_together)
    hf_delta = max_delta("HF bf16", hf_values, engine_together)
    assert 0.0 < local_delta < BF16_STACK_MAX_DELTA
    assert 0.0 < hf_delta < BF16_STACK_MAX_DELTA


def test_aligned_megatron_reproduces_a_batch_dependent_engine(megatron_world, tmp_path_factory, zero_diff_lengths,
                                                              max_delta):
    """The zero-diff prompts and two long ones (1200, 2700 tokens) on a wider model, all in one engine
    step and each alone. Control: the engine's prompt logprobs batched differ from alone (measured:
    7.9e-3 on an AVX-512 BF16 EPYC, from the long prompts' attention; docs/invariance.md), else the test
    fails: the workload would not exercise batch dependence here. The aligned model, fed the same
    batches, reproduces both bitwise. Last in the file: the engine's shutdown destroys
    torch.distributed (later users call init_single_process_cpu)."""
    checkpoint = build_tiny_hf_model(tmp_path_factory.mktemp("wide") / "wide_llama", WIDE_LLAMA)
    lengths = (*zero_diff_lengths, *LONG_PROMPT_LENGTHS)
    prompts = random_token_sequences(lengths, vocab_size=WIDE_LLAMA.vocab_size, seed=7)
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=32 * 1024 * 1024,
                                                                   max_num_batched_tokens=ONE_STEP_TOKENS))
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens >= sum(lengths)
        gemms = sorted(set(measure_engine_facts(llm, prompts[:1]).gemm_by_layer.values()))
        together = prompt_logprobs(llm, prompts)
        alone = [prompt_logprobs(llm, [prompt])[0] for prompt in prompts]
        model = build_gpt_from_hf(checkpoint, align=True)
        with torch.no_grad():
            ours_together = token_logprobs(model, prompts)
            ours_alone = [token_logprobs(model, [prompt])[0] for prompt in prompts]
    finally:
        shutdown_engine(llm)
    machine = f"{_machine()}; engine GEMMs {gemms}"
    engine_batch_delta = max_delta("wide engine alone (as reference: batched)", alone, together)
    per_prompt = {n: float((a - b).abs().max()) for n, a, b in zip(lengths, alone, together, strict=True) if n > 1}
    print(f"this workload exercised batch dependence on this machine: {'yes' if engine_batch_delta > 0 else 'no'} "
          f"(max |delta| = {engine_batch_delta:.3g}; per prompt length {per_prompt}); {machine}")
    assert engine_batch_delta > 0.0, (
        f"the workload does not exercise batch dependence on this machine ({machine}): the engine's prompt "
        f"logprobs of prompts {lengths} batched equal each prompt alone bitwise; lengthen or add long prompts "
        f"(LONG_PROMPT_LENGTHS) and record the machine in docs/invariance.md")
    assert max_delta("wide Megatron vLLM spec (all at once)", ours_together, together) == 0.0
    assert max_delta("wide Megatron vLLM spec (one at a time)", ours_alone, alone) == 0.0

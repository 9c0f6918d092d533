"""Scaled RoPE (Llama 3.x ``llama3``, ``linear``, ``dynamic`` NTK, ``yarn``): the aligned trainer's
prompt logprobs and its logprobs of the tokens the engine sampled (MVA_INVARIANT=1) equal the
engine's, bit for bit, at tiny widths for every variant (llama3 with its real scaling at Llama-3.2-1B widths:
``check``'s ``llama3.2_1b_widths_llama3_rope`` case in tests/test_check.py, prompt and sampled tokens).
Megatron's local spec implements llama3 (checked against Hugging Face in fp32) and refuses the rest
by name."""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine.hf_reference import hf_token_logprobs
from megatron_vllm_align.engine.tiny_models import TinyModelConfig, build_tiny_hf_model, random_token_sequences
from megatron_vllm_align.engine.vllm_reference import (
    ReferenceEngineConfig,
    prompt_logprobs,
    sample_completions,
    shutdown_engine,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
from megatron_vllm_align.megatron.hf_checkpoint import HFCheckpointError
from megatron_vllm_align.megatron.logprobs import completion_logprobs, token_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("invariant_module")]

LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}   # Llama-3.2-1B's config.json
SCALINGS = {
    "llama3": LLAMA32,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}
PROMPT_LENGTHS, MAX_TOKENS = (3, 11, 25, 90), (20, 5, 12, 16)


def _engine_and_trainer(checkpoint, vocab_size: int):
    """The engine's sampled completions and prompt logprobs, and the aligned trainer's of the same."""
    from vllm import SamplingParams

    prompts = random_token_sequences(PROMPT_LENGTHS, vocab_size=vocab_size, seed=11)
    params = [SamplingParams(temperature=1.0, max_tokens=m, logprobs=0, seed=100 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    llm = start_reference_engine(checkpoint, ReferenceEngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    try:
        sampled = sample_completions(llm, prompts, params)
        engine_prompt = prompt_logprobs(llm, [c.sequence for c in sampled])
    finally:
        shutdown_engine(llm)
    init_single_process_cpu(seed=1234)
    model = build_gpt_from_hf(checkpoint, align=True)
    with torch.no_grad():
        ours_sampled = completion_logprobs(model, prompts, [c.tokens for c in sampled])
        ours_prompt = token_logprobs(model, [c.sequence for c in sampled])
    return sampled, engine_prompt, ours_sampled, ours_prompt


@pytest.mark.parametrize("name", SCALINGS)
def test_aligned_trainer_is_bit_exact_with_scaled_rope(tmp_path, max_delta, name):
    config = TinyModelConfig(seed=3, rope_scaling=SCALINGS[name])
    checkpoint = build_tiny_hf_model(tmp_path / name, config)
    sampled, engine_prompt, ours_sampled, ours_prompt = _engine_and_trainer(checkpoint, config.vocab_size)
    assert max_delta(f"aligned, {name} RoPE, sampled", ours_sampled, [c.logprobs for c in sampled], "engine") == 0.0
    assert max_delta(f"aligned, {name} RoPE, prompt", ours_prompt, engine_prompt, "engine") == 0.0


def test_the_scaling_changes_the_logprobs(tmp_path):
    """The variants are not silently plain RoPE: the same weights with and without llama3 scaling give
    different prompt logprobs on a 90-token prompt (positions where the scaled frequencies differ)."""
    sequence = random_token_sequences((90,), vocab_size=512, seed=11)
    init_single_process_cpu(seed=1234)
    plain = build_gpt_from_hf(build_tiny_hf_model(tmp_path / "plain", TinyModelConfig(seed=3)), align=True)
    scaled = build_gpt_from_hf(build_tiny_hf_model(tmp_path / "scaled", TinyModelConfig(
        seed=3, rope_scaling={"rope_type": "linear", "factor": 4.0})), align=True)
    with torch.no_grad():
        assert not torch.equal(token_logprobs(plain, sequence)[0], token_logprobs(scaled, sequence)[0])


def test_native_spec_llama3_matches_hugging_face_and_refuses_the_rest(tmp_path):
    init_single_process_cpu(seed=1234)
    checkpoint = build_tiny_hf_model(tmp_path / "llama3", TinyModelConfig(seed=3, rope_scaling=LLAMA32))
    sequences = random_token_sequences((7, 90), vocab_size=512, seed=12)
    native = build_gpt_from_hf(checkpoint, align=False, params_dtype=torch.float32)
    with torch.no_grad():
        ours = token_logprobs(native, sequences)
    reference = hf_token_logprobs(checkpoint, sequences, dtype=torch.float32)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, reference)) < 1e-5
    yarn = build_tiny_hf_model(tmp_path / "yarn", TinyModelConfig(seed=3, rope_scaling=SCALINGS["yarn"]))
    with pytest.raises(HFCheckpointError, match="no 'yarn' RoPE scaling.*build with align=True"):
        build_gpt_from_hf(yarn, align=False)

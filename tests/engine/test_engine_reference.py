"""The real vLLM engine as ground truth: its prompt logprobs against HF bf16 and Megatron's local spec.

Bound on |delta logprob| between two bf16 stacks: one bf16 rounding moves a logit of
magnitude <= 1 by <= 2^-9 (2e-3) and a logprob by at most twice its largest logit change;
the stacks round differently in every norm, GEMM, RoPE, attention and activation of both
layers, so a few 1e-3 up to ~1e-2 is expected (measured: HF 5.8e-3, Megatron 7.8e-3 max).
Loader bugs (two norm weights swapped, gate/up order) move logprobs by >= 0.13 on this model.
0.05 sits between the two.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine.hf_reference import hf_token_logprobs
from megatron_vllm_align.engine.vllm_reference import (
    EngineStartError,
    engine_prompt_logprobs,
    prompt_logprobs,
    start_reference_engine,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs

pytestmark = pytest.mark.engine

BF16_STACK_MAX_DELTA = 0.05


def test_engine_logprobs_have_the_prompt_shape_and_are_deterministic(engine, engine_sequences, engine_logprobs):
    for sequence, values in zip(engine_sequences, engine_logprobs, strict=True):
        assert values.dtype == torch.float32 and values.shape == (len(sequence) - 1,)
        assert torch.isfinite(values).all() and (values < 0).all()
    again = prompt_logprobs(engine, engine_sequences)
    assert all(torch.equal(a, b) for a, b in zip(again, engine_logprobs, strict=True))


def test_engine_logprobs_do_not_depend_on_the_batch(engine, engine_sequences, engine_logprobs):
    """Holds for the tiny model, whose GEMMs all take the sgl path; oneDNN GEMMs (weights over
    1 MiB) break it (docs/engine_facts.md)."""
    alone = [prompt_logprobs(engine, [sequence])[0] for sequence in engine_sequences]
    assert all(torch.equal(a, b) for a, b in zip(alone, engine_logprobs, strict=True))


def test_engine_vs_hf_bf16(delta_stats, engine_checkpoint, engine_sequences, engine_logprobs):
    hf = hf_token_logprobs(engine_checkpoint, engine_sequences, torch.bfloat16)
    worst, mean = delta_stats("HF bf16", hf, engine_logprobs)
    assert 0 <= mean <= worst < BF16_STACK_MAX_DELTA


def test_engine_vs_megatron_local_spec(delta_stats, megatron_cpu, engine_checkpoint, engine_sequences, engine_logprobs):
    model = build_gpt_from_hf(engine_checkpoint)
    with torch.no_grad():
        ours = token_logprobs(model, engine_sequences)
    worst, mean = delta_stats("Megatron local bf16", ours, engine_logprobs)
    assert 0 <= mean <= worst < BF16_STACK_MAX_DELTA

    layer = model.decoder.layers[0]
    with torch.no_grad():  # planted loader bug: the two norm weights of layer 0 swapped
        saved = layer.input_layernorm.weight.clone()
        layer.input_layernorm.weight.copy_(layer.pre_mlp_layernorm.weight)
        layer.pre_mlp_layernorm.weight.copy_(saved)
        broken = token_logprobs(model, engine_sequences)
    assert delta_stats("Megatron with swapped norms", broken, engine_logprobs)[0] > BF16_STACK_MAX_DELTA


def test_megatron_local_fp32_is_closer_to_hf_fp32_than_to_the_engine(
    delta_stats, megatron_cpu, engine_checkpoint, engine_sequences, engine_logprobs
):
    model = build_gpt_from_hf(engine_checkpoint, params_dtype=torch.float32)
    with torch.no_grad():
        ours = token_logprobs(model, engine_sequences)
    hf = hf_token_logprobs(engine_checkpoint, engine_sequences, torch.float32)
    to_hf = float(torch.cat([a - b for a, b in zip(ours, hf, strict=True)]).abs().max())
    print(f"Megatron local fp32 vs HF fp32: max |delta logprob| = {to_hf:.3g}")
    assert to_hf < 1e-5 < delta_stats("Megatron local fp32", ours, engine_logprobs)[0]


def test_prompt_logprobs_rejects_out_of_vocabulary_tokens(engine):
    with pytest.raises(ValueError, match=r"sequences\[1\] has token ids in \[3, 512\]"):
        prompt_logprobs(engine, [[1, 2], [3, 512]])


def test_engine_start_failures_are_clear_errors(tmp_path, engine_checkpoint):
    with pytest.raises(EngineStartError, match="no config.json"):
        start_reference_engine(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in engine_checkpoint.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    config = (broken / "config.json").read_text().replace("LlamaForCausalLM", "NoSuchModelForCausalLM")
    (broken / "config.json").write_text(config)
    with pytest.raises(EngineStartError, match="failed to start on .*broken") as raised:
        start_reference_engine(broken)
    print(f"EngineStartError: {str(raised.value)[:240]}")
    assert raised.value.__cause__ is not None


def test_one_shot_engine_gives_the_session_engine_values(engine, engine_checkpoint, engine_sequences, engine_logprobs):
    """A second engine in the same process (started, queried, shut down) reproduces the first bitwise."""
    one_shot = engine_prompt_logprobs(engine_checkpoint, engine_sequences[:4], kv_cache_bytes=32 * 1024 * 1024)
    assert all(torch.equal(a, b) for a, b in zip(one_shot, engine_logprobs[:4], strict=True))

"""The transformer_layer_spec hook: with align on, a GPTModel with the local spec's parameter names
whose forward is bitwise build_gpt_from_hf(align=True)'s; with align off, Megatron's local spec."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from megatron_vllm_align.integrations.spec_hook import (
    align_config_overrides,
    finish_aligned_model,
    transformer_layer_spec_hook,
)
from megatron_vllm_align.megatron.build import (
    build_gpt_from_hf,
    local_layer_spec,
    transformer_config_from_hf,
)
from megatron_vllm_align.megatron.hf_checkpoint import read_hf_config
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.ops.refresh import refresh_deployed_weights
from megatron_vllm_align.train.config import AlignSection

BATCH = [[5, 9, 200, 31, 7, 7, 100, 3, 1, 64, 65], list(range(40, 53))]


def gpt_from_hook(llama_dir, align: AlignSection, **config_fields) -> GPTModel:
    """What a NeMo 2 GPTConfig / Megatron-Bridge GPTModelProvider does with the hook."""
    hf = read_hf_config(llama_dir)
    config = transformer_config_from_hf(hf, **{**align_config_overrides(align), **config_fields})
    model = GPTModel(config=config, transformer_layer_spec=transformer_layer_spec_hook(align, str(llama_dir))(config),
                     vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=hf.rope_theta,
                     share_embeddings_and_output_weights=hf.tie_word_embeddings)
    return finish_aligned_model(model, align, str(llama_dir))


def test_aligned_hook_matches_the_aligned_build(megatron_cpu, llama_dir):
    built = build_gpt_from_hf(llama_dir, align=True)
    hooked = gpt_from_hook(llama_dir, AlignSection(enabled=True))
    local_names = [name for name, _ in build_gpt_from_hf(llama_dir, align=False).named_parameters()]
    assert [name for name, _ in hooked.named_parameters()] == local_names
    with torch.no_grad():
        for name, param in hooked.named_parameters():
            param.copy_(built.get_parameter(name))
    assert refresh_deployed_weights(hooked) == refresh_deployed_weights(built) > 0
    with torch.no_grad():
        ours, theirs = token_logprobs(hooked, BATCH), token_logprobs(built, BATCH)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_align_off_is_the_local_spec(megatron_cpu, llama_dir):
    off = AlignSection(enabled=False)
    assert transformer_layer_spec_hook(off, str(llama_dir)) is local_layer_spec
    assert align_config_overrides(off) == {}
    model = gpt_from_hook(llama_dir, off)
    assert refresh_deployed_weights(model) == 0


def test_wrong_dtype_names_params_dtype(megatron_cpu, llama_dir):
    with pytest.raises(ValueError, match="params_dtype"):
        gpt_from_hook(llama_dir, AlignSection(enabled=True), params_dtype=torch.float32, bf16=False)


def test_missing_overrides_are_named(megatron_cpu, llama_dir):
    hf = read_hf_config(llama_dir)
    config = transformer_config_from_hf(hf)
    field = next(iter(align_config_overrides(AlignSection())))
    with pytest.raises(ValueError, match=field):
        transformer_layer_spec_hook(AlignSection(), str(llama_dir))(config)


def test_align_must_be_the_recipe_section(llama_dir):
    with pytest.raises(TypeError, match="AlignSection"):
        transformer_layer_spec_hook(dataclasses.asdict(AlignSection()), str(llama_dir))

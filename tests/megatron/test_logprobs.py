"""token_logprobs: vLLM's prompt-logprob definition, and a padded batch equal to one-at-a-time."""

from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs


@pytest.fixture(scope="module")
def bf16_llama(megatron_cpu, tiny_checkpoints):
    return build_gpt_from_hf(tiny_checkpoints["llama"])


def test_padded_batch_equals_one_at_a_time_bitwise(bf16_llama, token_sequences):
    with torch.no_grad():
        batched = token_logprobs(bf16_llama, token_sequences)
        alone = [token_logprobs(bf16_llama, [sequence])[0] for sequence in token_sequences]
    for sequence, row, single in zip(token_sequences, batched, alone, strict=True):
        assert row.dtype == torch.float32 and row.shape == (len(sequence) - 1,)
        assert torch.equal(row, single), f"length {len(sequence)}: batched differs from alone"


def test_values_are_the_next_token_entries_of_the_fp32_log_softmax(bf16_llama, token_sequences):
    sequence = torch.tensor(token_sequences[-1])
    with torch.no_grad():
        logits = bf16_llama(sequence[None], torch.arange(len(sequence))[None], attention_mask=None)[0]
        ours = token_logprobs(bf16_llama, [sequence])[0]
    expected = torch.stack([logits[t].float().log_softmax(-1)[sequence[t + 1]] for t in range(len(sequence) - 1)])
    assert torch.equal(ours, expected)
    same_token = torch.stack([logits[t].float().log_softmax(-1)[sequence[t]] for t in range(len(sequence) - 1)])
    assert not torch.equal(ours, same_token)  # an off-by-one gather would be caught


def test_single_token_sequence_has_no_logprobs(bf16_llama):
    with torch.no_grad():
        (empty,) = token_logprobs(bf16_llama, [[5]])
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_gradients_reach_the_parameters(bf16_llama, token_sequences):
    bf16_llama.zero_grad(set_to_none=True)
    total = torch.cat(token_logprobs(bf16_llama, token_sequences[2:4])).sum()
    total.backward()
    grads = [param.grad for param in bf16_llama.parameters()]
    assert all(grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0 for grad in grads)
    bf16_llama.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "sequences, message",
    [
        ([], "sequences is empty"),
        ([[1, 2], []], r"sequences\[1\] must be a non-empty 1-D"),
        ([[[1, 2]]], r"sequences\[0\] must be a non-empty 1-D"),
        ([[1.0, 2.0]], r"sequences\[0\] must hold integer token ids"),
        ([[1, 512]], r"sequences\[0\] has token ids in \[1, 512\], outside the vocabulary \[0, 512\)"),
        ([[3, -1]], r"outside the vocabulary"),
    ],
)
def test_bad_sequences_are_clear_errors(bf16_llama, sequences, message):
    with pytest.raises(ValueError, match=message):
        token_logprobs(bf16_llama, sequences)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[1, 2]], completions=[[3]], layout="ragged"), "layout must be one of"),
    (dict(prompts=[[1, 2]], completions=[[3], [4]]), "as many completions as prompts"),
    (dict(prompts=[[1, 2]], completions=[[]]), "at least one token"),
    (dict(prompts=[[1, 2]], completions=[[3]], layout="padded", routed_experts=[torch.zeros(2, 1, 2)]),
     "replay needs layout 'packed' or 'one_at_a_time'"),
    (dict(prompts=[[1, 2]], completions=[[3]], routed_experts=[]), "1 sequences"),
    (dict(prompts=[[1, 2]], completions=[[3]], routed_experts=[torch.zeros(1, 1, 2)]), r"must be \[n - 1 or n"),
    (dict(prompts=[[1, 2]], completions=[[3]], sampling_params=[None, None]), "2 SamplingParams for 1 sequences"),
])
def test_completion_logprobs_refuses_bad_input_before_any_forward(kwargs, match):
    """Checked before the model is touched (``model=None`` would fail any forward)."""
    from megatron_vllm_align.megatron.logprobs import completion_logprobs

    with pytest.raises(ValueError, match=match):
        completion_logprobs(None, **kwargs)


@pytest.mark.parametrize("layout", ["padded", "one_at_a_time"])
def test_processed_completion_logprobs_are_the_ops_on_the_models_logits(bf16_llama, token_sequences, layout):
    """Local spec: ``completion_logprobs(..., sampling_params=...)`` in a padded batch or one at a time is
    the ``processed_logprob`` op on the rows of each sequence's lone forward that predict its completion."""
    from vllm import SamplingParams

    from megatron_vllm_align.megatron.logprobs import completion_logprobs
    from megatron_vllm_align.ops.processed_logprob import vllm_processed_selected_logprob

    sequences = [torch.tensor(s) for s in token_sequences if len(s) >= 4][:3]
    prompts = [s[: len(s) // 2].tolist() for s in sequences]
    completions = [s[len(s) // 2:].tolist() for s in sequences]
    # temperature only: the random tokens lie in every support (filters on sampled tokens: the engine tests)
    params = [SamplingParams(temperature=t) for t in (0.6, 1.3, 0.9)][: len(sequences)]
    with torch.no_grad():
        ours = completion_logprobs(bf16_llama, prompts, completions, layout=layout, sampling_params=params)
        raw = completion_logprobs(bf16_llama, prompts, completions, layout=layout)
        for values, raw_values, sequence, prompt, sampling in zip(ours, raw, sequences, prompts, params, strict=True):
            logits = bf16_llama(sequence[None], torch.arange(len(sequence))[None], attention_mask=None)[0]
            rows = slice(len(prompt) - 1, len(sequence) - 1)
            assert torch.equal(values, vllm_processed_selected_logprob(logits[rows], sequence[1:][rows], sampling))
            assert not torch.equal(values, raw_values)

"""Processed-logprob forward: bitwise vLLM's own Sampler (logprobs_mode='processed_logprobs') through a
real SamplingMetadata; raw logprobs as the control; refused SamplingParams fields."""
import functools

import pytest
import torch

from megatron_vllm_align.ops.processed_logprob.kernel import (
    check_sampling_params,
    vllm_processed_logprobs,
    vllm_processed_selected_logprob,
)

pytestmark = pytest.mark.usefixtures("no_collection_while_tracing")   # vLLM's compiled sampler ops


@functools.cache
def vllm_config():
    """One engine config for the test's MinPLogitsProcessor (it reads max_num_seqs)."""
    from vllm.config import VllmConfig

    return VllmConfig()


def sampler_processed_logprobs(logits, params_per_row):
    """(full processed logprobs [B, V] fp32, sampled ids [B]) of vLLM's ``Sampler.forward`` in
    processed_logprobs mode, one request per row. The metadata holds what the engine's input batch
    puts there (gpu_input_batch: fp32 temperature and top_p, int32 top_k = vocab when off, None when
    no row uses it; min_p in the built-in MinPLogitsProcessor)."""
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder, LogitsProcessors, MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    rows, vocab = logits.shape
    min_p = MinPLogitsProcessor(vllm_config(), torch.device("cpu"), is_pin_memory=False)
    builder = BatchUpdateBuilder()
    for i, params in enumerate(params_per_row):
        builder.added.append((i, params, None, []))
    min_p.update_state(builder.get_and_reset(batch_size=rows))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params_per_row]
    top_p = [p.top_p for p in params_per_row]
    metadata = SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params_per_row], dtype=torch.float32),
        all_greedy=False, all_random=True,
        top_p=None if all(p >= 1 for p in top_p) else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if all(k == vocab for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
        generators={}, max_num_logprobs=-1, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors([min_p]))
    out = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), metadata)
    return out.logprobs_tensors.logprobs, out.sampled_token_ids[:, 0].long()


def random_logits(rows, vocab, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16).to(dtype)


@pytest.mark.parametrize("vocab", [512, 151936])
@pytest.mark.parametrize("seed,dtype", [(0, torch.float32), (1, torch.bfloat16), (2, torch.float32)])
def test_forward_bitwise_equals_vllm_sampler(sampling_settings, vocab, seed, dtype):
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler

    logits = random_logits(4 * len(sampling_settings), vocab, seed, dtype)
    params = [SamplingParams(**kwargs) for kwargs in sampling_settings.values()]
    # Each parameter set alone (a batch of 4 requests sharing it), then all in one mixed batch.
    batches = [(logits[4 * i:4 * i + 4], [p] * 4) for i, p in enumerate(params)]
    batches.append((logits, [p for p in params for _ in range(4)]))
    for rows, row_params in batches:
        expected, sampled = sampler_processed_logprobs(rows, row_params)
        for i, p in enumerate(row_params):
            got = vllm_processed_logprobs(rows[i:i + 1], p)
            assert got.dtype == torch.float32 and torch.equal(got, expected[i:i + 1]), (p, i)
            kept = int(torch.isfinite(got).sum())  # top-k keeps every tie of the k-th value (bf16 logits tie)
            assert (kept < vocab) == (p.top_p < 1 or p.top_k > 0 or p.min_p > 0), (p, kept)
            assert kept >= (p.top_k if p.top_p == 1 and p.min_p == 0 else 1), (p, kept)
        # The sampled token's logprob as the engine returns it (Sampler.gather_logprobs, column 0).
        for start in range(0, rows.shape[0], 4):
            p = row_params[start]
            got = vllm_processed_selected_logprob(rows[start:start + 4], sampled[start:start + 4], p)
            engine = Sampler.gather_logprobs(expected[start:start + 4], 0, sampled[start:start + 4]).logprobs[:, 0]
            assert torch.equal(got, engine), p
            # Control: the raw logprobs (temperature 1, no mask) are different numbers.
            raw = Sampler.compute_logprobs(rows[start:start + 4]).gather(-1, sampled[start:start + 4, None])[:, 0]
            assert not bool((raw == got).any()), p


@pytest.mark.parametrize("vocab", [512, 4096])
def test_top_p_ties_at_the_boundary_match_the_sampler(tie_logits, vocab):
    from vllm import SamplingParams

    logits = tie_logits(6, vocab, seed=vocab)
    params = SamplingParams(top_p=0.9)
    expected, _ = sampler_processed_logprobs(logits, [params] * 6)
    got = vllm_processed_logprobs(logits, params)
    assert torch.equal(got, expected)
    tied = logits == 7.09375
    if vocab == 512:  # the boundary lies inside the tie group: exactly one tied token dropped
        assert torch.equal((torch.isfinite(got) & tied).sum(-1), torch.full((6,), 19))


def test_input_logits_are_not_modified_and_outside_targets_are_refused():
    from vllm import SamplingParams

    logits = random_logits(3, 512, 0, torch.float32)
    before = logits.clone()
    params = SamplingParams(temperature=0.6, top_k=20)
    processed = vllm_processed_logprobs(logits, params)
    assert torch.equal(logits, before)
    outside = torch.isneginf(processed[1]).nonzero()[0]
    targets = processed.argmax(-1)
    targets[1] = outside
    with pytest.raises(ValueError, match=r"target_ids\[1\] = .* outside the support"):
        vllm_processed_selected_logprob(logits, targets, params)
    # the trainer's path: log 0 = -inf for that row and no gradient into it; the other rows unchanged
    from megatron_vllm_align.ops.processed_logprob import VllmProcessedLogprob

    leaf = logits.to(torch.bfloat16).requires_grad_()
    values = VllmProcessedLogprob(params, outside_support="neg_inf")(leaf, targets)
    assert torch.isneginf(values[1]) and torch.isfinite(values[[0, 2]]).all()
    (grad,) = torch.autograd.grad(values, leaf, torch.ones(3))   # g = 1 on the -inf row too
    assert torch.isfinite(grad).all() and not grad[1].any() and grad[0].any() and grad[2].any()


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=0.0), "temperature"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(repetition_penalty=1.1), "repetition_penalty"),
    (dict(logit_bias={3: 1.0}), "logit_bias"),
    (dict(bad_words=["x"]), "bad_words"),
    (dict(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    (dict(min_tokens=3), "min_tokens"),
    (dict(thinking_token_budget=4), "thinking_token_budget"),
])
def test_refused_sampling_params_name_the_field(kwargs, field):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        check_sampling_params(SamplingParams(**kwargs))


def test_out_of_range_params_and_wrong_type_are_refused():
    from vllm import SamplingParams

    params = SamplingParams(top_p=0.9)
    params.top_p = 1.5  # vLLM validates at construction only; a later change is caught here
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p must lie in \(0, 1\]"):
        check_sampling_params(params)
    params = SamplingParams(min_p=0.1)
    params.min_p = -0.1
    with pytest.raises(ValueError, match=r"SamplingParams\.min_p must lie in \[0, 1\]"):
        check_sampling_params(params)
    with pytest.raises(TypeError, match="must be a vllm.SamplingParams"):
        check_sampling_params({"temperature": 0.6})
    check_sampling_params(SamplingParams(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05))

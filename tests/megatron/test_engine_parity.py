"""megatron.engine_parity without an engine: the seeded requests vLLM receives, the kinds and sequences of
what an engine computed, and the per-kind mismatch (a planted one-token difference is found in its kind
only); bad input refused. The engine side runs in tests/test_main_job.py and tests/test_check.py."""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.engine.vllm_reference import SampledCompletion
from megatron_vllm_align.megatron.engine_parity import (
    EngineLogprobs,
    mismatch,
    seeded_sampling_params,
)


def completion(prompt, tokens, values) -> SampledCompletion:
    return SampledCompletion(tuple(prompt), tuple(tokens), torch.tensor(values, dtype=torch.float32))


def test_seeded_sampling_params_one_request_each():
    params = seeded_sampling_params((4, 1, 9), seed=7)
    assert [(p.max_tokens, p.seed, p.temperature, p.logprobs, p.ignore_eos, p.n) for p in params] == [
        (4, 7, 1.0, 0, True, 1), (1, 8, 1.0, 0, True, 1), (9, 9, 1.0, 0, True, 1)]


@pytest.mark.parametrize("max_tokens", [(), (3, 0)])
def test_seeded_sampling_params_refuses_no_tokens(max_tokens):
    with pytest.raises(ValueError, match="max_tokens must be a non-empty sequence of ints >= 1"):
        seeded_sampling_params(max_tokens, seed=0)


def test_engine_logprobs_kinds_and_sequences():
    completions = [completion([5, 6], [7, 8, 9], [-1.0, -2.0, -3.0]), completion([1], [2], [-0.5])]
    run = EngineLogprobs([[3, 4, 5]], [torch.tensor([-0.25, -0.75])], completions)
    kinds = run.by_kind()
    assert list(kinds) == ["prompt", "sampled"] and kinds["prompt"][0].tolist() == [-0.25, -0.75]
    assert [t.tolist() for t in kinds["sampled"]] == [[-1.0, -2.0, -3.0], [-0.5]]
    assert run.sequences("prompt") == [[3, 4, 5]] and run.sequences("sampled") == [[5, 6, 7, 8, 9], [1, 2]]
    assert list(EngineLogprobs([], [], completions).by_kind()) == ["sampled"]   # no prompt logprobs taken
    with pytest.raises(ValueError, match="kind must be one of"):
        run.sequences("decode")


def test_mismatch_per_kind_finds_a_planted_difference_in_its_kind_only():
    engine = {"prompt": [torch.tensor([-0.25, -0.75])], "sampled": [torch.tensor([-1.0, -2.0, -3.0])]}
    same = mismatch({kind: [t.clone() for t in v] for kind, v in engine.items()}, engine)
    assert {kind: (m["max_abs_delta_logprob"], m["num_tokens"]) for kind, m in same.items()} == {
        "prompt": (0.0, 2), "sampled": (0.0, 3)}
    planted = {"prompt": [engine["prompt"][0].clone()], "sampled": [torch.tensor([-1.0, -2.0 + 2 ** -7, -3.0])]}
    figures = mismatch(planted, engine)
    assert figures["prompt"]["max_abs_delta_logprob"] == 0.0
    assert figures["sampled"]["max_abs_delta_logprob"] == 2 ** -7
    assert figures["sampled"]["mean_abs_delta_logprob"] == pytest.approx(2 ** -7 / 3)


def test_mismatch_refuses_a_kind_the_trainer_lacks():
    with pytest.raises(ValueError, match=r"no logprobs of kind \['prompt'\]"):
        mismatch({"sampled": [torch.zeros(1)]}, {"prompt": [torch.zeros(1)], "sampled": [torch.zeros(1)]})

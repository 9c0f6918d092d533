import math

import pytest
import torch

from megatron_vllm_align.validation.logprob_mismatch import logprob_mismatch


def test_identical_logprobs_give_zero_mismatch():
    lp = [torch.tensor([-1.0, -2.5]), torch.tensor([-0.1])]
    m = logprob_mismatch(lp, [t.clone() for t in lp])
    assert (m.max_abs_delta_logprob, m.mean_abs_delta_logprob, m.gen_kl_error, m.k3_kl) == (0, 0, 0, 0)
    assert m.token_mult_prob_error == 1.0 and m.num_tokens == 3


def test_closed_form_values():
    engine = [torch.tensor([-1.0, -1.0, -1.0, -1.0])]
    trainer = [torch.tensor([-0.9, -1.1, -1.0, -1.2])]            # delta = +0.1, -0.1, 0, -0.2
    m = logprob_mismatch(trainer, engine)
    d = [0.1, -0.1, 0.0, -0.2]
    assert m.max_abs_delta_logprob == pytest.approx(0.2)
    assert m.mean_abs_delta_logprob == pytest.approx(0.1)
    assert m.token_mult_prob_error == pytest.approx(sum(math.exp(abs(x)) for x in d) / 4)
    assert m.gen_kl_error == pytest.approx(-sum(d) / 4)
    assert m.k3_kl == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 4)
    assert m.k3_kl > 0


def test_bad_input():
    with pytest.raises(ValueError, match="2 sequences"):
        logprob_mismatch([torch.zeros(2), torch.zeros(1)], [torch.zeros(2)])
    with pytest.raises(ValueError, match="sequence 0"):
        logprob_mismatch([torch.zeros(2)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="non-finite"):
        logprob_mismatch([torch.tensor([-1.0])], [torch.tensor([float("-inf")])])
    with pytest.raises(ValueError, match="non-finite"):
        logprob_mismatch([torch.tensor([float("nan")])], [torch.tensor([-1.0])])


def test_a_token_outside_the_trainers_support_is_an_infinite_mismatch():
    """A trainer logprob of -inf (processed logprobs: the trainer's filters drop a token the engine sampled)."""
    m = logprob_mismatch([torch.tensor([float("-inf"), -1.0])], [torch.tensor([-1.0, -1.0])])
    assert m.max_abs_delta_logprob == m.mean_abs_delta_logprob == m.token_mult_prob_error == math.inf
    assert m.gen_kl_error == m.k3_kl == math.inf and m.num_tokens == 2

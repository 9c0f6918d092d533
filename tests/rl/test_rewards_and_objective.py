"""The verifiable rewards, GRPO's group-normalised advantages and the clipped objective: values, and
the gradient the objective gives (checked against its closed form)."""
import pytest
import torch

from megatron_vllm_align.rl.grpo import RatioStats, grpo_loss_sum
from megatron_vllm_align.rl.rewards import Problem, arithmetic_answer, arithmetic_answer_or_digits, group_advantages
from megatron_vllm_align.rl.rollout import Rollout

PROBLEM = Problem("What is 23 plus 45?", " 23 plus 45 is 68.")


@pytest.mark.parametrize("completion, reward", [(" 23 plus 45 is 68.", 1.0), ("68", 1.0), (" is 68", 1.0),
                                                (" 23 plus 45 is 69.", 0.0), ("sixty-eight", 0.0), ("", 0.0),
                                                ("68 or 23", 0.0)])
def test_answer_reward_is_right_or_not(completion, reward):
    assert PROBLEM.answer == 68
    assert arithmetic_answer(PROBLEM, completion) == reward


def test_digit_term_only_for_wrong_answers():
    assert arithmetic_answer_or_digits(PROBLEM, "x 68.") == 1.0
    assert arithmetic_answer_or_digits(PROBLEM, "ab12") == pytest.approx(0.1 * 2 / 4)
    assert arithmetic_answer_or_digits(PROBLEM, "abcd") == 0.0
    assert arithmetic_answer_or_digits(PROBLEM, "") == 0.0
    assert Problem("What is 3 minus 9?", " 3 minus 9 is -6.").answer == -6


def test_group_advantages_normalise_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    advantages = group_advantages(rewards)
    assert advantages.dtype == torch.float64
    assert torch.allclose(advantages[0], torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64) / (
        rewards[0].double().std() + 1e-6) * 0.5)
    assert torch.equal(advantages[1], torch.zeros(4, dtype=torch.float64)), "an all-equal group has no signal"
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


def _rollout(advantage, engine):
    return Rollout(problem=0, sample=0, seed=7, prompt=(1, 5, 6), completion=(9, 10, 11),
                   engine_logprobs=tuple(engine), reward=0.0, advantage=advantage)


def test_objective_at_ratio_one_has_gradient_minus_advantage():
    engine = [-1.5, -0.25, -3.0]
    rollout = _rollout(0.7, engine)
    values = torch.tensor(engine, requires_grad=True)   # the completion tokens' logprobs
    stats = RatioStats()
    loss = grpo_loss_sum([values], [rollout], 0.2, stats)
    loss.backward()
    assert float(loss) == pytest.approx(-0.7 * 3)
    assert torch.equal(values.grad, torch.tensor([-0.7, -0.7, -0.7]))
    assert stats.figures() == {"ratio_min": 1.0, "ratio_mean": 1.0, "ratio_max": 1.0, "clipped_fraction": 0.0}


def test_clipped_tokens_get_no_gradient_and_are_counted():
    engine = [-1.0, -1.0, -1.0]
    trainer = torch.tensor([-1.0 + 0.5, -1.0, -1.0 - 0.5], requires_grad=True)  # ratios e^0.5, 1, e^-0.5
    stats = RatioStats()
    grpo_loss_sum([trainer], [_rollout(1.0, engine)], 0.2, stats).backward()
    # A > 0: the ratio above 1 + eps is clipped (no gradient); the one below 1 - eps is not
    assert trainer.grad[0] == 0.0 and trainer.grad[1] == pytest.approx(-1.0)
    assert trainer.grad[2] == pytest.approx(-torch.exp(torch.tensor(-0.5)).item())
    figures = stats.figures()
    assert figures["clipped_fraction"] == pytest.approx(1 / 3)
    assert figures["ratio_max"] == pytest.approx(torch.exp(torch.tensor(0.5)).item())


def test_wrong_number_of_sampled_tokens_is_refused():
    with pytest.raises(ValueError, match="4 trainer logprobs for a completion of 3 tokens"):
        grpo_loss_sum([torch.zeros(4)], [_rollout(1.0, [-1.0, -1.0, -1.0])], 0.2, RatioStats())


def test_rollout_masks_exactly_the_sampled_tokens():
    rollout = _rollout(0.0, [-1.0, -2.0, -3.0])
    assert rollout.tokens.tolist() == [1, 5, 6, 9, 10, 11]
    assert rollout.loss_mask.tolist() == [False, False, True, True, True]

"""Verifiable rewards of the arithmetic task (``train.data``) and GRPO's group-normalised advantages."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    """One arithmetic prompt: its text, the expected response (``train.data.arithmetic_pairs``) and
    the answer (the last integer of the response)."""

    prompt: str
    response: str

    @property
    def answer(self) -> int:
        return int(_INTEGER.findall(self.response)[-1])


def arithmetic_answer(problem: Problem, completion: str) -> float:
    """1.0 if the last integer in ``completion`` is the problem's answer, else 0.0."""
    found = _INTEGER.findall(completion)
    return 1.0 if found and int(found[-1]) == problem.answer else 0.0


def arithmetic_answer_or_digits(problem: Problem, completion: str) -> float:
    """:func:`arithmetic_answer`, and for a wrong answer ``0.1 x`` the share of the completion's
    characters that are digits (a format term: a model that has not learned the task yet still gets
    rewards that differ within a group, so GRPO has a gradient). 1.0 iff the answer is right."""
    if arithmetic_answer(problem, completion) == 1.0:
        return 1.0
    return 0.1 * sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0


REWARDS = {"arithmetic_answer": arithmetic_answer, "arithmetic_answer_or_digits": arithmetic_answer_or_digits}


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of ``rewards`` [prompts, G]: ``(r - mean_group) / (std_group + eps)`` (the
    unbiased std; a group whose rewards are all equal gets 0 everywhere), float64."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, G >= 2], got {tuple(rewards.shape)}")
    r = rewards.double()
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)

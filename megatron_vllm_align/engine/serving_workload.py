"""A sampling workload shaped like serving, for claims about sampled-token logprobs.

A bit-exact result on a few short requests proves little: the engine's logprobs depend on its batch
(which requests share a step, how a prompt is chunked, what the prefix cache holds, how many requests
are still decoding), and a small workload may never exercise that dependence. :class:`ServingWorkload`
builds requests that do: many of them, prompt lengths spread geometrically from a few tokens to
hundreds, a quarter of them behind one shared prefix (prefix-cache hits; the CPU engine caches whole
blocks of 128 tokens), output lengths that differ so the decode batch shrinks step by step, one long
request decoded alone at the end, and a per-step token budget that prefills long prompts in chunks.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ServingRequests:
    """``prompts[i]`` (token ids) is sampled for ``max_tokens[i]`` new tokens."""

    prompts: list[list[int]]
    max_tokens: list[int]


@dataclasses.dataclass(frozen=True)
class ServingWorkload:
    """``requests`` requests; prompts of 3 to ``max_prompt_tokens`` tokens; outputs of 1 to
    ``max_new_tokens // 2`` tokens, and ``max_new_tokens`` for the longest-lived request; every fourth
    prompt starts with one shared prefix of ``shared_prefix_tokens``; ``chunk_tokens``: the engine's
    per-step token budget (``max_num_batched_tokens``), below the longest prompts."""

    requests: int = 64
    max_prompt_tokens: int = 512
    max_new_tokens: int = 128
    shared_prefix_tokens: int = 256
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("requests", "max_prompt_tokens", "max_new_tokens", "shared_prefix_tokens", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServingWorkload.{name} must be a positive int, got {value!r}")
        if self.max_prompt_tokens < 3 or self.requests < 2:
            raise ValueError("ServingWorkload needs max_prompt_tokens >= 3 and requests >= 2")

    def build(self, vocab_size: int, max_model_len: int, seed: int = 0) -> ServingRequests:
        """The requests over token ids ``[0, vocab_size)``, every prompt plus its output within
        ``max_model_len`` tokens; reproducible from ``seed``."""
        longest = min(self.max_prompt_tokens, max_model_len - self.max_new_tokens)
        if longest < 3:
            raise ValueError(f"max_model_len {max_model_len} leaves no room for prompts next to "
                             f"{self.max_new_tokens} new tokens")
        generator = torch.Generator().manual_seed(seed)
        ratio = (longest / 3) ** (1 / (self.requests - 1))
        lengths = [max(3, min(longest, round(3 * ratio ** i))) for i in range(self.requests)]
        prefix_len = min(self.shared_prefix_tokens, longest - 1)
        prefix = torch.randint(0, vocab_size, (prefix_len,), generator=generator).tolist()
        prompts = []
        for i, length in enumerate(lengths):
            own = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
            prompts.append((prefix + own)[:min(longest, max(length, prefix_len + 8))] if i % 4 == 0 else own)
        short = max(1, self.max_new_tokens // 2)
        max_tokens = [1 + (7 * i) % short for i in range(self.requests)]
        max_tokens[self.requests // 2] = self.max_new_tokens  # decoded alone once the others have finished
        return ServingRequests(prompts, max_tokens)

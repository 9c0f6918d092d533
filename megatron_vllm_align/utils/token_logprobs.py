"""Token sequences and the engine's logprob definition, for any causal model's logits.

vLLM's prompt logprobs: logits cast to fp32, log_softmax over the full vocabulary, and for
position t the entry of token t+1 (a sequence of n tokens yields n - 1 values). Model-agnostic:
the engine references (vLLM, Hugging Face) and the Megatron trainer all read tokens through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TokenSequence = Sequence[int] | torch.Tensor
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def as_token_tensor(sequence: TokenSequence, index: int, vocab_size: int) -> torch.Tensor:
    """`sequence` as a 1-D int64 tensor; ValueError naming ``sequences[index]`` unless it is a
    non-empty 1-D list/tensor of integer ids in [0, vocab_size)."""
    tokens = torch.as_tensor(sequence)
    if tokens.ndim != 1 or tokens.numel() == 0:
        raise ValueError(f"sequences[{index}] must be a non-empty 1-D token list, got shape {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"sequences[{index}] must hold integer token ids, got {tokens.dtype}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"sequences[{index}] has token ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})"
        )
    return tokens.to(torch.long)


def padded_logits(
    logits_fn: LogitsFn, sequences: Sequence[TokenSequence], vocab_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(logits [batch, seq, vocab], input_ids [batch, seq], lengths) of `sequences` run in one call of
    `logits_fn(input_ids, position_ids)` as a right-padded batch (pad id 0): positions start at 0 in
    every row and causality keeps real tokens from seeing the padding after them."""
    if len(sequences) == 0:
        raise ValueError("next_token_logprobs: sequences is empty")
    token_rows = [as_token_tensor(sequence, i, vocab_size) for i, sequence in enumerate(sequences)]
    lengths = [row.numel() for row in token_rows]
    input_ids = torch.zeros(len(token_rows), max(lengths), dtype=torch.long, device=device)
    for i, row in enumerate(token_rows):
        input_ids[i, : lengths[i]] = row
    position_ids = torch.arange(max(lengths), device=device).expand_as(input_ids)
    logits = logits_fn(input_ids, position_ids)
    if logits.shape[:2] != input_ids.shape or logits.shape[-1] != vocab_size:
        raise ValueError(
            f"next_token_logprobs: logits have shape {tuple(logits.shape)}, expected "
            f"{(*input_ids.shape, vocab_size)} (batch, seq, vocab)"
        )
    return logits, input_ids, lengths


def next_token_logprobs(
    logits_fn: LogitsFn, sequences: Sequence[TokenSequence], vocab_size: int, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """For each sequence, the fp32 logprobs of its tokens 1..n-1 given the tokens before them.

    `logits_fn(input_ids, position_ids)` maps [batch, seq] int64 tensors to [batch, seq, vocab]
    logits of a causal model. All sequences run in one call as a right-padded batch
    (:func:`padded_logits`). Returns a list of 1-D float32 tensors (length n - 1 each); autograd is left on.
    """
    logits, input_ids, lengths = padded_logits(logits_fn, sequences, vocab_size, device)
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # as vLLM's Sampler.compute_logprobs
    return [logprobs[i, : n - 1].gather(-1, input_ids[i, 1:n, None]).squeeze(-1) for i, n in enumerate(lengths)]

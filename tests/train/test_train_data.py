"""Generated corpus, byte tokenizer, response mask, fixed splits and the data order."""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.train.data import (
    ByteTokenizer,
    arithmetic_pairs,
    batch_indices,
    build_splits,
    encode_example,
    rank_slice,
)


def test_tokenizer_round_trips_and_needs_room_for_bytes():
    tokenizer = ByteTokenizer(320)
    ids = tokenizer.encode("What is 7 times 8? é")
    assert min(ids) >= ByteTokenizer.OFFSET and max(ids) < 259
    assert tokenizer.decode(ids) == "What is 7 times 8? é"
    with pytest.raises(ValueError, match="vocab_size 258 < 259"):
        ByteTokenizer(258)


def test_mask_marks_exactly_the_response_and_eos_targets():
    tokenizer = ByteTokenizer(320)
    example = encode_example(tokenizer, "What is 2 plus 3?", " 2 plus 3 is 5.")
    assert example.tokens[0] == tokenizer.BOS and example.tokens[-1] == tokenizer.EOS
    targets = example.tokens[1:][example.loss_mask].tolist()
    assert tokenizer.decode(targets[:-1]) == " 2 plus 3 is 5." and targets[-1] == tokenizer.EOS
    assert tokenizer.decode(example.tokens[1:][~example.loss_mask].tolist()) == "What is 2 plus 3?"


def test_pairs_are_correct_arithmetic_and_reproducible():
    pairs = arithmetic_pairs(50, seed=3)
    assert pairs == arithmetic_pairs(50, seed=3) and pairs != arithmetic_pairs(50, seed=4)
    assert len(set(pairs)) == 50
    for prompt, response in pairs:
        a, name, b = prompt.removeprefix("What is ").removesuffix("?").split()
        expected = {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[name]
        assert response == f" {a} {name} {b} is {expected}."


def test_splits_are_fixed_and_disjoint():
    splits = build_splits(20, 5, seed=0, vocab_size=320)
    again = build_splits(20, 5, seed=0, vocab_size=320)
    assert len(splits.train) == 20 and len(splits.validation) == 5
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(splits.validation, again.validation))
    train = {tuple(e.tokens.tolist()) for e in splits.train}
    assert not train & {tuple(e.tokens.tolist()) for e in splits.validation}


def test_order_covers_each_epoch_once_and_depends_only_on_the_step():
    epoch = [i for step in range(1, 6) for i in batch_indices(step, 4, 20, seed=1)]
    assert sorted(epoch) == list(range(20))
    assert batch_indices(6, 4, 20, seed=1) != batch_indices(1, 4, 20, seed=1)  # new epoch, new shuffle
    wrapped = batch_indices(2, 12, 20, seed=1)  # crosses the epoch boundary
    assert wrapped[:8] == [i for s in (1,) for i in batch_indices(s, 20, 20, seed=1)][12:]
    assert rank_slice(list(range(8)), 1, 2) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="global_batch_size 6 is not divisible by the world size 4"):
        rank_slice(list(range(6)), 0, 4)

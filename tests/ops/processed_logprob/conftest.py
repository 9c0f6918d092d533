"""The top-p tie rows shared by the processed-logprob tests."""
import pytest
import torch


def _tie_logits(rows, vocab, seed):
    """Rows whose top-p 0.9 boundary (temperature 1) falls inside a group of 20 equal logits: 20
    tokens at 7.09375 (each p = 0.049), the rest at 0 (mass 0.02 together when vocab = 512), so
    ascending cumulative sums are 0.020, 0.069, 0.118, ...: one tied token is dropped, 19 kept;
    which one is the sort's choice. Columns permuted per row."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(rows, vocab)
    for row in logits:
        row[torch.randperm(vocab, generator=gen)[:20]] = 7.09375
    return logits


@pytest.fixture
def tie_logits():
    """``(rows, vocab, seed) -> logits`` of :func:`_tie_logits`."""
    return _tie_logits

"""The sampling settings and the top-p tie rows shared by the processed-logprob tests."""
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


# The settings: each filter alone and all combined.
SAMPLING_SETTINGS = {
    "temperature=0.6": dict(temperature=0.6),
    "temperature=1.3": dict(temperature=1.3),
    "top_p=0.9": dict(top_p=0.9),
    "top_k=20": dict(top_k=20),
    "min_p=0.05": dict(min_p=0.05),
    "combined": dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05),
}


@pytest.fixture
def sampling_settings():
    """name -> ``vllm.SamplingParams`` keyword arguments, for every setting."""
    return SAMPLING_SETTINGS


@pytest.fixture(params=list(SAMPLING_SETTINGS))
def sampling_setting(request):
    """One setting's ``vllm.SamplingParams`` keyword arguments (the test runs once per setting)."""
    return SAMPLING_SETTINGS[request.param]

"""Selected-logprob visible kernel: vLLM's sampler bytes, its native reference, bad input."""
import pytest
import torch

from megatron_vllm_align.ops.selected_logprob.kernel import selected_logprob_native, vllm_selected_logprob

pytestmark = pytest.mark.usefixtures("no_collection_while_tracing")   # vLLM's compiled sampler ops


@pytest.mark.parametrize("tokens,vocab", [(1, 512), (300, 1000)])
def test_visible_equals_vllm_sampler_and_native(tokens, vocab):
    from vllm.v1.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(tokens)
    logits = (5 * torch.randn(tokens, vocab, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[0] = int(logits[0].float().argmax())  # one argmax target
    out = vllm_selected_logprob(logits, targets)
    assert out.dtype == torch.float32 and out.shape == (tokens,)
    # vLLM's full prompt-logprob path: compute_logprobs, then gather_logprobs (selected column 0).
    ref = Sampler.gather_logprobs(Sampler.compute_logprobs(logits), 0, targets)
    assert torch.equal(out, ref.logprobs[:, 0])
    assert torch.equal(ref.logprob_token_ids[:, 0].long(), targets)
    # Native reference, documented bound: 8 * 2^-24 * (max|z| + |lse|) per token.
    z = logits.float()
    bound = 8 * 2.0 ** -24 * (z.abs().amax(dim=-1) + torch.logsumexp(z, dim=-1).abs())
    assert bool(((out - selected_logprob_native(logits, targets)).abs() <= bound).all())


def test_bad_input_is_refused():
    logits = torch.randn(3, 10).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"target_ids must lie in \[0, 10\)"):
        vllm_selected_logprob(logits, torch.tensor([0, 1, 10]))
    with pytest.raises(TypeError, match="target_ids must be a 1-D int64"):
        vllm_selected_logprob(logits, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="target_ids has 2 tokens"):
        vllm_selected_logprob(logits, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        vllm_selected_logprob(torch.zeros(3, 10, dtype=torch.int64), torch.tensor([0, 1, 2]))

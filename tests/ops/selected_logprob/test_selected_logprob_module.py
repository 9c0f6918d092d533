"""VllmSelectedLogprob: closed-form log-softmax/gather backward vs fp32 autograd (layer 1)."""
import pytest
import torch

from megatron_vllm_align.ops.selected_logprob.module import VllmSelectedLogprob
from megatron_vllm_align.ops.selected_logprob.reference import ReferenceSelectedLogprob
from megatron_vllm_align.validation import compare_vjp


@pytest.mark.parametrize("shape,columns,vocab", [((1,), 512, None), ((300,), 1000, None), ((4, 37), 1024, 1000)])
def test_backward_matches_independent_reference(one_rounding_tolerance, shape, columns, vocab):
    gen = torch.Generator().manual_seed(columns)
    logits = (4 * torch.randn(*shape, columns, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, vocab or columns, shape, generator=gen)
    flat = logits.view(-1, columns)
    flat[0, 0] = 30.0  # the first token's target is its argmax; the second's is far below (< -20)
    targets.view(-1)[0] = 0
    if flat.shape[0] > 1:
        flat[1, int(targets.view(-1)[1])] = -60.0
    # dlogits needs the softmax normaliser: a reduction over the vocabulary.
    report = compare_vjp(VllmSelectedLogprob(vocab), ReferenceSelectedLogprob(vocab),
                         [logits.requires_grad_(), targets], tolerances=one_rounding_tolerance(columns))
    assert report.passed, report.failures


def test_padded_vocabulary_gets_zero_gradient_and_blocks_cover_all_tokens(monkeypatch):
    import megatron_vllm_align.ops.selected_logprob.vjp as logprob

    monkeypatch.setattr(logprob, "_TOKENS_PER_BLOCK", 7)  # several blocks and a partial last one
    logits = torch.randn(30, 64).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (30,))
    VllmSelectedLogprob(50)(logits, targets).sum().backward()
    assert torch.equal(logits.grad[:, 50:], torch.zeros(30, 14, dtype=torch.bfloat16))
    ref = logits.detach().clone().requires_grad_()
    ReferenceSelectedLogprob(50)(ref, targets).sum().backward()
    assert float((logits.grad.float() - ref.grad.float()).abs().max()) <= 2 * 2.0 ** -8 * float(ref.grad.abs().max())


def test_bad_input_is_refused():
    module = VllmSelectedLogprob(10)
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        module(torch.randn(3, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_ids must have shape"):
        module(torch.randn(3, 10), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"target_ids must lie in \[0, 10\)"):
        module(torch.randn(3, 12), torch.tensor([0, 1, 10]))
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        VllmSelectedLogprob(0)

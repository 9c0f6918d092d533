"""VllmProcessedLogprob backward vs the independent float64 reference written from the definition
(``ReferenceProcessedLogprob``, layer 1), with planted bugs: temperature applied twice, renormalisation
over the full vocabulary, masked tokens getting gradient, top-p ties broken differently."""
import pytest
import torch

from megatron_vllm_align.ops.processed_logprob.kernel import vllm_processed_logprobs
from megatron_vllm_align.ops.processed_logprob.module import VllmProcessedLogprob
from megatron_vllm_align.ops.processed_logprob.reference import ReferenceProcessedLogprob
from megatron_vllm_align.validation import compare_vjp


def make_case(params, rows, vocab, seed, ties=None):
    """bf16 logits [rows, vocab] (``2 N(0, 1)``, or ``ties(rows, vocab, seed)``: the top-p tie rows) and
    targets drawn from the processed distribution (so they lie in the support)."""
    gen = torch.Generator().manual_seed(seed)
    logits = ties(rows, vocab, seed) if ties else 2 * torch.randn(rows, vocab, generator=gen)
    logits = logits.to(torch.bfloat16)
    targets = torch.multinomial(vllm_processed_logprobs(logits, params).exp(), 1, generator=gen)[:, 0]
    return logits.requires_grad_(), targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backward_matches_definition_reference(one_rounding_tolerance, sampling_setting, seed):
    """The tolerance is the one-rounding bound of selected_logprob (docs/method.md#tolerances): each
    side rounds dlogits to bf16 once (2u between them, u = 2^-8) after fp32 sums over the vocabulary
    (4 sqrt(V) 2^-24); the fp32 division by T perturbs each exponent by 2^-24 |z / T| (< 1e-5 in p,
    far below u). Masked entries must get exactly zero."""
    from vllm import SamplingParams

    params = SamplingParams(**sampling_setting)
    logits, targets = make_case(params, 37, 512, seed)
    report = compare_vjp(VllmProcessedLogprob(params), ReferenceProcessedLogprob(params), [logits, targets],
                         tolerances=one_rounding_tolerance(512), seed=seed)
    assert report.passed, report.failures
    logits.grad = None
    VllmProcessedLogprob(params)(logits, targets).sum().backward()
    masked = torch.isneginf(vllm_processed_logprobs(logits, params))
    assert torch.equal(logits.grad[masked].float(), torch.zeros(int(masked.sum())))
    several = (~masked).sum(-1) > 1  # a support of one token has a zero gradient
    assert bool((logits.grad[several][~masked[several]] != 0).all())


@pytest.mark.parametrize("seed", [3, 4])
def test_top_p_ties_backward_matches_definition_reference(one_rounding_tolerance, tie_logits, seed):
    from vllm import SamplingParams

    params = SamplingParams(top_p=0.9)
    logits, targets = make_case(params, 8, 512, seed, ties=tie_logits)
    report = compare_vjp(VllmProcessedLogprob(params), ReferenceProcessedLogprob(params), [logits, targets],
                         tolerances=one_rounding_tolerance(512), seed=seed)
    assert report.passed, report.failures


def _planted_fails(one_rounding_tolerance, params, logits, targets, candidate=None):
    candidate = candidate or VllmProcessedLogprob(params)
    report = compare_vjp(candidate, ReferenceProcessedLogprob(params), [logits, targets],
                         tolerances=one_rounding_tolerance(512), dy_kinds=("random",))
    return not report.passed


def test_planted_temperature_applied_twice_is_caught(one_rounding_tolerance):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.6, top_p=0.9)
    logits, targets = make_case(params, 37, 512, 0)

    class ScaleGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    class TwiceDivided(VllmProcessedLogprob):  # the forward is right; the backward divides by T again
        def forward(self, logits, target_ids):
            return super().forward(ScaleGradient.apply(logits, 1 / self.sampling_params.temperature), target_ids)

    twice = TwiceDivided(params)
    assert _planted_fails(one_rounding_tolerance, params, logits, targets, twice)


def test_planted_full_vocabulary_renormalisation_is_caught(monkeypatch, one_rounding_tolerance):
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler

    import megatron_vllm_align.ops.processed_logprob.vjp as vjp

    params = SamplingParams(temperature=0.6, top_k=20)
    logits, targets = make_case(params, 37, 512, 0)
    monkeypatch.setattr(vjp, "vllm_processed_logprobs",
                        lambda z, p: Sampler.compute_logprobs(z.float() / p.temperature))
    assert _planted_fails(one_rounding_tolerance, params, logits, targets)


def test_planted_gradient_on_masked_tokens_is_caught(monkeypatch, one_rounding_tolerance):
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler

    import megatron_vllm_align.ops.processed_logprob.vjp as vjp

    params = SamplingParams(min_p=0.05)
    logits, targets = make_case(params, 37, 512, 0)

    def leaky(z, p):  # renormalised over the support on S, the raw tempered logprob off S
        processed = vllm_processed_logprobs(z, p)
        return torch.where(torch.isneginf(processed), Sampler.compute_logprobs(z.float() / p.temperature), processed)

    monkeypatch.setattr(vjp, "vllm_processed_logprobs", leaky)
    assert _planted_fails(one_rounding_tolerance, params, logits, targets)


def test_planted_top_p_ties_broken_differently_are_caught(monkeypatch, one_rounding_tolerance, tie_logits):
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_ops
    from vllm import SamplingParams

    params = SamplingParams(top_p=0.9)
    logits, targets = make_case(params, 8, 512, 3, ties=tie_logits)
    correct = torch.isfinite(vllm_processed_logprobs(logits, params))
    vllm_order = sampler_ops.apply_top_k_top_p
    # The same masking with the columns reversed: the sort meets the tied tokens in another order.
    monkeypatch.setattr(sampler_ops, "apply_top_k_top_p", lambda z, k, p: vllm_order(z.flip(-1), k, p).flip(-1))
    flipped = torch.isfinite(vllm_processed_logprobs(logits, params))
    assert not torch.equal(flipped, correct) and torch.equal(flipped.sum(-1), correct.sum(-1))
    targets = torch.where((flipped & correct).gather(-1, targets[:, None])[:, 0], targets,
                          (flipped & correct).float().argmax(-1))  # a target both supports keep
    assert _planted_fails(one_rounding_tolerance, params, logits, targets)


def test_packed_segments_take_their_own_params(one_rounding_tolerance):
    from vllm import SamplingParams

    cold, hot = SamplingParams(temperature=0.6, top_k=20), SamplingParams(temperature=1.3, top_p=0.9)
    logits = (2 * torch.randn(30, 512, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    targets = torch.cat([make_case(cold, 30, 512, 5)[1][:12], make_case(hot, 30, 512, 5)[1][12:]])
    module = VllmProcessedLogprob(cold)
    leaf = logits.clone().requires_grad_()
    first, second = module.packed(leaf, targets, [(0, 12), (12, 29)], [cold, hot])
    assert torch.equal(first, VllmProcessedLogprob(cold)(logits[:12], targets[:12]))
    assert torch.equal(second, VllmProcessedLogprob(hot)(logits[12:29], targets[12:29]))
    (first.sum() + second.sum()).backward()
    ref = logits.clone().requires_grad_()
    reference = ReferenceProcessedLogprob(cold)(ref[:12], targets[:12]).sum()
    (reference + ReferenceProcessedLogprob(hot)(ref[12:29], targets[12:29]).sum()).backward()
    assert torch.equal(leaf.grad[29], torch.zeros(512, dtype=torch.bfloat16))
    assert float((leaf.grad.float() - ref.grad.float()).abs().max()) <= 2 * 2.0 ** -8 * float(ref.grad.abs().max())
    with pytest.raises(ValueError, match="one SamplingParams per segment"):
        module.packed(leaf, targets, [(0, 12), (12, 29)], [cold])
    with pytest.raises(ValueError, match=r"SamplingParams\.presence_penalty"):
        module.packed(leaf, targets, [(0, 12)], [SamplingParams(presence_penalty=1.0)])
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias"):
        VllmProcessedLogprob(SamplingParams(logit_bias={1: 2.0}))

"""Processed logprobs: the logprobs of the distribution vLLM samples from, by vLLM's own sampler steps.

With ``logprobs_mode='processed_logprobs'`` the CPU engine returns, per sampled token, the entry of
``log_softmax(fp32)`` taken after ``Sampler.sample`` has processed the fp32 logits in this order
(docs/sampling.md#vllms-order-of-operations): ``Sampler.apply_temperature`` (in-place division by
the fp32 temperature), the argmax-invariant logits processors (the built-in
``MinPLogitsProcessor``), ``apply_top_k_top_p`` (top-k, then top-p, masked entries set to -inf),
then ``log_softmax(dim=-1, dtype=float32)``. :func:`vllm_processed_logprobs` calls those same
functions in that order; it re-implements none of them.

Every step is row-wise, so a row's values do not depend on the other rows of the batch; a segment
of rows sharing one ``SamplingParams`` is processed as a batch of requests with equal parameters.
Parameters that act elsewhere in the sampler (penalties, logit bias, bad words, allowed token ids,
min tokens, structured outputs, thinking budget, watermarking) and greedy sampling are refused by
:func:`check_sampling_params`, naming the field.
"""
from __future__ import annotations

import functools

import torch

from megatron_vllm_align.ops.selected_logprob.kernel import check_logprob_inputs

_SAMPLING_EPS = 1e-5  # vLLM's greedy threshold on the temperature (sampling_params._SAMPLING_EPS)

# Fields that change the logits before or outside the steps this op runs: (field, its "off" value) and
# the fields that are off when empty or None.
_OFF_VALUES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0))
_OFF_WHEN_EMPTY = ("logit_bias", "bad_words", "allowed_token_ids", "watermarking")
_OFF_WHEN_NONE = ("structured_outputs", "thinking_token_budget")


def check_sampling_params(params: object) -> None:
    """Raise TypeError unless ``params`` is a ``vllm.SamplingParams``; ValueError naming the field
    for greedy sampling (temperature < 1e-5), top_p outside (0, 1], top_k not -1, 0 or >= 1, min_p
    outside [0, 1], and the first field of ``_OFF_VALUES``, ``_OFF_WHEN_EMPTY`` or ``_OFF_WHEN_NONE``
    that is not off."""
    from vllm import SamplingParams

    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a vllm.SamplingParams, got {type(params).__name__}")
    if not params.temperature >= _SAMPLING_EPS:
        raise ValueError(f"SamplingParams.temperature={params.temperature!r} < {_SAMPLING_EPS} is greedy sampling; "
                         f"processed logprobs need random sampling (temperature >= {_SAMPLING_EPS})")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"SamplingParams.top_p must lie in (0, 1], got {params.top_p!r}")
    if params.top_k < -1 or params.top_k != int(params.top_k):
        raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or a positive int, got {params.top_k!r}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"SamplingParams.min_p must lie in [0, 1], got {params.min_p!r}")
    refused = [(field, f"at {off!r}") for field, off in _OFF_VALUES if getattr(params, field) != off]
    refused += [(field, "empty") for field in _OFF_WHEN_EMPTY if getattr(params, field)]
    refused += [(field, "None") for field in _OFF_WHEN_NONE if getattr(params, field) is not None]
    if refused:
        field, off = refused[0]
        raise ValueError(f"SamplingParams.{field}={getattr(params, field)!r} is not supported by processed "
                         f"logprobs (only temperature, top_k, top_p and min_p are); leave it {off}")


@functools.cache
def _vllm_config():
    """The current engine config, else a default one (MinPLogitsProcessor reads its max_num_seqs)."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    return get_current_vllm_config_or_none() or VllmConfig()


def _min_p_processor(params):
    """vLLM's ``MinPLogitsProcessor`` holding ``params`` as the one request of a batch (its fp32
    min_p [1, 1] broadcasts over the rows)."""
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder, MinPLogitsProcessor

    processor = MinPLogitsProcessor(_vllm_config(), torch.device("cpu"), is_pin_memory=False)
    builder = BatchUpdateBuilder()
    builder.added.append((0, params, None, []))
    processor.update_state(builder.get_and_reset(batch_size=1))
    return processor


def vllm_processed_logprobs(logits: torch.Tensor, params) -> torch.Tensor:
    """fp32 processed logprobs [T, V] of ``logits`` [T, V] (any float dtype, not modified) under
    ``params`` (a checked ``vllm.SamplingParams``); -inf outside the kept support."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    rows, vocab = logits.shape
    with torch.no_grad():
        z = logits.detach().to(torch.float32, copy=True)  # the sampler's fp32 logits (its steps are in place)
        z = Sampler.apply_temperature(z, torch.full((rows,), params.temperature, dtype=torch.float32),
                                      all_random=True)
        if params.min_p:
            z = _min_p_processor(params).apply(z)
        top_k = params.top_k if 0 < params.top_k < vocab else None  # the input batch's "no top-k"
        k = None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32)
        p = None if params.top_p >= 1 else torch.full((rows,), params.top_p, dtype=torch.float32)
        z = apply_top_k_top_p(z, k, p)
        return Sampler.compute_logprobs(z)


def vllm_processed_selected_logprob(logits: torch.Tensor, target_ids: torch.Tensor, params,
                                    outside_support: str = "raise") -> torch.Tensor:
    """fp32 processed logprob [T] of ``target_ids`` [T] under ``logits`` [T, V] and ``params``. A
    target outside the kept support (which an engine with these logits cannot have sampled):
    ``outside_support="raise"`` raises ValueError, ``"neg_inf"`` gives -inf (log 0: a trainer whose
    logits differ from the engine's may exclude a token the engine kept)."""
    if outside_support not in ("raise", "neg_inf"):
        raise ValueError(f"outside_support must be 'raise' or 'neg_inf', got {outside_support!r}")
    check_logprob_inputs(logits, target_ids)
    check_sampling_params(params)
    out = vllm_processed_logprobs(logits, params).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    if outside_support == "raise" and bool(torch.isneginf(out).any()):
        row = int(torch.isneginf(out).nonzero()[0])
        raise ValueError(f"target_ids[{row}] = {int(target_ids[row])} lies outside the support kept by "
                         f"temperature/top_k/top_p/min_p ({params!r}); the engine cannot have sampled it")
    return out

"""Engine vs trainer parity: the logprobs one vLLM engine computes for prompts (prefill) and for the
tokens it samples (decode), the trainer's recompute of the same tokens, and the mismatch figures per
kind (:mod:`megatron_vllm_align.validation.logprob_mismatch`). One engine start serves both kinds. Used
by ``check`` and the main job (docs/method.md#invariance-layer for why sampled tokens need
``MVA_INVARIANT=1``).

Kinds: ``"prompt"``, the logprobs of prompt tokens 1..n-1 of each prefill sequence; ``"sampled"``, the
logprob of each sampled token of each request.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import torch

from megatron_vllm_align.engine.vllm_reference import SampledCompletion
from megatron_vllm_align.utils.token_logprobs import TokenSequence

KINDS = ("prompt", "sampled")


def seeded_sampling_params(max_tokens: Sequence[int], seed: int, sampling: Mapping[str, float] | None = None) -> list:
    """One vLLM ``SamplingParams`` per request: temperature 1 and no filter, or the ``SamplingParams``
    fields ``sampling`` (e.g. temperature, top_p, top_k, min_p), request ``i`` seeded ``seed + i``, exactly
    ``max_tokens[i]`` tokens (``ignore_eos``), the sampled token's own logprob returned (``logprobs=0``)."""
    from vllm import SamplingParams

    if not max_tokens or any(n < 1 for n in max_tokens):
        raise ValueError(f"seeded_sampling_params: max_tokens must be a non-empty sequence of ints >= 1, "
                         f"got {list(max_tokens)}")
    fields = {"temperature": 1.0, **(sampling or {})}
    return [SamplingParams(**fields, max_tokens=n, logprobs=0, seed=seed + i, ignore_eos=True)
            for i, n in enumerate(max_tokens)]


@dataclasses.dataclass(frozen=True)
class EngineLogprobs:
    """What one engine computed: the prefill sequences ``prompts`` with ``prompt`` their logprobs (fp32,
    n - 1 values each; both empty when no prompt logprobs were taken) and the sampled ``completions``."""

    prompts: list
    prompt: list[torch.Tensor]
    completions: list[SampledCompletion]

    def by_kind(self) -> dict[str, list[torch.Tensor]]:
        """``{"prompt": ..., "sampled": ...}``; ``"prompt"`` only when prompt logprobs were taken."""
        return {**({"prompt": self.prompt} if self.prompts else {}),
                "sampled": [c.logprobs for c in self.completions]}

    def sequences(self, kind: str) -> list[list[int]]:
        """The token sequences behind ``kind``'s logprobs: the prompts, or prompt + sampled tokens."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return [list(p) for p in self.prompts] if kind == "prompt" else [c.sequence for c in self.completions]


def engine_logprobs(llm, prompts: Sequence[TokenSequence], sampled_prompts: Sequence[TokenSequence],
                    sampling_params, sampled_invariant: bool | None = None) -> EngineLogprobs:
    """From the running engine ``llm``: prompt logprobs of ``prompts`` (all in one batch; none when empty),
    then the completions of ``sampled_prompts`` under ``sampling_params`` (one for all or one per request;
    :func:`seeded_sampling_params`), all submitted together. ``sampled_invariant``: ``MVA_INVARIANT`` while
    sampling (None: as this process has it); the prompt logprobs run as this process has it."""
    from megatron_vllm_align import invariance
    from megatron_vllm_align.engine.vllm_reference import prompt_logprobs, sample_completions

    prompt = prompt_logprobs(llm, prompts) if prompts else []
    switch = contextlib.nullcontext() if sampled_invariant is None else invariance.switched(sampled_invariant)
    with switch:
        completions = sample_completions(llm, sampled_prompts, sampling_params)
    return EngineLogprobs(list(prompts), prompt, completions)


def trainer_logprobs(model: torch.nn.Module, prompts: Sequence[TokenSequence], completions: Sequence[SampledCompletion],
                     routed_experts: Sequence[torch.Tensor] | None = None,
                     sampling_params=None) -> dict[str, list[torch.Tensor]]:
    """The trainer ``model``'s logprobs of what an engine computed, in this process, without autograd:
    ``{"prompt": of prompts, "sampled": of each completion's sampled tokens}`` (an empty list for a kind
    given none). ``routed_experts``: per completion, the engine's experts to replay in an MoE model's routers.
    ``sampling_params``: None (raw logprobs) or the ``vllm.SamplingParams`` the requests sampled with, for an
    engine in ``processed_logprobs`` mode (``completion_logprobs``)."""
    from megatron_vllm_align.megatron.logprobs import completion_logprobs, token_logprobs

    with torch.no_grad():
        return {"prompt": token_logprobs(model, prompts) if prompts else [],
                "sampled": completion_logprobs(model, [c.prompt for c in completions], [c.tokens for c in completions],
                                               routed_experts=routed_experts, sampling_params=sampling_params)
                if completions else []}


def mismatch(trainer: Mapping[str, Sequence[torch.Tensor]],
             engine: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, dict]:
    """Mismatch figures (``LogprobMismatch.to_dict()``) per kind of ``engine``, trainer minus engine;
    ValueError when ``trainer`` lacks a kind ``engine`` has."""
    from megatron_vllm_align.validation.logprob_mismatch import logprob_mismatch

    missing = sorted(set(engine) - set(trainer))
    if missing:
        raise ValueError(f"mismatch: the trainer has no logprobs of kind {missing}")
    return {kind: logprob_mismatch(trainer[kind], engine[kind]).to_dict() for kind in engine}

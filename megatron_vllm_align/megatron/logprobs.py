"""Per-token log-probabilities of given token sequences under a Megatron GPTModel.

The definition is vLLM's prompt logprobs: logits cast to fp32, log_softmax over the full
vocabulary, and for position t the entry of token t+1. The first token of a sequence has
no logprob, so a sequence of n tokens yields n - 1 values.

Megatron's local spec runs a right-padded batch. A vLLM-forward model (``build_gpt_from_hf(...,
align=True)``) runs the engine's step instead: all sequences packed into one ``[1, T]`` forward
(T = sum of lengths, ``packed_seq_params`` in the ``thd`` layout, positions restarting at 0), as
the engine flattens one prefill step, and per sequence vLLM's ``compute_logprobs`` on that
sequence's logits rows, as ``_get_prompt_logprobs_dict`` does per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_attr_wrapped_model

from megatron_vllm_align.utils.token_logprobs import (
    TokenSequence,
    as_token_tensor,
    next_token_logprobs,
    padded_logits,
)


def packed_step(token_rows: Sequence[torch.Tensor], device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams]:
    """(input_ids [1, T], position_ids [1, T], packed_seq_params) of 1-D token tensors packed in
    order: positions restart at 0 per sequence; ``thd`` layout with int32 ``cu_seqlens``."""
    lengths = torch.tensor([row.numel() for row in token_rows], dtype=torch.int32)
    cu_seqlens = torch.zeros(len(token_rows) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    cu_seqlens = cu_seqlens.to(device)
    input_ids = torch.cat(list(token_rows)).to(device)[None]
    position_ids = torch.cat([torch.arange(row.numel()) for row in token_rows]).to(device)[None]
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return input_ids, position_ids, params


def uses_vllm_forward(model: torch.nn.Module) -> bool:
    """True for a model whose output layer is the vLLM-forward one (``build_gpt_from_hf(align=True)``)."""
    from megatron_vllm_align.megatron.vllm_output import VllmOutputLayer

    return isinstance(get_attr_wrapped_model(model, "output_layer"), VllmOutputLayer)


# Per sequence (first, SamplingParams): the processed logprobs of tokens first..n-1 (first >= 1)
# instead of the raw logprobs of tokens 1..n-1 (module docstring of :func:`token_logprobs`).
Processed = Sequence[tuple[int, Any]]


def _selected(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
              segments: Sequence[tuple[int, int]], params: Sequence[Any] | None) -> list[torch.Tensor]:
    """Per sequence i, the logprobs of the tokens predicted by rows ``segments[i]`` = [begin, end) of
    ``logits`` [R, V'] (``targets`` [R]: each row's next token): raw (``selected_logprob``), or with
    ``params`` (one SamplingParams per sequence) processed (``processed_logprob``)."""
    from megatron_vllm_align.ops.processed_logprob import VllmProcessedLogprob
    from megatron_vllm_align.ops.selected_logprob.module import VllmSelectedLogprob

    if params is not None:
        return VllmProcessedLogprob(params[0], vocab_size, outside_support="neg_inf").packed(
            logits, targets, segments, params)
    empty = torch.zeros(0, dtype=torch.float32, device=logits.device)
    nonempty = [(begin, end) for begin, end in segments if end > begin]
    per_segment = iter(VllmSelectedLogprob(vocab_size).packed(logits, targets, nonempty) if nonempty else ())
    return [next(per_segment) if end > begin else empty for begin, end in segments]


def _first_tokens(lengths: Sequence[int], processed: Processed | None,
                  first_tokens: Sequence[int] | None) -> tuple[list[int], list[Any] | None]:
    """(per sequence the first token whose logprob is wanted, the SamplingParams or None), checked."""
    if processed is not None and first_tokens is not None:
        raise ValueError("give processed (whose entries carry the first token) or first_tokens, not both")
    if processed is None and first_tokens is None:
        return [1] * len(lengths), None
    if processed is not None:
        if len(processed) != len(lengths):
            raise ValueError(f"need one (first, SamplingParams) per sequence, got {len(processed)} for "
                             f"{len(lengths)}")
        firsts, params = [first for first, _ in processed], [sampling for _, sampling in processed]
    else:
        firsts, params = list(first_tokens), None
        if len(firsts) != len(lengths):
            raise ValueError(f"need one first token per sequence, got {len(firsts)} for {len(lengths)}")
    for i, (first, n) in enumerate(zip(firsts, lengths)):
        if not 1 <= first < n:
            raise ValueError(f"sequence {i}: the first token {first} must lie in [1, {n - 1}]")
    return firsts, params


def packed_token_logprobs(model: torch.nn.Module, sequences: Sequence[TokenSequence],
                          processed: Processed | None = None,
                          first_tokens: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Prompt logprobs of a vLLM-forward GPTModel as the engine computes them for `sequences`
    submitted together (module docstring). Same return convention as :func:`token_logprobs`. When
    some sequence starts past token 1 (``processed`` or ``first_tokens``), the output layer computes
    only the rows those tokens need, one lm_head call per sequence (``vllm_output.logits_of_rows``)."""
    from megatron_vllm_align.megatron.vllm_output import logits_of_rows

    if len(sequences) == 0:
        raise ValueError("packed_token_logprobs: sequences is empty")
    vocab_size = get_attr_wrapped_model(model, "vocab_size")
    device = next(model.parameters()).device
    token_rows = [as_token_tensor(sequence, i, vocab_size).to(device) for i, sequence in enumerate(sequences)]
    lengths = [row.numel() for row in token_rows]
    firsts, params = _first_tokens(lengths, processed, first_tokens)
    input_ids, position_ids, packing = packed_step(token_rows, device)
    starts = [end - n for n, end in zip(lengths, torch.tensor(lengths).cumsum(0).tolist())]
    targets = input_ids[0].roll(-1)   # row t's target is token t + 1 (a sequence's last row predicts nothing)
    if all(first == 1 for first in firsts):   # every row: the engine's own calls for this step
        logits = model(input_ids, position_ids, attention_mask=None, packed_seq_params=packing).squeeze(0)
        return _selected(logits, targets, vocab_size, [(start, start + n - 1) for start, n in zip(starts, lengths)],
                         params)
    rows = [torch.arange(start + first - 1, start + n - 1, device=device)
            for start, n, first in zip(starts, lengths, firsts)]
    with logits_of_rows(model, rows):
        logits = model(input_ids, position_ids, attention_mask=None, packed_seq_params=packing).squeeze(0)  # [R, V]
    ends = torch.tensor([r.numel() for r in rows]).cumsum(0).tolist()
    return _selected(logits, targets[torch.cat(rows)], vocab_size,
                     [(end - r.numel(), end) for r, end in zip(rows, ends)], params)


def padded_token_logprobs(model: torch.nn.Module, sequences: Sequence[TokenSequence],
                          processed: Processed | None = None,
                          first_tokens: Sequence[int] | None = None) -> list[torch.Tensor]:
    """:func:`token_logprobs` of one right-padded ``[b, s]`` forward (``utils.token_logprobs.padded_logits``)."""
    vocab_size = get_attr_wrapped_model(model, "vocab_size")
    device = next(model.parameters()).device
    logits_fn = lambda input_ids, position_ids: model(input_ids, position_ids, attention_mask=None)  # noqa: E731
    if processed is None:
        every = next_token_logprobs(logits_fn, sequences, vocab_size, device)
        firsts, _ = _first_tokens([len(values) + 1 for values in every], None, first_tokens)
        return [values[first - 1:] for values, first in zip(every, firsts)]
    logits, input_ids, lengths = padded_logits(logits_fn, sequences, vocab_size, device)
    firsts, params = _first_tokens(lengths, processed, None)
    width = input_ids.shape[1]
    return _selected(logits.reshape(-1, logits.shape[-1]), input_ids.roll(-1, dims=1).reshape(-1), vocab_size,
                     [(i * width + first - 1, i * width + n - 1) for i, (n, first) in enumerate(zip(lengths, firsts))],
                     params)


def token_logprobs(model: torch.nn.Module, sequences: Sequence[TokenSequence],
                   processed: Processed | None = None, first_tokens: Sequence[int] | None = None
                   ) -> list[torch.Tensor]:
    """For each sequence the fp32 logprobs of its tokens 1..n-1 under a Megatron GPTModel (possibly
    wrapped): vLLM's raw logprobs (:func:`next_token_logprobs`'s definition); with ``first_tokens`` (one
    per sequence, in [1, n - 1]) those of tokens first..n-1 only. With ``processed``, per
    sequence ``(first, SamplingParams)``: the logprobs of tokens first..n-1 under the distribution the
    engine samples from with those parameters (temperature, top-k, top-p, min-p; the
    ``processed_logprob`` op, docs/sampling.md), vLLM's ``logprobs_mode='processed_logprobs'``; -inf
    (and no gradient) for a token outside this model's kept support, which an engine whose logits differ
    may have sampled.

    Local spec: one right-padded forward with Megatron's default causal mask; each row equals
    running that sequence alone (bitwise for the local spec on CPU, tested). vLLM-forward model:
    :func:`packed_token_logprobs` (the engine's batch, bitwise the engine's values, tested).
    """
    if uses_vllm_forward(model):
        return packed_token_logprobs(model, sequences, processed, first_tokens)
    return padded_token_logprobs(model, sequences, processed, first_tokens)


SAMPLED_LAYOUTS = ("packed", "one_at_a_time", "padded")


def completion_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]], layout: str = "packed",
                        routed_experts: Sequence[torch.Tensor] | None = None,
                        sampling_params: Any = None) -> list[torch.Tensor]:
    """The trainer's fp32 logprobs of each completion's tokens given its prompt and the tokens
    before it: the values an RL loss compares with the engine's sampled-token logprobs.

    sampling_params: None for the raw logprobs (the engine's default ``logprobs_mode``); a
    ``vllm.SamplingParams`` (all sequences) or one per sequence for the logprobs under the
    distribution the engine sampled from (an engine started with
    ``logprobs_mode='processed_logprobs'``; :func:`token_logprobs`): the same objects that configured
    the engine's requests.

    layout: how the trainer batches the sequences (prompt + completion): ``"packed"`` (one packed
    forward, the aligned model's default), ``"one_at_a_time"`` (a forward per sequence) or
    ``"padded"`` (one right-padded ``[b, s]`` forward). With ``MVA_INVARIANT=1`` all three give the
    aligned model's same bits.
    routed_experts: per sequence, the engine's experts of its fed-in tokens (int [n - 1 or n,
    moe_layers, top_k], ``SampledCompletion.routed_experts``), replayed into the model's routers
    (``router_replay``) instead of the routers' own choice; packed and one-at-a-time layouts only.
    The last token of a sequence feeds no logprob, so with n - 1 rows its routing repeats the row
    before it. Returns one tensor of len(completion) per sequence.
    """
    from megatron_vllm_align.megatron.vllm_moe import router_replay

    if layout not in SAMPLED_LAYOUTS:
        raise ValueError(f"layout must be one of {SAMPLED_LAYOUTS}, got {layout!r}")
    if len(prompts) != len(completions) or len(prompts) == 0:
        raise ValueError(f"need as many completions as prompts (at least one), got {len(prompts)} and "
                         f"{len(completions)}")
    sequences = [[*map(int, prompt), *map(int, completion)] for prompt, completion in zip(prompts, completions)]
    if any(len(completion) == 0 for completion in completions) or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt and every completion must hold at least one token")
    processed = None
    if sampling_params is not None:
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} SamplingParams for {len(prompts)} sequences")
        processed = [(len(prompt), sampling) for prompt, sampling in zip(prompts, params)]
    replay = None
    if routed_experts is not None:
        if layout == "padded":
            raise ValueError("routed_experts replay needs layout 'packed' or 'one_at_a_time'")
        if len(routed_experts) != len(sequences):
            raise ValueError(f"routed_experts has {len(routed_experts)} entries for {len(sequences)} sequences")
        replay = [replay_rows(ids, len(seq), i) for i, (ids, seq) in enumerate(zip(routed_experts, sequences))]

    firsts = [len(prompt) for prompt in prompts]

    def forward(rows: list[int], replay_ids: list[torch.Tensor] | None) -> list[torch.Tensor]:
        batch = [sequences[i] for i in rows]
        picked = dict(first_tokens=[firsts[i] for i in rows]) if processed is None else \
            dict(processed=[processed[i] for i in rows])
        if replay_ids is None:
            return token_logprobs(model, batch, **picked)
        with router_replay(model, torch.cat(replay_ids).unbind(1)):  # per MoE layer [tokens, top_k]
            return token_logprobs(model, batch, **picked)

    if layout == "packed":
        return forward(list(range(len(sequences))), replay)
    if layout == "one_at_a_time":
        return [forward([i], None if replay is None else [replay[i]])[0] for i in range(len(sequences))]
    return padded_token_logprobs(model, sequences, processed, None if processed is not None else firsts)


def replay_rows(routed: torch.Tensor, sequence_length: int, index: int) -> torch.Tensor:
    """``routed`` (int [n - 1 or n, layers, top_k]) as int32 [n, layers, top_k] for a sequence of n
    tokens, the last row repeated when the engine recorded n - 1 (module docstring of
    :func:`completion_logprobs`)."""
    routed = torch.as_tensor(routed)
    if routed.dim() != 3 or routed.shape[0] not in (sequence_length - 1, sequence_length):
        raise ValueError(f"routed_experts[{index}] must be [n - 1 or n, layers, top_k] with "
                         f"n = {sequence_length}, got {tuple(routed.shape)}")
    if routed.shape[0] == sequence_length - 1:
        routed = torch.cat([routed, routed[-1:]])
    return routed.to(torch.int32)

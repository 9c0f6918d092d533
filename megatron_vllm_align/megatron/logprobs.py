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

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_attr_wrapped_model

from megatron_vllm_align.utils.token_logprobs import TokenSequence, as_token_tensor, next_token_logprobs


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


def packed_token_logprobs(model: torch.nn.Module, sequences: Sequence[TokenSequence]) -> list[torch.Tensor]:
    """Prompt logprobs of a vLLM-forward GPTModel as the engine computes them for `sequences`
    submitted together (module docstring). Same return convention as :func:`next_token_logprobs`."""
    from megatron_vllm_align.ops.selected_logprob.module import VllmSelectedLogprob

    if len(sequences) == 0:
        raise ValueError("packed_token_logprobs: sequences is empty")
    vocab_size = get_attr_wrapped_model(model, "vocab_size")
    device = next(model.parameters()).device
    token_rows = [as_token_tensor(sequence, i, vocab_size).to(device) for i, sequence in enumerate(sequences)]
    input_ids, position_ids, params = packed_step(token_rows, device)
    logits = model(input_ids, position_ids, attention_mask=None, packed_seq_params=params).squeeze(0)  # [T, V]
    lengths = [row.numel() for row in token_rows]
    ends = torch.tensor(lengths).cumsum(0).tolist()
    segments = [(end - n, end - 1) for n, end in zip(lengths, ends) if n > 1]
    if not segments:
        return [torch.zeros(0, dtype=torch.float32, device=device) for _ in token_rows]
    # Row t's target is token t + 1; the last row of a sequence lies outside every segment.
    per_segment = iter(VllmSelectedLogprob(vocab_size).packed(logits, input_ids[0].roll(-1), segments))
    return [next(per_segment) if n > 1 else torch.zeros(0, dtype=torch.float32, device=device) for n in lengths]


def token_logprobs(model: torch.nn.Module, sequences: Sequence[TokenSequence]) -> list[torch.Tensor]:
    """:func:`next_token_logprobs` of a Megatron GPTModel (possibly wrapped) on `sequences`.

    Local spec: one right-padded forward with Megatron's default causal mask; each row equals
    running that sequence alone (bitwise for the local spec on CPU, tested). vLLM-forward model:
    :func:`packed_token_logprobs` (the engine's batch, bitwise the engine's values, tested).
    """
    if uses_vllm_forward(model):
        return packed_token_logprobs(model, sequences)
    vocab_size = get_attr_wrapped_model(model, "vocab_size")
    device = next(model.parameters()).device
    return next_token_logprobs(
        lambda input_ids, position_ids: model(input_ids, position_ids, attention_mask=None),
        sequences,
        vocab_size,
        device,
    )


SAMPLED_LAYOUTS = ("packed", "one_at_a_time", "padded")


def completion_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]], layout: str = "packed",
                        routed_experts: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The trainer's fp32 logprobs of each completion's tokens given its prompt and the tokens
    before it: the values an RL loss compares with the engine's sampled-token logprobs.

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
    replay = None
    if routed_experts is not None:
        if layout == "padded":
            raise ValueError("routed_experts replay needs layout 'packed' or 'one_at_a_time'")
        if len(routed_experts) != len(sequences):
            raise ValueError(f"routed_experts has {len(routed_experts)} entries for {len(sequences)} sequences")
        replay = [replay_rows(ids, len(seq), i) for i, (ids, seq) in enumerate(zip(routed_experts, sequences))]

    def forward(batch: list[list[int]], replay_ids: list[torch.Tensor] | None) -> list[torch.Tensor]:
        if replay_ids is None:
            return token_logprobs(model, batch)
        with router_replay(model, torch.cat(replay_ids).unbind(1)):  # per MoE layer [tokens, top_k]
            return token_logprobs(model, batch)

    if layout == "packed":
        every = forward(sequences, replay)
    elif layout == "one_at_a_time":
        every = [forward([seq], None if replay is None else [replay[i]])[0] for i, seq in enumerate(sequences)]
    else:
        vocab_size = get_attr_wrapped_model(model, "vocab_size")
        device = next(model.parameters()).device
        every = next_token_logprobs(lambda ids, pos: model(ids, pos, attention_mask=None), sequences, vocab_size,
                                    device)
    return [values[len(prompt) - 1:] for values, prompt in zip(every, prompts)]


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

"""Prompt logprobs of a Hugging Face checkpoint run by transformers: the independent reference.

In fp32 it is the baseline of three-way comparisons (engine and trainer errors are measured
against it); in bf16 it is the "another framework" point of comparison for the engine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from megatron_vllm_align.utils.token_logprobs import TokenSequence, next_token_logprobs


def hf_token_logprobs(
    checkpoint_dir: str | os.PathLike, sequences: Sequence[TokenSequence], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Load the checkpoint with transformers in `dtype` and return :func:`next_token_logprobs` of it.

    Same definition as the engine's prompt logprobs (fp32 log_softmax of the logits, next token);
    one right-padded batch, no gradients.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype)
    model.eval()
    with torch.no_grad():
        return next_token_logprobs(
            lambda input_ids, position_ids: model(input_ids=input_ids, position_ids=position_ids).logits,
            sequences,
            model.config.vocab_size,
        )

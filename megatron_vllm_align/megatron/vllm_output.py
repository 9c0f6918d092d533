"""GPTModel's output layer with vLLM's logits forward (``ops.output_layer``), sharing the model's
weight Parameter.

``GPTModel`` builds ``output_layer`` itself (not from the layer spec) and does not pass it the
packing; :func:`install_vllm_output_layer` replaces it with :class:`VllmOutputLayer` holding the
SAME weight Parameter (no new parameter; tied embeddings: the embedding's), and registers a
forward pre-hook on the model that hands each call's ``packed_seq_params`` to it, so
:class:`~megatron_vllm_align.ops.output_layer.module.OutputLogitsFunction` makes the engine's
lm_head calls in the step's packed layout (or one sequence per batch row without packing).
Under tensor parallelism the weight is the rank's vocabulary shard ``[V / T, h]`` and the logits
of all shards are gathered (:mod:`.vllm_tensor_parallel`), so ``forward`` always returns the full
vocabulary.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model
from torch import nn

from megatron_vllm_align.megatron.engine_layout import EngineShardedLMHeadKernel, engine_shards
from megatron_vllm_align.megatron.vllm_attention import is_packed
from megatron_vllm_align.megatron.vllm_linear import MegatronLinearExtraState
from megatron_vllm_align.megatron.vllm_tensor_parallel import (
    output_logits_enter,
    output_logits_gather,
    vocab_shard,
)
from megatron_vllm_align.ops.attention.kernel import seq_lens_from_cu_seqlens
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel, engine_logit_calls
from megatron_vllm_align.ops.output_layer.module import OutputLogitsFunction
from megatron_vllm_align.ops.refresh import ProbedDeployedValue, probe_input
from megatron_vllm_align.ops.vllm_context import VllmContext


class VllmOutputLayer(ProbedDeployedValue, MegatronLinearExtraState, nn.Module):
    """Drop-in for GPTModel's ``output_layer``: ``forward(hidden [s, b, h], weight=None, ...) ->
    (logits [s, b, V], None)`` through :class:`OutputLogitsFunction` (``weight``: [V / T, h] at
    tensor parallel size T). ``shards`` > 1: a TP 1 trainer computing a TP ``shards`` engine's vocabulary
    shards (:mod:`.engine_layout`).

    ``weight``: the model's output weight Parameter. ``owns_weight=True`` registers it as this
    module's ``weight`` (same object, name ``output_layer.weight``); False (tied embeddings)
    keeps it unregistered and expects GPTModel to pass it in each call. ``refresh_deployed()``
    rebuilds the shadow; a forward on a stale shadow raises.
    """

    contract_name = "output_layer"

    def __init__(self, weight: nn.Parameter, *, owns_weight: bool, vllm_context: VllmContext,
                 logit_scale: float = 1.0, shards: int = 1) -> None:
        super().__init__()
        if owns_weight:
            self.weight = weight
        else:
            self.weight = None
        object.__setattr__(self, "deployed_source", weight)
        self.kernel = VllmLMHeadKernel(vllm_context, weight.shape[0], weight.shape[1], logit_scale) if shards == 1 \
            else EngineShardedLMHeadKernel(vllm_context, weight.shape[0], weight.shape[1], logit_scale, shards=shards)
        self.packed_seq_params: Any = None
        self.logit_rows: list[torch.Tensor] | None = None   # set by :func:`logits_of_rows`
        self._deployed_stamp: tuple[int, int] | None = None
        self.refresh_deployed()

    def _source_stamp(self) -> tuple[int, int]:
        return self.deployed_source.data_ptr(), self.deployed_source._version

    def _new_kernel(self) -> VllmLMHeadKernel:
        return self.kernel.fresh()

    def _load_deployed(self, kernel: VllmLMHeadKernel) -> None:
        kernel.load(self.deployed_source)

    def _probe(self, kernel: VllmLMHeadKernel) -> torch.Tensor:
        return kernel(probe_input(kernel.hidden_size, kernel.context.model_dtype))

    def refresh_deployed(self) -> None:
        """Rebuild the shadow lm_head from the current output weight."""
        self._load_deployed(self.kernel)
        self._deployed_stamp = self._source_stamp()

    def deploy_from(self, weight: torch.Tensor) -> None:
        """Make ``weight`` the output weight (the Parameter the model now passes: FSDP2 swaps in
        freshly gathered ones) and rebuild the shadow from it."""
        object.__setattr__(self, "deployed_source", weight)
        self.refresh_deployed()

    def capture_packing(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the model: remember this call's ``packed_seq_params`` (7th argument)."""
        self.packed_seq_params = kwargs.get("packed_seq_params", args[6] if len(args) > 6 else None)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        weight = self.weight if weight is None else weight
        if weight is not self.deployed_source:
            raise ValueError("VllmOutputLayer: the output weight passed in is not the Parameter its shadow was "
                             "built from")
        if self._deployed_stamp != self._source_stamp():
            raise RuntimeError("VllmOutputLayer: the output weight changed since the deployed value was built; "
                               "call refresh_deployed() (or register_deployed_refresh(optimizer, model))")
        seq_len, batch, hidden = hidden_states.shape
        if is_packed(self.packed_seq_params):
            seq_lens = seq_lens_from_cu_seqlens(self.packed_seq_params.cu_seqlens_q)
            if batch != 1 or sum(seq_lens) != seq_len:
                raise ValueError(f"packed hidden states {tuple(hidden_states.shape)} do not match cu_seqlens_q "
                                 f"lengths {seq_lens}")
            rows = output_logits_enter(hidden_states.reshape(seq_len, hidden))
            if self.logit_rows is None:
                logits = OutputLogitsFunction.apply(rows, weight, self.kernel, engine_logit_calls(seq_lens))
            else:
                picked = torch.cat(self.logit_rows).to(rows.device)
                if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= seq_len):
                    raise ValueError(f"logit rows outside the packed step's {seq_len} positions")
                ends = torch.tensor([r.numel() for r in self.logit_rows]).cumsum(0).tolist()
                calls = [torch.arange(end - r.numel(), end) for r, end in zip(self.logit_rows, ends) if r.numel()]
                logits = OutputLogitsFunction.apply(rows.index_select(0, picked), weight, self.kernel, calls)
            return output_logits_gather(logits).unsqueeze(1), None
        if self.logit_rows is not None:
            raise ValueError("VllmOutputLayer: logit rows are chosen only in a packed step")
        rows = output_logits_enter(hidden_states.transpose(0, 1).reshape(batch * seq_len, hidden))
        calls = engine_logit_calls((seq_len,) * batch)
        logits = output_logits_gather(OutputLogitsFunction.apply(rows, weight, self.kernel, calls))
        return logits.view(batch, seq_len, -1).transpose(0, 1), None

    def extra_repr(self) -> str:
        return f"vocab_size={self.kernel.vocab_size}, hidden_size={self.kernel.hidden_size}, " \
               f"tied={self.weight is None}"


@contextlib.contextmanager
def logits_of_rows(model: nn.Module, rows: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within it, the vLLM-forward output layer of ``model`` computes in a packed step only the logits of
    ``rows`` (per packed sequence, int positions in the step's packed order; each one lm_head call, as the
    engine makes one for a request's prompt-logprob rows) and returns them as ``[R, 1, V]``, R = all rows in
    order. At a vocabulary of 10^5 the lm_head is most of a forward's work: logprobs of a completion need
    only its rows."""
    layer = get_attr_wrapped_model(model, "output_layer")
    if not isinstance(layer, VllmOutputLayer):
        raise TypeError(f"logits_of_rows needs a vLLM-forward output layer, got {type(layer).__name__}")
    layer.logit_rows = list(rows)
    try:
        yield
    finally:
        layer.logit_rows = None


def output_weight(model: nn.Module) -> nn.Parameter:
    """A GPTModel's output weight Parameter as it is now: the embedding's when tied."""
    weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else model.output_layer.weight)
    if weight is None:
        raise ValueError("the model has no output weight to share (not the last pipeline stage?)")
    return weight


def install_vllm_output_layer(model: nn.Module, vllm_context: VllmContext) -> VllmOutputLayer:
    """Replace ``model.output_layer`` (a GPTModel's) by a :class:`VllmOutputLayer` on the same weight
    Parameter and register the packing pre-hook; returns the new layer."""
    tied = bool(model.share_embeddings_and_output_weights)
    weight = output_weight(model)
    trainer_tp = parallel_state.get_tensor_model_parallel_world_size()
    shards = engine_shards(vllm_context, trainer_tp)
    vocab_shard(model.vocab_size, trainer_tp * shards)
    scale = getattr(vllm_context.vllm_config.model_config.hf_config, "logit_scale", 1.0)
    layer = VllmOutputLayer(weight, owns_weight=not tied, vllm_context=vllm_context, logit_scale=scale,
                            shards=shards)
    model.output_layer = layer
    model.register_forward_pre_hook(layer.capture_packing, with_kwargs=True)
    return layer

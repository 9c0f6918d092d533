"""GPTModel's output layer with vLLM's logits forward, sharing the model's weight Parameter.

vLLM computes logits with ``LogitsProcessor(lm_head, hidden_states)``: ``lm_head`` is a
``ParallelLMHead`` (vocabulary padded to a multiple of 64 rows with zeros, its weight processed
by ``UnquantizedEmbeddingMethod``, i.e. the same CPU GEMM dispatch as the linear layers), the
GEMM output is bf16 and the padded columns are cut off. :class:`VllmLMHeadKernel` builds exactly
those two vLLM objects (in the engine's config context) as the shadow of the master weight.

The engine runs that GEMM on particular row sets of one step's hidden states, and GEMM bytes can
depend on the row count M. For prompt logprobs (``GPUModelRunner._get_prompt_logprobs_dict``)
each request's positions ``0..n-2`` form one call; the last position of every request is in one
call for the sampler (M = number of requests). :class:`OutputLogitsFunction` runs the same
calls, in the packed layout given by the step's ``packed_seq_params`` (or one sequence per
batch row without them), and writes every position's logits. Its backward is one closed-form
linear VJP over all rows (``linear_vjp``: fp32, dX from the master weight), contract
``dense_linear``.

``GPTModel`` builds ``output_layer`` itself (not from the layer spec) and does not pass it the
packing; :func:`install_vllm_output_layer` replaces it with :class:`VllmOutputLayer` holding the
SAME weight Parameter (no new parameter; tied embeddings: the embedding's), and registers a
forward pre-hook on the model that hands each call's ``packed_seq_params`` to it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vllm_align.kernels.attention import seq_lens_from_cu_seqlens
from megatron_vllm_align.kernels.vllm_context import VllmContext
from megatron_vllm_align.megatron.vllm_attention import is_packed
from megatron_vllm_align.megatron.vllm_linear import MegatronLinearExtraState
from megatron_vllm_align.modules.linear import linear_vjp


class VllmLMHeadKernel:
    """Shadow vLLM ``ParallelLMHead(vocab_size, hidden_size)`` + ``LogitsProcessor(vocab_size,
    scale=logit_scale)``; ``kernel(x [M, h]) -> logits [M, vocab_size]`` in the model dtype."""

    def __init__(self, context: VllmContext, vocab_size: int, hidden_size: int, logit_scale: float = 1.0) -> None:
        self.context = context
        self.vocab_size, self.hidden_size, self.logit_scale = vocab_size, hidden_size, logit_scale
        self.lm_head: Any = None
        with context.active(parallel_state=True, building=True):
            from vllm.model_executor.layers.logits_processor import LogitsProcessor

            self.logits_processor: Any = LogitsProcessor(vocab_size, scale=logit_scale)

    def load(self, weight: torch.Tensor) -> None:
        """Rebuild the shadow from master ``weight`` [vocab_size, hidden_size] (cast to the model dtype)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"output weight must be {(self.vocab_size, self.hidden_size)}, got {tuple(weight.shape)}")
        with torch.no_grad(), self.context.active(parallel_state=True, building=True):
            lm_head = ParallelLMHead(self.vocab_size, self.hidden_size, params_dtype=self.context.model_dtype,
                                     prefix="lm_head")
            lm_head.weight_loader(lm_head.weight, weight.detach().to(self.context.model_dtype))
            lm_head.quant_method.process_weights_after_loading(lm_head)
        self.lm_head = lm_head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("the shadow lm_head has no deployed value yet: call load(weight)")
        if x.dtype != self.context.model_dtype or x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be {self.context.model_dtype} [M, {self.hidden_size}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        with torch.no_grad(), self.context.active(parallel_state=True):
            return self.logits_processor(self.lm_head, x.detach())


def engine_logit_calls(seq_lens: tuple[int, ...]) -> list[torch.Tensor]:
    """Row index sets of the engine's lm_head calls for one prefill step of sequences packed in
    order: per sequence its positions 0..n-2 (prompt logprobs), then all last positions (sampler)."""
    calls, start = [], 0
    for n in seq_lens:
        if n > 1:
            calls.append(torch.arange(start, start + n - 1))
        start += n
    calls.append(torch.tensor([end - 1 for end in torch.tensor(seq_lens).cumsum(0).tolist()]))
    return calls


class OutputLogitsFunction(torch.autograd.Function):
    """``apply(hidden [T, h], weight [V, h], kernel, seq_lens) -> logits [T, V]``: vLLM's
    lm_head calls on the engine's row sets (module docstring), closed-form linear backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, kernel: VllmLMHeadKernel,
                seq_lens: tuple[int, ...]) -> torch.Tensor:
        logits = hidden.new_empty(hidden.shape[0], kernel.vocab_size)
        for rows in engine_logit_calls(seq_lens):
            logits[rows] = kernel(hidden[rows])
        ctx.save_for_backward(hidden, weight)
        ctx.model_dtype = kernel.context.model_dtype
        return logits

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False)
        grad_hidden, grad_weight, _ = linear_vjp(grad_logits, hidden, weight.detach().to(ctx.model_dtype), None,
                                                 hidden.dtype, weight.dtype, needs)
        return grad_hidden, grad_weight, None, None


class VllmOutputLayer(MegatronLinearExtraState, nn.Module):
    """Drop-in for GPTModel's ``output_layer``: ``forward(hidden [s, b, h], weight=None, ...) ->
    (logits [s, b, V], None)`` through :class:`OutputLogitsFunction`.

    ``weight``: the model's output weight Parameter. ``owns_weight=True`` registers it as this
    module's ``weight`` (same object, name ``output_layer.weight``); False (tied embeddings)
    keeps it unregistered and expects GPTModel to pass it in each call. ``refresh_deployed()``
    rebuilds the shadow; a forward on a stale shadow raises.
    """

    contract_name = "dense_linear"

    def __init__(self, weight: nn.Parameter, *, owns_weight: bool, vllm_context: VllmContext,
                 logit_scale: float = 1.0) -> None:
        super().__init__()
        if owns_weight:
            self.weight = weight
        else:
            self.weight = None
        object.__setattr__(self, "deployed_source", weight)
        self.kernel = VllmLMHeadKernel(vllm_context, weight.shape[0], weight.shape[1], logit_scale)
        self.packed_seq_params: Any = None
        self._deployed_stamp: tuple[int, int] | None = None
        self.refresh_deployed()

    def _source_stamp(self) -> tuple[int, int]:
        return self.deployed_source.data_ptr(), self.deployed_source._version

    def refresh_deployed(self) -> None:
        """Rebuild the shadow lm_head from the current output weight."""
        self.kernel.load(self.deployed_source)
        self._deployed_stamp = self._source_stamp()

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
            logits = OutputLogitsFunction.apply(hidden_states.reshape(seq_len, hidden), weight, self.kernel,
                                                seq_lens)
            return logits.unsqueeze(1), None
        rows = hidden_states.transpose(0, 1).reshape(batch * seq_len, hidden)
        logits = OutputLogitsFunction.apply(rows, weight, self.kernel, (seq_len,) * batch)
        return logits.view(batch, seq_len, -1).transpose(0, 1), None

    def extra_repr(self) -> str:
        return f"vocab_size={self.kernel.vocab_size}, hidden_size={self.kernel.hidden_size}, " \
               f"tied={self.weight is None}"


def install_vllm_output_layer(model: nn.Module, vllm_context: VllmContext) -> VllmOutputLayer:
    """Replace ``model.output_layer`` (a GPTModel's) by a :class:`VllmOutputLayer` on the same weight
    Parameter and register the packing pre-hook; returns the new layer."""
    tied = bool(model.share_embeddings_and_output_weights)
    weight = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
    if weight is None:
        raise ValueError("the model has no output weight to share (not the last pipeline stage?)")
    scale = getattr(vllm_context.vllm_config.model_config.hf_config, "logit_scale", 1.0)
    layer = VllmOutputLayer(weight, owns_weight=not tied, vllm_context=vllm_context, logit_scale=scale)
    model.output_layer = layer
    model.register_forward_pre_hook(layer.capture_packing, with_kwargs=True)
    return layer

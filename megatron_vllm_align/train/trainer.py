"""One training arm: forward, masked loss, backward, data-parallel reduction (an FSDP2-sharded model's
reduce-scatter, ``megatron.fsdp2.shard_for_training``, instead), clipping, AdamW on fp32 main copies of bf16
parameters (:mod:`.main_params`, ``optimizer.main_params_dtype``), deployed-value refresh (a sharded model
redeploys at every forward instead), and the per-step metrics.

Loss (shared by every arm): the masked next-token NLL summed over the global batch, divided by its
masked token count; each rank divides its own sum by the global count, so the all-reduced SUM of
gradients is the gradient of the global mean. Metrics, one dict per optimizer step (``step`` 1-based):
``train_loss`` (before the step), ``val_nll`` (validation split after the step; None when not evaluated),
``grad_norm`` (global L2 norm, before clipping, of the gradients AdamW steps with: fp32 with main copies;
under TP over the full parameters, each shard once), ``grad_norm_clipped`` (the same after clipping),
``clip_coef`` (1.0 = not clipped), ``clipped``, ``update_rms`` (RMS of the parameters' change over every
trainable element, fp64), ``nonfinite`` (non-finite gradient elements plus a non-finite loss; a step with
any is skipped), ``lr``, ``tokens`` / ``loss_tokens`` (all / masked tokens of the global batch),
``tokens_per_s`` (tokens / step wall time). Panels: docs/panels.md.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megatron_vllm_align.megatron.fsdp2 import is_fully_sharded
from megatron_vllm_align.megatron.vllm_tensor_parallel import sum_head_norm_grads
from megatron_vllm_align.ops.refresh import register_deployed_refresh
from megatron_vllm_align.train.config import OptimizerSection
from megatron_vllm_align.train.data import SFTExample
from megatron_vllm_align.train.distributed import all_reduce_gradients, full_parameter_sums
from megatron_vllm_align.train.main_params import MainParamsOptimizer
from megatron_vllm_align.utils.dtensors import local_part

LogprobsFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]
# (per-example logprobs of tokens 1..n-1, the examples) -> fp32 scalar summed over this rank's examples
LossSum = Callable[[Sequence[torch.Tensor], Sequence[Any]], torch.Tensor]
# elements per fp64 chunk of a gradient's sum of squares (8 MiB of fp64 at a time)
SQUARE_SUM_CHUNK = 1 << 20


def lr_at(step: int, total_steps: int, section: OptimizerSection) -> float:
    """Learning rate of 1-based `step`: linear warmup over ``warmup_steps``, then cosine from
    ``lr`` to ``min_lr`` at ``total_steps``."""
    if step <= section.warmup_steps:
        return section.lr * step / max(section.warmup_steps, 1)
    span = max(total_steps - section.warmup_steps, 1)
    progress = min((step - section.warmup_steps) / span, 1.0)
    return section.min_lr + 0.5 * (section.lr - section.min_lr) * (1 + math.cos(math.pi * progress))


def masked_nll_sum(logprobs: Sequence[torch.Tensor], examples: Sequence[SFTExample]) -> torch.Tensor:
    """Sum of -logprob over the masked targets of `examples` (fp32 scalar, autograd kept)."""
    total = torch.zeros((), dtype=torch.float32)
    for i, (values, example) in enumerate(zip(logprobs, examples, strict=True)):
        if values.shape != example.loss_mask.shape:
            raise ValueError(
                f"logprobs[{i}] has shape {tuple(values.shape)}, loss_mask {tuple(example.loss_mask.shape)}")
        total = total + (-values[example.loss_mask.to(values.device)]).sum().float().cpu()
    return total


class Trainer:
    """One arm of training (``world_size`` data-parallel ranks in ``data_parallel_group``, None: the
    default group). ``logprobs_fn(token_rows)`` gives the per-token logprobs whose
    gradient reaches ``model``'s parameters; ``eval_logprobs_fn`` (default: the same) is run
    under no_grad for the validation NLL. ``frozen`` names parameters kept out of the optimizer.
    ``step_guard()`` returns a context manager wrapped around each ``optimizer.step()``.
    ``keep_tensors`` keeps the last reduced (pre-clipping, as stepped: fp32 with main copies)
    gradient and the parameter update by name, for comparisons between arms. ``optimizer`` is a
    :class:`~megatron_vllm_align.train.main_params.MainParamsOptimizer` whose ``.optimizer`` is
    AdamW. The deployed values of an aligned model are refreshed after every optimizer step,
    once the main copies are copied back. ``last_grad_squares`` holds, per trainable parameter name,
    the fp64 sum of squares of the last step's reduced gradient before clipping (0-d tensors; their
    sum is ``grad_norm`` squared), for per-module gradient norms.
    """

    def __init__(self, model: nn.Module, logprobs_fn: LogprobsFn, optimizer: OptimizerSection, *,
                 total_steps: int, world_size: int = 1, data_parallel_group: Any = None, frozen: Sequence[str] = (),
                 eval_logprobs_fn: LogprobsFn | None = None, keep_tensors: bool = False,
                 step_guard: Callable[[], Any] = contextlib.nullcontext) -> None:
        names = dict(model.named_parameters())
        unknown = [name for name in frozen if name not in names]
        if unknown:
            raise ValueError(f"guards.freeze: no parameter named {unknown} in the model")
        for name in frozen:
            names[name].requires_grad_(False)
        self.model = model
        self.named_params = {name: p for name, p in names.items() if p.requires_grad}
        self.params = list(self.named_params.values())
        self.logprobs_fn = logprobs_fn
        self.eval_logprobs_fn = eval_logprobs_fn or logprobs_fn
        self.section = optimizer
        self.total_steps = total_steps
        self.world_size = world_size
        self.data_parallel_group = data_parallel_group
        self.keep_tensors = keep_tensors
        self.step_guard = step_guard
        main_dtype = None if optimizer.main_params_dtype == "none" else getattr(torch, optimizer.main_params_dtype)
        self.optimizer = MainParamsOptimizer(
            self.params, lambda stepped: torch.optim.AdamW(stepped, lr=optimizer.lr, betas=optimizer.betas,
                                                           eps=optimizer.eps, weight_decay=optimizer.weight_decay),
            main_dtype)
        self.sharded = is_fully_sharded(model)   # FSDP2: reduce-scatter and per-forward redeploy instead
        if not self.sharded:
            register_deployed_refresh(self.optimizer, model)
        self.last_gradients: dict[str, torch.Tensor] = {}
        self.last_grad_squares: dict[str, torch.Tensor] = {}
        self.last_update: dict[str, torch.Tensor] = {}
        self._pending: dict[str, Any] | None = None

    def forward_backward(self, examples: Sequence[Any], global_loss_tokens: int,
                         loss_sum: LossSum = masked_nll_sum) -> float:
        """Loss and reduced gradient of this rank's `examples` (each with ``tokens``); returns the
        global loss ``sum over ranks of loss_sum(...) / global_loss_tokens`` (default: the masked NLL
        of the module docstring). The update is applied by :meth:`apply_update`."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        logprobs = self.logprobs_fn([example.tokens for example in examples])
        loss = loss_sum(logprobs, examples) / global_loss_tokens
        loss.backward()
        sum_head_norm_grads(self.model)
        if not self.sharded:   # FSDP2 reduce-scattered them in the backward (megatron.fsdp2.shard_for_training)
            all_reduce_gradients(self.params, self.world_size, self.data_parallel_group)
        global_loss = loss.detach().clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(global_loss, group=self.data_parallel_group)
        self._pending = {"train_loss": float(global_loss), "start": start}
        return float(global_loss)

    def _full_square_sums(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter fp64 sums of the squared gradient elements over each full parameter. A sum over
        shards and then over ranks (FSDP) is in another order than one over the whole tensor; in fp32 that
        moves the norm, and with it the clipping coefficient, by an ulp, enough to move some weights off the
        data-parallel run's bits. In fp64 (where the square of an fp32 or bf16 element is exact) the two
        orders differ only in bits that the fp32 product ``gradient * clip_coef`` rounds away. Summed in
        chunks of :data:`SQUARE_SUM_CHUNK` elements, so no fp64 copy of a whole gradient exists."""
        zero = torch.zeros((), dtype=torch.float64)
        return full_parameter_sums([sum((chunk.double().square().sum() for chunk in
                                         local_part(g).flatten().split(SQUARE_SUM_CHUNK)), zero)
                                    for g in grads], self.params)

    @torch.no_grad()
    def apply_update(self, step: int, global_tokens: int, global_loss_tokens: int) -> dict[str, Any]:
        """Copy the gradients into the main copies, clip them, step AdamW (unless anything is
        non-finite), copy back, refresh, and return the step's metrics
        (``val_nll`` is filled in by :meth:`evaluate`)."""
        if self._pending is None:
            raise RuntimeError("Trainer.apply_update: call forward_backward first")
        pending, self._pending = self._pending, None
        grads = [g if g is not None else torch.zeros_like(t)
                 for g, t in zip(self.optimizer.prepare_grads(), self.optimizer.stepped)]
        nonfinite = int(sum(full_parameter_sums([(~torch.isfinite(local_part(g))).sum().float() for g in grads],
                                                self.params))) + int(not math.isfinite(pending["train_loss"]))
        squares = self._full_square_sums(grads)
        grad_norm = math.sqrt(float(sum(squares)))
        self.last_grad_squares = dict(zip(self.named_params, squares))
        clip_coef = 1.0
        if self.section.clip_grad > 0 and math.isfinite(grad_norm):
            clip_coef = min(1.0, self.section.clip_grad / (grad_norm + 1e-6))
        if self.keep_tensors:
            self.last_gradients = {name: g.detach().clone() for name, g in zip(self.named_params, grads)}
        before = [local_part(p).detach().clone() for p in self.params]
        lr = lr_at(step, self.total_steps, self.section)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm_clipped = grad_norm
        if nonfinite == 0:
            if clip_coef < 1.0:
                for g in grads:
                    g.mul_(clip_coef)
                grad_norm_clipped = math.sqrt(float(sum(self._full_square_sums(grads))))
            with self.step_guard():
                self.optimizer.step()
        deltas = [local_part(p).detach().double() - b.double() for p, b in zip(self.params, before)]
        if self.keep_tensors:
            self.last_update = dict(zip(self.named_params, deltas))
        counts = full_parameter_sums([torch.tensor(float(d.numel())) for d in deltas], self.params)
        update_squares = full_parameter_sums([(d ** 2).sum() for d in deltas], self.params)
        update_rms = math.sqrt(float(sum(update_squares)) / float(sum(counts)))
        elapsed = time.perf_counter() - pending["start"]
        return {
            "step": step, "train_loss": pending["train_loss"], "val_nll": None, "grad_norm": grad_norm,
            "grad_norm_clipped": grad_norm_clipped, "clip_coef": clip_coef, "clipped": clip_coef < 1.0,
            "update_rms": update_rms, "nonfinite": nonfinite,
            "skipped": nonfinite > 0, "lr": lr, "tokens": global_tokens, "loss_tokens": global_loss_tokens,
            "tokens_per_s": global_tokens / elapsed if elapsed > 0 else None,
        }

    def exclude_from_timing(self, seconds: float) -> None:
        """Leave ``seconds`` spent between :meth:`forward_backward` and :meth:`apply_update` on other
        work (the layer-2 hook's measure) out of the step's ``tokens_per_s``."""
        if self._pending is None:
            raise RuntimeError("Trainer.exclude_from_timing: call forward_backward first")
        self._pending["start"] += seconds

    def train_step(self, step: int, examples: Sequence[SFTExample], global_tokens: int,
                   global_loss_tokens: int) -> dict[str, Any]:
        """:meth:`forward_backward` then :meth:`apply_update`."""
        self.forward_backward(examples, global_loss_tokens)
        return self.apply_update(step, global_tokens, global_loss_tokens)

    @torch.no_grad()
    def evaluate(self, examples: Sequence[SFTExample]) -> float:
        """Masked mean NLL of `examples` (the whole validation split, on every rank)."""
        logprobs = self.eval_logprobs_fn([example.tokens for example in examples])
        tokens = sum(int(example.loss_mask.sum()) for example in examples)
        return float(masked_nll_sum(logprobs, examples)) / tokens

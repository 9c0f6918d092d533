"""The vLLM-forward model under FSDP2 (2 torchrun ranks, gloo) against the same model unsharded.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/workers/fsdp2_aligned.py
--model DIR --vocab-size V --out FILE [--quantization Q] [--engine-tp T] [--plant BUG]``. Every rank builds the
vLLM-forward model from ``DIR`` twice (``--engine-tp 2``: computing a TP = 2 engine's shards): one copy sharded with
:func:`~megatron_vllm_align.megatron.fsdp2.fully_shard_aligned`, one left whole (what one rank
computes). The global batch is split over the data-parallel ranks (rank r takes sequences r, r + 2,
...). Per rank, written by rank 0 for both ranks (``FILE``):

* ``logprobs``: the sharded model's prompt logprobs of the rank's sequences and the whole model's;
* ``grads``: after one backward of the global mean negative logprob (each rank's share scaled by the
  world size, which FSDP2's mean reduce-scatter divides out), every parameter's gradient
  reassembled (``full_tensor``) and the whole model's gradient of the same loss;
* ``identity_findings``: :func:`~megatron_vllm_align.guards.check_optimizer_identity` of the sharded
  model and its AdamW after the backward (none expected: the shadows hold no parameter);
* ``refresh_error``: what ``refresh_deployed_weights`` of the sharded model says (it must refuse);
* ``after_step``: both models' logprobs after one AdamW step of the sharded model whose updated
  parameters were copied into the whole model (refreshed), and the sharded model's logprobs
  before the step (so a test can see the step changed them).

``--runs FILE``: many runs in one launch (``batch.py``). ``--plant``: ``no_redeploy`` (units do not
rebuild their deployed values after FSDP2's all-gather:
``{"error": ...}``), ``unscaled_loss`` (each rank's share not scaled by the world size).
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from batch import runs_from_argv
from megatron.core import parallel_state

from megatron_vllm_align.engine.tiny_models import random_token_sequences
from megatron_vllm_align.guards import check_optimizer_identity
from megatron_vllm_align.megatron import fsdp2
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import enable_cpu_compat, seed_cpu_rng
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.ops.refresh import refresh_deployed_weights

SEQUENCE_LENGTHS = (5, 17, 30, 9)


def _loss(model: torch.nn.Module, sequences: list, total_tokens: int, scale: float) -> tuple[torch.Tensor, list]:
    logprobs = token_logprobs(model, sequences)
    return -torch.cat(logprobs).sum() * scale / total_tokens, [lp.detach() for lp in logprobs]


def run(model_dir: str, vocab_size: int, quantization: str | None, engine_tp: int | None, bug: str) -> dict:
    with mock.patch.object(fsdp2, "_redeploy_hook", lambda model, modules: (lambda unit, args: None)) \
            if bug == "no_redeploy" else contextlib.nullcontext():
        return _run(model_dir, vocab_size, quantization, engine_tp, bug)


def _run(model_dir: str, vocab_size: int, quantization: str | None, engine_tp: int | None, bug: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    sequences = random_token_sequences(SEQUENCE_LENGTHS, vocab_size=vocab_size, seed=3)
    total_tokens = sum(len(s) - 1 for s in sequences)
    shares = [sequences[r::world] for r in range(world)]
    whole, sharded = (build_gpt_from_hf(model_dir, align=True, quantization=quantization,
                                        engine_tensor_parallel_size=engine_tp) for _ in range(2))
    fsdp2.fully_shard_aligned(sharded)
    scale = 1.0 if bug == "unscaled_loss" else float(world)
    try:
        loss, logprobs = _loss(sharded, shares[rank], total_tokens, scale)
    except RuntimeError as error:  # the planted bug's failure, reported to the test
        return {"error": f"{type(error).__name__}: {error}"}
    loss.backward()
    # One rank's computation of the same global loss: each share forward as the sharded ranks ran it.
    whole_logprobs = []
    for share in shares:
        whole_loss, share_logprobs = _loss(whole, share, total_tokens, 1.0)
        whole_loss.backward()
        whole_logprobs.append(share_logprobs)
    grads = {name: (param.grad.full_tensor(), dict(whole.named_parameters())[name].grad)
             for name, param in sharded.named_parameters()}
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    identity = [str(finding) for finding in check_optimizer_identity(sharded, optimizer)]
    optimizer.step()
    try:
        refresh_deployed_weights(sharded)
        refresh_error = None
    except ValueError as error:
        refresh_error = str(error)
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            dict(whole.named_parameters())[name].copy_(param.full_tensor())
    refresh_deployed_weights(whole)
    after = [lp.detach() for lp in token_logprobs(sharded, shares[rank])]
    after_whole = [lp.detach() for lp in token_logprobs(whole, shares[rank])]
    return {"logprobs": (logprobs, whole_logprobs[rank]), "grads": grads, "identity_findings": identity,
            "refresh_error": refresh_error,
            "after_step": (after, after_whole, logprobs)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--engine-tp", type=int, default=None)
    parser.add_argument("--plant", default="none", choices=("none", "no_redeploy", "unscaled_loss"))
    enable_cpu_compat()
    dist.init_process_group("gloo")
    for args in runs_from_argv(parser):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        seed_cpu_rng(1234)
        result = run(args.model, args.vocab_size, args.quantization, args.engine_tp, args.plant)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            torch.save(gathered, args.out)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One aligned training step's gradients at tensor parallel size 2 (torchrun, gloo), reassembled.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/workers/tensor_parallel_grads.py
--model DIR --out FILE [--plant BUG]``: every rank builds the vLLM-forward model from ``DIR`` at TP = 2,
runs the loss ``-mean(prompt logprobs)`` of fixed sequences forward and backward, and rank 0 writes
the full (TP = 1 layout) gradient of every parameter, the loss and the logprobs to ``FILE``
(``full_tensor``). ``--plant`` plants one tensor-parallel bug:

* ``no_input_grad_reduce``: a column-parallel linear's input gradient is not all-reduced (each
  rank keeps its partial dX);
* ``ungated_fc1_shards``: ``linear_fc1`` is loaded as contiguous row blocks (rank 0 gets gate rows
  only) instead of ``[gate shard; up shard]``;
* ``local_fp8_amax`` (with ``--quantization fp8_per_channel``): each row-parallel FP8 shard is quantized
  from its own amax, not the amax reduced over TP.

``--refusals`` writes instead the error message of each refused layout (sequence parallel, a query
group count not divisible by TP, a vocabulary whose shards are not the engine's); ``--without-patch
NAME`` runs the step without that CPU patch and writes the error it raises (``{"error": ...}``).
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_vllm_align.engine.tiny_models import random_token_sequences
from megatron_vllm_align.megatron import vllm_tensor_parallel
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import disable_cpu_compat, enable_cpu_compat, seed_cpu_rng
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_tensor_parallel import full_tensor, is_gated_fc1

SEQUENCE_LENGTHS = (5, 17, 30)


def step(model_dir: str, vocab_size: int, quantization: str | None = None) -> dict:
    """Loss, logprobs and per-parameter gradients (reassembled) of one step."""
    model = build_gpt_from_hf(model_dir, align=True, quantization=quantization)
    sequences = random_token_sequences(SEQUENCE_LENGTHS, vocab_size=vocab_size, seed=3)
    logprobs = token_logprobs(model, sequences)
    loss = -torch.cat(logprobs).mean()
    loss.backward()
    grads = {name: full_tensor(param.grad, param, is_gated_fc1(model, name))
             for name, param in model.named_parameters()}
    return {"loss": loss.detach(), "logprobs": [lp.detach() for lp in logprobs], "grads": grads}


def plant(bug: str) -> None:
    if bug == "no_input_grad_reduce":
        vllm_tensor_parallel.TensorParallelShard.enter = lambda self, x: x
    elif bug == "ungated_fc1_shards":
        vllm_tensor_parallel.is_gated_fc1 = lambda model, name: False
        from megatron_vllm_align.megatron import build

        build.is_gated_fc1 = vllm_tensor_parallel.is_gated_fc1
    elif bug == "local_fp8_amax":
        vllm_tensor_parallel.TensorParallelShard.weight_amax_over_shards = \
            lambda self, quantized: contextlib.nullcontext()
    elif bug != "none":
        raise ValueError(f"unknown planted bug {bug!r}")


def refusals(model_dir: str) -> dict[str, str]:
    """The ValueError message of each layout the vLLM-forward model refuses at TP = 2."""
    from megatron_vllm_align.megatron.hf_checkpoint import read_hf_config

    found = {}
    hf = read_hf_config(model_dir)
    cases = {"sequence_parallel": {"sequence_parallel": True},
             "query_groups": {"num_query_groups": 1}}
    for name, overrides in cases.items():
        try:
            build_gpt_from_hf(model_dir, align=True, **overrides)
            found[name] = "built"
        except ValueError as error:
            found[name] = str(error)
    try:
        vllm_tensor_parallel.vocab_shard(hf.vocab_size + 64, 2)
        found["vocab"] = "accepted"
    except ValueError as error:
        found["vocab"] = str(error)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--plant", default="none")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--without-patch", default=None)
    args = parser.parse_args()
    enable_cpu_compat()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    seed_cpu_rng(1234)
    if args.refusals:
        result = refusals(args.model)
    elif args.without_patch:
        disable_cpu_compat([args.without_patch])
        try:
            step(args.model, args.vocab_size)
            result = {"error": None}
        except Exception as error:  # the failure this patch removes, reported to the test
            result = {"error": f"{type(error).__name__}: {error}"}
    else:
        plant(args.plant)
        result = step(args.model, args.vocab_size, args.quantization)
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

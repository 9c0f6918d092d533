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
  from its own amax, not the amax reduced over TP;
* ``no_head_norm_sum``: the q / k layernorm gradients are not summed over TP;
* ``no_routing_weight_reduce`` (MoE, with ``--expert-parallel``): the routing weights' gradient is not
  all-reduced over EP, so each rank's router gradient misses the other rank's experts.

``--expert-parallel`` sets up EP = TP = world size, expert TP 1 (the engine's ``enable_expert_parallel``
layout). For an MoE model ``FILE`` also holds the expert IDs each MoE layer chose (``routing``);
``--replay FILE2`` routes by those of an earlier run instead (router replay). The q / k layernorm
gradients are summed over TP first (``sum_head_norm_grads``, as the trainer does: each rank's norm sees
only its heads). ``--moe-refusals`` writes the error message of each refused MoE
layout (TP = 2 without expert parallelism; a shared expert at EP = 2, built from ``--shared-expert-model``).

``--dump`` also records the step's gradients with :class:`~megatron_vllm_align.guards.GradientDumper` (a
pre-hook on a zero-learning-rate SGD step) into ``FILE``'s folder and reads them back with
``load_gradient_dump`` (``dump``), and does so twice more with a planted dump bug:
``dump_rank0_offsets`` (every rank says its shard sits where rank 0's does; the loader's error, or None) and
``dump_fc1_one_block`` (a gated ``linear_fc1`` shard recorded as one block, not ``[gate shard; up shard]``;
the gradients read back).

``--runs FILE`` runs each line of ``FILE`` (a JSON list of the arguments above, its own ``--out``) in
turn in one launch (``batch.py``), each on a fresh model-parallel state with its planted bug removed
after it.

``--refusals`` writes instead the error message of each refused layout (sequence parallel, a query
group count not divisible by TP, a vocabulary whose shards are not the engine's); ``--without-patch
NAME`` runs the step without that CPU patch and writes the error it raises (``{"error": ...}``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from batch import runs_from_argv
from megatron.core import parallel_state

from megatron_vllm_align.engine.tiny_models import random_token_sequences
from megatron_vllm_align.guards import GradientDumper, GradientDumpError, load_gradient_dump
from megatron_vllm_align.megatron import vllm_tensor_parallel
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.cpu_compat import active_patches, cpu_patches, enable_cpu_compat, seed_cpu_rng
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.megatron.vllm_moe import (
    moe_layers,
    recorded_routing,
    router_replay,
)
from megatron_vllm_align.megatron.vllm_tensor_parallel import ShardLayout, full_tensor, is_gated_fc1

SEQUENCE_LENGTHS = (5, 17, 30)


def _run_without_weight_reduce(self, experts, tokens, topk_weights, topk_ids):
    """ExpertParallelism.run with the routing weights entering the local experts directly (planted bug)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    from megatron_vllm_align.ops.routed_experts.expert_map import local_routing

    tokens = copy_to_tensor_model_parallel_region(tokens, group=self.group)
    weights, local_ids = local_routing(topk_weights, topk_ids, self.expert_map)
    return reduce_from_tensor_model_parallel_region(experts(tokens, weights, local_ids), group=self.group)


def dumped_gradients(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The gradients as GradientDumper records them before an optimizer step, read back (all ranks)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with GradientDumper(optimizer, directory, model=model):
        optimizer.step()
    dist.barrier()
    return load_gradient_dump(directory, 0).grads


_LOCAL_BLOCKS = ShardLayout.local_blocks


def _blocks_at_rank0(self, local):
    return _LOCAL_BLOCKS(dataclasses.replace(self, rank=0), local)


def _fc1_as_one_block(self, local):
    return _LOCAL_BLOCKS(dataclasses.replace(self, blocks=1), local)


def dumps(model: torch.nn.Module, folder: Path) -> dict:
    """The dump read back, and what the two planted dump bugs give (module docstring)."""
    result = {"dump": dumped_gradients(model, folder / "right")}
    with mock.patch.object(ShardLayout, "local_blocks", _blocks_at_rank0):
        try:
            dumped_gradients(model, folder / "rank0_offsets")
            result["dump_rank0_offsets"] = None
        except GradientDumpError as error:
            result["dump_rank0_offsets"] = str(error)
    with mock.patch.object(ShardLayout, "local_blocks", _fc1_as_one_block):
        result["dump_fc1_one_block"] = dumped_gradients(model, folder / "fc1_one_block")
    return result


def step(model_dir: str, vocab_size: int, quantization: str | None = None,
         replay: list[torch.Tensor] | None = None, dump: Path | None = None) -> dict:
    """Loss, logprobs, per-parameter gradients (reassembled) and MoE routing of one step; with ``dump``, the
    gradient dumps written under that folder (:func:`dumps`)."""
    model = build_gpt_from_hf(model_dir, align=True, quantization=quantization)
    sequences = random_token_sequences(SEQUENCE_LENGTHS, vocab_size=vocab_size, seed=3)
    with router_replay(model, replay) if replay is not None else contextlib.nullcontext():
        logprobs = token_logprobs(model, sequences)
    loss = -torch.cat(logprobs).mean()
    loss.backward()
    vllm_tensor_parallel.sum_head_norm_grads(model)
    grads = {name: full_tensor(param.grad, param, is_gated_fc1(model, name))
             for name, param in model.named_parameters()}
    routing = [ids.clone() for ids in recorded_routing(model)] if moe_layers(model) else []
    return {"loss": loss.detach(), "logprobs": [lp.detach() for lp in logprobs], "grads": grads,
            "routing": routing, **(dumps(model, dump) if dump is not None else {})}


@contextlib.contextmanager
def planted(bug: str):
    """The tensor-parallel bug ``bug`` (module docstring) planted inside the block, removed after."""
    from megatron_vllm_align.megatron import build
    from megatron_vllm_align.megatron.vllm_moe import ExpertParallelism

    def ungated(model, name):
        return False

    patches = {
        "none": [],
        "no_input_grad_reduce": [(vllm_tensor_parallel.TensorParallelShard, "enter", lambda self, x: x)],
        "ungated_fc1_shards": [(vllm_tensor_parallel, "is_gated_fc1", ungated), (build, "is_gated_fc1", ungated)],
        "local_fp8_amax": [(vllm_tensor_parallel.TensorParallelShard, "weight_amax_over_shards",
                            lambda self, quantized: contextlib.nullcontext())],
        "no_head_norm_sum": [(vllm_tensor_parallel, "sum_head_norm_grads", lambda model: 0)],
        "no_routing_weight_reduce": [(ExpertParallelism, "run", _run_without_weight_reduce)],
    }
    if bug not in patches:
        raise ValueError(f"unknown planted bug {bug!r}")
    with contextlib.ExitStack() as stack:
        for target, name, value in patches[bug]:
            stack.enter_context(mock.patch.object(target, name, value))
        yield


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


def moe_refusals(model_dir: str, shared_expert_model: str) -> dict[str, str]:
    """The ValueError message of each MoE layout the vLLM-forward model refuses (module docstring)."""
    world = dist.get_world_size()
    found = {}
    for name, model, sizes in (("tp_without_ep", model_dir, {}),
                               ("shared_expert", shared_expert_model,
                                {"expert_model_parallel_size": world, "expert_tensor_parallel_size": 1})):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, **sizes)
        try:
            build_gpt_from_hf(model, align=True)
            found[name] = "built"
        except ValueError as error:
            found[name] = str(error)
    return found


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--plant", default="none")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--without-patch", default=None)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--moe-refusals", action="store_true")
    parser.add_argument("--shared-expert-model", default=None)
    parser.add_argument("--replay", type=Path, default=None)
    parser.add_argument("--dump", action="store_true")
    return parser


def run(args: argparse.Namespace) -> dict:
    """One run's result (module docstring), on a freshly initialized model-parallel state."""
    world = dist.get_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world,
        **({"expert_model_parallel_size": world, "expert_tensor_parallel_size": 1} if args.expert_parallel else {}))
    seed_cpu_rng(1234)
    if args.moe_refusals:
        return moe_refusals(args.model, args.shared_expert_model)
    if args.refusals:
        return refusals(args.model)
    if args.without_patch:
        with cpu_patches([patch.name for patch in active_patches() if patch.name != args.without_patch]):
            try:
                step(args.model, args.vocab_size)
                return {"error": None}
            except Exception as error:  # the failure this patch removes, reported to the test
                return {"error": f"{type(error).__name__}: {error}"}
    with planted(args.plant):
        replay = None if args.replay is None else torch.load(args.replay)["routing"]
        return step(args.model, args.vocab_size, args.quantization, replay,
                    args.out.parent / f"{args.out.stem}_dumps" if args.dump else None)


def main() -> None:
    runs = runs_from_argv(parser())
    enable_cpu_compat()
    dist.init_process_group("gloo")
    for args in runs:
        result = run(args)
        if dist.get_rank() == 0:
            torch.save(result, args.out)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

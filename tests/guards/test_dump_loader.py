"""Reassembly of multi-rank dumps and the errors for incomplete or corrupt ones.

The ranks' files are written with the dumper's own writer (``write_rank_dump``) under explicit
rank numbers, placing pieces the way FSDP2 (uneven ``Shard(dim)`` blocks), DDP (full replicas)
and Megatron's distributed optimizer (flat ranges) hold them.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vllm_align.guards import GradientDumpError, GradientScaling, load_gradient_dump
from megatron_vllm_align.guards.dump_format import ParamRecord, index_path, tensor_path, write_rank_dump

SCALING = GradientScaling(dp_size=2, dense_grad_factor=1.0, reduce_op="avg", loss_scale=1.0).to_dict()
FULL = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5) / 3.0


def _record(name: str, piece: torch.Tensor, placement: dict, global_shape=(7, 5)) -> ParamRecord:
    return ParamRecord(name=name, module_class="Linear", key=name, optimizer_slot=[0, 0, 0], tensor_id=0,
                       global_shape=list(global_shape), local_shape=list(piece.shape), dtype=str(piece.dtype),
                       placement=placement)


def _write(directory, rank: int, pieces: dict[str, tuple[torch.Tensor, dict]], world: int = 2, step: int = 0):
    records = [_record(name, piece, placement) for name, (piece, placement) in pieces.items()]
    write_rank_dump(directory, step, rank, world, {n: p.clone() for n, (p, _) in pieces.items()}, records, SCALING)


def _two_rank_dump(directory) -> None:
    rows, cols = torch.chunk(FULL, 2, dim=0), torch.chunk(FULL, 2, dim=1)  # 4+3 rows, 3+2 columns
    flat = FULL.flatten()
    for rank in range(2):
        _write(directory, rank, {
            "rows": (rows[rank], {"kind": "block", "offsets": [4 * rank, 0]}),
            "cols": (cols[rank], {"kind": "block", "offsets": [0, 3 * rank]}),
            "flat": (flat[20 * rank:20 + 15 * rank], {"kind": "flat_range", "start": 20 * rank, "end": 20 + 15 * rank}),
            "replica": (FULL, {"kind": "full"}),
        })


def test_reassembles_blocks_flat_ranges_and_replicas(tmp_path):
    _two_rank_dump(tmp_path)
    dump = load_gradient_dump(tmp_path, 0)
    assert dump.world_size == 2 and sorted(dump.grads) == ["cols", "flat", "replica", "rows"]
    for name, grad in dump.grads.items():
        assert torch.equal(grad, FULL), name
    assert dump.scaling == GradientScaling.from_dict(SCALING) and len(dump.scaling_by_rank) == 2


def test_missing_rank_is_named(tmp_path):
    _two_rank_dump(tmp_path)
    index_path(tmp_path, 0, 1).unlink()
    with pytest.raises(GradientDumpError, match=r"incomplete: world size 2, missing ranks \[1\]"):
        load_gradient_dump(tmp_path, 0)


def test_absent_step_lists_the_steps_present(tmp_path):
    _two_rank_dump(tmp_path)
    with pytest.raises(GradientDumpError, match=r"no gradient dump of step 5 .*steps present: \[0\]"):
        load_gradient_dump(tmp_path, 5)


def test_corrupt_index_is_reported_with_its_path(tmp_path):
    _two_rank_dump(tmp_path)
    index_path(tmp_path, 0, 1).write_text('{"format": "megatron_vllm_align.gradient_dump/1", "step": 0,')
    with pytest.raises(GradientDumpError, match=r"rank_00001\.json is unreadable or corrupt"):
        load_gradient_dump(tmp_path, 0)


def test_index_with_a_missing_or_malformed_field_is_reported(tmp_path):
    _two_rank_dump(tmp_path)
    path = index_path(tmp_path, 0, 0)
    data = json.loads(path.read_text())
    del data["world_size"]
    path.write_text(json.dumps(data))
    with pytest.raises(GradientDumpError, match=r"rank_00000\.json: field 'world_size' missing"):
        load_gradient_dump(tmp_path, 0)
    data["world_size"] = 2
    data["params"][0]["global_shape"] = "7x5"
    path.write_text(json.dumps(data))
    with pytest.raises(GradientDumpError, match=r"parameter 'rows' field 'global_shape' must be a list"):
        load_gradient_dump(tmp_path, 0)


def test_truncated_tensor_file_is_reported(tmp_path):
    _two_rank_dump(tmp_path)
    path = tensor_path(tmp_path, 0, 1)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(GradientDumpError, match=r"rank_00001\.safetensors: expected \d+ bytes .* found \d+ bytes"):
        load_gradient_dump(tmp_path, 0)


def test_replicas_that_disagree_are_refused(tmp_path):
    for rank in range(2):
        _write(tmp_path, rank, {"replica": (FULL + rank, {"kind": "full"})})  # e.g. dumped before the all-reduce
    with pytest.raises(GradientDumpError, match="'replica': rank 1's piece differs from another rank's copy"):
        load_gradient_dump(tmp_path, 0)


def test_pieces_that_leave_a_gap_or_do_not_fit_are_refused(tmp_path):
    rows = torch.chunk(FULL, 2, dim=0)
    for rank in range(2):
        _write(tmp_path, rank, {"rows": (rows[0], {"kind": "block", "offsets": [0, 0]})})
    with pytest.raises(GradientDumpError, match=r"'rows': 15 of 35 elements are in no rank's piece"):
        load_gradient_dump(tmp_path, 0)
    for rank in range(2):
        _write(tmp_path, rank, {"rows": (rows[0], {"kind": "block", "offsets": [5, 0]})}, step=1)
    with pytest.raises(GradientDumpError, match="does not fit"):
        load_gradient_dump(tmp_path, 1)

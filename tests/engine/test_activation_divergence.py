"""First divergent op between the real engine and the aligned trainer: none on the same weights; a
planted change to one op's weight is named at exactly that op, never earlier; an unknown tap point
is refused by name."""
from __future__ import annotations

import pytest
import torch

from megatron_vllm_align.megatron.activation_divergence import (
    TapPoint,
    first_divergence,
    model_tap_points,
    tap_points,
    trainer_activations,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.ops.refresh import refresh_deployed_weights

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("megatron_cpu")]


@pytest.fixture
def aligned(engine_checkpoint):
    return build_gpt_from_hf(engine_checkpoint, align=True)


def test_tap_points_follow_the_forward_order():
    names = [p.name for p in tap_points(2, moe_layers=[1])]
    assert names[:5] == ["embedding", "layer 0 attention (input_layernorm)", "layer 0 attention (qkv_proj)",
                         "layer 0 attention (attn)", "layer 0 attention (o_proj)"]
    assert names[5:9] == ["layer 0 mlp (post_attention_layernorm)", "layer 0 mlp (gate_up_proj)",
                          "layer 0 mlp (act_fn)", "layer 0 mlp (down_proj)"]
    assert names[-3:] == ["layer 1 mlp (post_attention_layernorm)", "layer 1 mlp", "final norm"]
    assert TapPoint("layer 1 mlp (act_fn)", "", "").block == "layer 1 mlp"


def test_same_weights_no_divergence(engine, aligned, engine_sequences):
    for sequence in engine_sequences[:3]:
        if len(sequence) > 1:
            assert first_divergence(engine, aligned, sequence) is None


@pytest.mark.parametrize("parameter, expected", [
    ("decoder.layers.1.mlp.linear_fc2.weight", "layer 1 mlp (down_proj)"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", "layer 0 attention (qkv_proj)"),
    ("decoder.layers.1.pre_mlp_layernorm.weight", "layer 1 mlp (post_attention_layernorm)"),
    ("decoder.final_layernorm.weight", "final norm"),
])
def test_planted_weight_change_is_named_at_its_op(engine, aligned, engine_sequences, parameter, expected):
    with torch.no_grad():
        weight = aligned.get_parameter(parameter)
        weight.add_(torch.full_like(weight, 2.0 ** -4))
    refresh_deployed_weights(aligned)
    sequence = max(engine_sequences, key=len)
    found = first_divergence(engine, aligned, sequence)
    assert found is not None and found.point.name == expected, found
    assert 0 < found.differing <= found.elements and found.max_abs_diff > 0
    assert str(found).startswith(f"{expected}: ")


def test_unknown_tap_point_is_refused_by_name(aligned):
    with pytest.raises(KeyError, match="tap point 'nowhere'.*'decoder.layers.9.mlp'"):
        trainer_activations(aligned, [1, 2, 3], [TapPoint("nowhere", "model.layers.9.mlp", "decoder.layers.9.mlp")])
    assert len(model_tap_points(aligned)) == 1 + 2 * 8 + 1

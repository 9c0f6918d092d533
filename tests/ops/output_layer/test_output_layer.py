"""The output layer op: its forward makes the engine's lm_head calls (row sets) and nothing else, and
planted backward bugs fail layer 1 against the float64 reference (the correct function passes in
tests/ops/test_layer1_registry.py; the Megatron drop-in is tested in tests/megatron)."""
import pytest
import torch

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.ops.output_layer import vjp as output_vjp_module
from megatron_vllm_align.ops.output_layer.case import ITEMS, output_layer_builder
from megatron_vllm_align.ops.output_layer.kernel import engine_logit_calls
from megatron_vllm_align.ops.output_layer.module import OutputLogitsFunction
from megatron_vllm_align.ops.registry import Layer1Case

HIDDEN, VOCAB = 256, 500


@pytest.mark.parametrize("seq_lens", [(1,), (5,), (1, 7, 29), (3, 1, 4)])
def test_row_sets_cover_every_position_once_last_positions_together(seq_lens):
    calls = engine_logit_calls(seq_lens)
    rows = torch.cat(calls).sort().values
    assert torch.equal(rows, torch.arange(sum(seq_lens)))
    ends = torch.tensor(seq_lens).cumsum(0) - 1
    assert torch.equal(calls[-1], ends), "the sampler's call holds every sequence's last position"


def test_forward_is_the_kernel_on_each_row_set(bf16_context):
    candidate, _, (hidden,) = output_layer_builder(bf16_context, HIDDEN, VOCAB)(0, 37)
    logits = candidate(hidden)
    for rows in engine_logit_calls(candidate.seq_lens):
        assert torch.equal(logits[rows], candidate.kernel(hidden.detach()[rows]))
    assert logits.shape == (37, VOCAB) and logits.dtype == torch.bfloat16


def _case(context, logit_scale=1.0):
    return Layer1Case("output_layer", get_default_contract("output_layer"), ITEMS,
                      output_layer_builder(context, HIDDEN, VOCAB, logit_scale), OutputLogitsFunction)


def test_planted_backward_without_logit_scale_is_caught(bf16_context, failing_checks, monkeypatch):
    assert not failing_checks(_case(bf16_context, 0.5))
    real = output_vjp_module.linear_vjp
    monkeypatch.setattr(output_vjp_module, "linear_vjp", lambda grad, *args: real(grad / 0.5, *args))
    assert {item for item, _ in failing_checks(_case(bf16_context, 0.5))} == {"input[0]", "weight"}


def test_planted_backward_that_drops_the_sampler_rows_is_caught(bf16_context, failing_checks, monkeypatch):
    real = output_vjp_module.linear_vjp

    def drop_last_positions(grad, x_ref, *args):
        grad = grad.clone()
        grad[engine_logit_calls((1, 7, 29))[-1]] = 0
        return real(grad, x_ref, *args)
    monkeypatch.setattr(output_vjp_module, "linear_vjp", drop_last_positions)
    failing = failing_checks(_case(bf16_context))
    assert ("input[0]", "tolerance") in failing and ("weight", "tolerance") in failing

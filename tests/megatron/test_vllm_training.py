"""A CPU training step of the vLLM-forward model: gradients against Megatron's local spec, the loss
over 20 AdamW steps, and the deployed values after every step. No engine is started.

Gradient tolerance, derived before any comparison was run (bf16 noise model):
both models compute the same math from the same bf16 weights on the same batch; they differ only
in where they round to bf16 and in summation order (vLLM keeps the residual sum in fp32 before the
norm, casts after the norm's weight multiply, rotates with a bf16 cos/sin cache; Megatron's bda
rounds the sum, its backward rounds each intermediate gradient to bf16). One bf16 rounding
is a relative error uniform in [-u, u] (u = 2^-8), RMS u/sqrt(3); independent roundings add in
quadrature. Count K = the bf16 roundings on the longest forward + backward path that feeds one
parameter's gradient: about 11 per layer forward (norm, qkv, rope, attention, o_proj, residual,
norm, fc1, act, fc2, residual) and as many backward, for 2 layers, plus 6 around the embedding,
output layer and loss: K ~ 50. Each model's gradient then carries relative RMS noise
u sqrt(K/3) and their difference u sqrt(2K/3) = 2.3e-2. With 4x headroom (4 sigma, as
validation.tolerances uses):

    rel_l2 <= 0.09,  norm ratio in [1 - 0.09, 1 + 0.09],  cosine >= 1 - 0.09^2 / 2 = 0.996.

A planted bug (one gradient scaled by 1.25, or two layers' gradients swapped) must fail it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.ops.refresh import deployed_values_match_master, register_deployed_refresh
from megatron_vllm_align.validation import GradMetrics, grad_metrics

REL_L2_BOUND = 0.09  # derived in the module docstring, before running
COSINE_BOUND = 1 - REL_L2_BOUND**2 / 2
BATCH = [[5, 9, 200, 31, 7, 7, 100, 3, 1, 64, 65, 66, 300, 2, 2, 500, 11], list(range(40, 57)),
         [12, 400, 401, 3, 3, 3, 90, 18, 250, 251, 7, 1, 0, 6]]
STEPS = 20


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    """Mean negative logprob of every token of BATCH after the first."""
    return -torch.cat(token_logprobs(model, BATCH)).mean()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def within_bounds(metrics: GradMetrics) -> bool:
    return (metrics.rel_l2 <= REL_L2_BOUND and metrics.cosine is not None and metrics.cosine >= COSINE_BOUND
            and abs(metrics.norm_ratio - 1) <= REL_L2_BOUND)


@pytest.fixture(scope="module")
def gradient_pair(megatron_cpu, llama_dir, engine_context):
    aligned = gradients(build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context))
    local = gradients(build_gpt_from_hf(llama_dir))
    return aligned, local


def test_every_gradient_agrees_with_the_local_spec(gradient_pair):
    aligned, local = gradient_pair
    assert list(aligned) == list(local)
    worst = {}
    for name, grad in aligned.items():
        metrics = grad_metrics(grad, local[name])
        print(f"{name:55s} rel_l2 {metrics.rel_l2:.2e} cos {metrics.cosine:.6f} norm ratio {metrics.norm_ratio:.4f}")
        worst[name] = metrics
        assert within_bounds(metrics), f"{name}: {metrics} outside rel_l2 <= {REL_L2_BOUND}, cos >= {COSINE_BOUND:.4f}"
    print(f"worst rel_l2 {max(m.rel_l2 for m in worst.values()):.3e} (bound {REL_L2_BOUND})")


def test_planted_gradient_bugs_fail_the_bounds(gradient_pair):
    aligned, local = gradient_pair
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not within_bounds(grad_metrics(aligned[name] * 1.25, local[name]))
    swapped = "decoder.layers.1.mlp.linear_fc1.weight"
    assert not within_bounds(grad_metrics(aligned[swapped], local[name]))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not within_bounds(grad_metrics(aligned[qkv].flip(0), local[qkv]))  # rows in the wrong layout


def assert_deployed_equals_fresh(model: torch.nn.Module, step: int) -> int:
    """Every deployed value is vLLM's processing of its current master (probed bitwise, whatever GEMM
    path vLLM chose); returns how many were checked."""
    matches = deployed_values_match_master(model)
    stale = [name for name, same in matches.items() if not same]
    assert not stale, f"step {step}: deployed values of {stale} != vLLM's processing of the master"
    return len(matches)


@dataclasses.dataclass
class TrainingRun:
    losses: list[float]
    changed: bool


@pytest.fixture(scope="module")
def training_run(megatron_cpu, llama_dir, engine_context) -> TrainingRun:
    model = build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context)
    model.train()
    start = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    register_deployed_refresh(optimizer, model)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        assert assert_deployed_equals_fresh(model, step) == 2 * 4 + 1
    with torch.no_grad():
        losses.append(float(loss_of(model)))
    changed = all(not torch.equal(param, start[name]) for name, param in model.named_parameters())
    return TrainingRun(losses, changed)


def test_loss_goes_down_over_20_adamw_steps(training_run):
    losses = training_run.losses
    print("losses:", " ".join(f"{value:.3f}" for value in losses))
    assert training_run.changed, "some parameter was not updated"
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}: no clear decrease"
    early = losses[:11]
    assert all(b < a for a, b in zip(early, early[1:])), "the first 10 steps do not all lower the loss"


def test_a_stale_shadow_is_detected_by_the_comparison(megatron_cpu, llama_dir, engine_context):
    """Planted bug: an optimizer step without the refresh hook leaves the deployed values stale."""
    model = build_gpt_from_hf(llama_dir, align=True, engine_context=engine_context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_of(model).backward()
    optimizer.step()
    with pytest.raises(AssertionError, match="deployed values of .* != vLLM's processing"):
        assert_deployed_equals_fresh(model, 0)
    assert not any(deployed_values_match_master(model).values())  # every layer moved, every one is caught

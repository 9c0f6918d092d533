"""FSDP2 on the vLLM-forward model (``fully_shard_aligned``): 2 torchrun ranks (gloo, data parallel) against
the same model whole, as one rank computes it.

Per rank: prompt logprobs of the rank's share of the batch bit for bit the whole model's; every
gradient, reassembled from the shards, bit for bit the whole model's gradient of the same global
loss; after an AdamW step the deployed values follow the new shards (the forward equals the whole
model loaded with the updated parameters, and differs from the forward before the step); the
optimizer-identity guard finds every sharded parameter in AdamW and nothing else; a refresh from the
shards (``refresh_deployed_weights``) is refused. Why the
gradients are bitwise at 2 ranks: each rank's share of the loss is scaled by 2 (a power of two, exact)
and FSDP2's mean reduce-scatter rounds ``(2 g0 + 2 g1) / 2`` once, as the whole model's ``.grad``
accumulation rounds ``g0 + g1`` once. Models: Qwen3, Llama with tied embeddings served in FP8 per
channel, Qwen3-MoE, Qwen3 at Qwen3-0.6B widths (2 layers), and Qwen3 computing a TP = 2 engine's shards
(``engine_tensor_parallel_size=2``: the whole model is the trainer that tests/distributed/test_tensor_parallel.py
finds bitwise equal to a real TP = 2 engine). Planted bugs: units that do not rebuild their deployed values after
FSDP2's all-gather, and a loss share not scaled by the world size.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_vllm_align.engine.tiny_models import QWEN3_0_6B_WIDTHS, TinyModelConfig, build_tiny_hf_model

WORKER = Path(__file__).parent / "workers" / "fsdp2_aligned.py"
MODELS = {  # name: (model, quantization)
    "qwen3": (TinyModelConfig(architecture="qwen3", seed=5), None),
    "llama_tied_fp8_per_channel": (TinyModelConfig(seed=6, tie_word_embeddings=True), "fp8_per_channel"),
    "qwen3_moe": (TinyModelConfig(architecture="qwen3_moe", seed=11), None),
    "qwen3_0.6b_widths": (TinyModelConfig(seed=9, **QWEN3_0_6B_WIDTHS), None),
}

pytestmark = pytest.mark.distributed


def _max_delta(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    assert [t.shape for t in ours] == [t.shape for t in reference]
    return max((a - b).abs().max().item() for a, b in zip(ours, reference))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp2_models")
    return {name: build_tiny_hf_model(root / name, config) for name, (config, _) in MODELS.items()}


@pytest.fixture(scope="module")
def fsdp2_runs(checkpoints, tmp_path_factory, torchrun_runs) -> dict[str, list[dict]]:
    """Per run, both ranks' results (the worker's docstring): every model, then the two planted bugs on
    Qwen3, in one launch."""
    def args(name: str, *extra: str) -> tuple:
        config, quantization = MODELS[name]
        return ("--model", checkpoints[name], "--vocab-size", config.vocab_size,
                *([] if quantization is None else ["--quantization", quantization]), *extra)

    return torchrun_runs(WORKER, 2, tmp_path_factory.mktemp("fsdp2"), {
        **{name: args(name) for name in MODELS},
        "qwen3_engine_tp2": args("qwen3", "--engine-tp", "2"),
        "unscaled_loss": args("qwen3", "--plant", "unscaled_loss"),
        "no_redeploy": args("qwen3", "--plant", "no_redeploy")})


@pytest.mark.parametrize("name", [*MODELS, "qwen3_engine_tp2"])
def test_fsdp2_forward_and_gradients_equal_one_rank(name, fsdp2_runs):
    for rank, result in enumerate(fsdp2_runs[name]):
        sharded, whole = result["logprobs"]
        assert _max_delta(sharded, whole) == 0.0, f"rank {rank}: the sharded forward is not the whole model's"
        differing = [param for param, (grad, reference) in result["grads"].items()
                     if not torch.equal(grad, reference)]
        assert not differing, f"rank {rank}: gradients differ from one rank's for {differing}"
        assert len(result["grads"]) >= 10
        assert result["identity_findings"] == []
        assert "FSDP2 shards" in result["refresh_error"]
        after, after_whole, before = result["after_step"]
        assert _max_delta(after, after_whole) == 0.0, f"rank {rank}: deployed values did not follow the step"
        assert _max_delta(after, before) > 1e-3, "the optimizer step did not change the forward"


def test_a_unit_without_redeploy_is_refused(fsdp2_runs):
    for result in fsdp2_runs["no_redeploy"]:
        assert "changed since the deployed value was built" in result["error"]


def test_an_unscaled_loss_share_is_caught(fsdp2_runs):
    for result in fsdp2_runs["unscaled_loss"]:
        for param, (grad, reference) in result["grads"].items():
            rel = ((grad.double() - reference.double()).norm() / reference.double().norm()).item()
            assert rel == pytest.approx(0.5, abs=1e-2), f"{param}: a halved gradient must show (rel L2 {rel})"


def test_only_aligned_models_are_sharded(checkpoints):
    from megatron_vllm_align.megatron.build import build_gpt_from_hf
    from megatron_vllm_align.megatron.cpu_compat import init_single_process_cpu
    from megatron_vllm_align.megatron.fsdp2 import fully_shard_aligned

    init_single_process_cpu()
    with pytest.raises(ValueError, match="needs a vLLM-forward GPTModel"):
        fully_shard_aligned(build_gpt_from_hf(checkpoints["qwen3"], align=False))

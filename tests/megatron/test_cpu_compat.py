"""Each CPU patch is needed (its documented failure happens without it), and all of them together
let a tiny GPTModel train on CPU. The layer is inert when CUDA is available."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from megatron.core import package_info, parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import GlobalMemoryBuffer

from megatron_vllm_align.megatron.cpu_compat import (
    PATCHES,
    CpuRNGStatesTracker,
    UnsupportedMegatronVersion,
    active_patches,
    check_megatron_version,
    cpu_compat_required,
    cpu_patches,
    enable_cpu_compat,
    init_single_process_cpu,
    seed_cpu_rng,
)

VOCAB = 96


def tiny_gpt(attention_dropout: float = 0.0, recompute: bool = False) -> GPTModel:
    """A 2-layer bf16 GPTModel (local spec, GQA, RMSNorm, SwiGLU); fresh, so no cached RoPE.
    ``recompute``: full activation recompute of one layer at a time (Megatron's checkpoint path)."""
    recompute_kwargs = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                        if recompute else {})
    config = TransformerConfig(
        **recompute_kwargs,
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=attention_dropout,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
    return model.to(torch.bfloat16)


def train_step(model: GPTModel) -> torch.Tensor:
    """Forward with labels and backward on a fixed batch; returns the mean loss."""
    tokens = torch.arange(2 * 9).remainder(VOCAB).view(2, 9)
    positions = torch.arange(9).expand(2, 9)
    loss = model(tokens, positions, None, labels=tokens.roll(-1, dims=1)).float().mean()
    loss.backward()
    return loss


# The megatron-core function in which each patch's failure is raised (innermost megatron frame).
FAILING_FUNCTION = {
    "global_memory_buffer": "get_tensor",
    "rotary_embedding": "get_emb",
    "causal_mask": "get_default_causal_mask",
    "rng_tracker": "fork",
    "checkpoint_rng_states": "_get_cuda_rng_state",
}


@pytest.fixture(autouse=True)
def default_patches_only():
    """Exactly PATCHES inside each test, whatever earlier tests left installed (MoE builds install
    MOE_PATCHES process-wide); the previous set is restored after."""
    with cpu_patches():
        yield


def innermost_megatron_function(error: BaseException) -> str:
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "/megatron/core/" in frame.filename]
    return frames[-1].name


# Patches whose failure needs more than one process; their failure test is named here.
MULTI_PROCESS_FAILURE_TESTS = {
    "tp_gather_last_dim": "tests/distributed/test_tensor_parallel.py::test_the_gather_patch_is_needed",
}


def test_every_patch_has_a_failure_test():
    assert set(FAILING_FUNCTION) | set(MULTI_PROCESS_FAILURE_TESTS) == {patch.name for patch in PATCHES}


@pytest.mark.parametrize("missing", sorted(FAILING_FUNCTION))
def test_each_patch_is_needed(megatron_cpu, missing):
    others = [patch.name for patch in PATCHES if patch.name != missing]
    parallel_state.get_global_memory_buffer().buffer.clear()  # as in a fresh process: nothing allocated yet
    with cpu_patches(others) as active:
        assert missing not in {patch.name for patch in active}
        with pytest.raises(Exception) as raised:
            train_step(tiny_gpt(recompute=missing == "checkpoint_rng_states"))
    print(f"without {missing}: {raised.type.__name__}: {raised.value}")
    assert innermost_megatron_function(raised.value) == FAILING_FUNCTION[missing]
    if missing == "rng_tracker":  # megatron's tracker was never seeded: seeding needs CUDA
        assert "is not added" in str(raised.value)
    else:
        assert "Torch not compiled with CUDA enabled" in str(raised.value)


def test_megatron_seeding_needs_the_rng_patch(megatron_cpu):
    others = [patch.name for patch in PATCHES if patch.name != "rng_tracker"]
    with cpu_patches(others):
        with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
            seed_cpu_rng(5)


def test_forward_backward_on_cpu_with_all_patches(megatron_cpu):
    assert {patch.name for patch in active_patches()} == set(FAILING_FUNCTION) | set(MULTI_PROCESS_FAILURE_TESTS)
    model = tiny_gpt(attention_dropout=0.1, recompute=True)  # dropout runs inside the tracker's fork
    loss = train_step(model)
    assert torch.isfinite(loss)
    assert 0.5 * torch.log(torch.tensor(float(VOCAB))) < loss < 2 * torch.log(torch.tensor(float(VOCAB)))
    grads = {name: param.grad for name, param in model.named_parameters()}
    assert all(grad is not None for grad in grads.values()), [name for name, g in grads.items() if g is None]
    assert all(torch.isfinite(grad).all() for grad in grads.values())
    assert all(grad.abs().sum() > 0 for grad in grads.values())


def test_dropout_fork_is_seeded_and_leaves_the_outer_stream_alone(megatron_cpu):
    tracker = megatron_random.get_cuda_rng_tracker()
    assert isinstance(tracker, CpuRNGStatesTracker)

    def dropout_mask_and_next_outer_draw() -> tuple[torch.Tensor, torch.Tensor]:
        with tracker.fork():
            mask = F.dropout(torch.ones(64), p=0.5)
        return mask, torch.rand(4)

    seed_cpu_rng(7)
    first = dropout_mask_and_next_outer_draw()
    seed_cpu_rng(7)
    second = dropout_mask_and_next_outer_draw()
    torch.manual_seed(7)
    outer_only = torch.rand(4)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.equal(first[1], outer_only)  # the fork did not consume the outer CPU stream
    assert 0 < int((first[0] == 0).sum()) < 64


def test_patches_are_inert_when_cuda_is_available(megatron_cpu, monkeypatch):
    with cpu_patches([]):
        original_get_tensor, original_get_emb = GlobalMemoryBuffer.get_tensor, RotaryEmbedding.get_emb
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert cpu_compat_required() is False
        assert enable_cpu_compat() == ()
        assert active_patches() == ()
        assert GlobalMemoryBuffer.get_tensor is original_get_tensor
        assert RotaryEmbedding.get_emb is original_get_emb
        monkeypatch.undo()
    assert cpu_compat_required() is True
    assert len(active_patches()) == len(PATCHES)


def test_patching_is_idempotent_and_reversible(megatron_cpu):
    patched = GlobalMemoryBuffer.get_tensor
    original = patched.__wrapped__
    assert enable_cpu_compat() == enable_cpu_compat() == PATCHES
    assert GlobalMemoryBuffer.get_tensor is patched
    with cpu_patches([]):
        assert GlobalMemoryBuffer.get_tensor is original
        assert megatron_random.get_cuda_rng_tracker() is not None
        assert not isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker)
    assert GlobalMemoryBuffer.get_tensor.__wrapped__ is original
    assert isinstance(megatron_random.get_cuda_rng_tracker(), CpuRNGStatesTracker)


def test_refuses_other_megatron_versions(megatron_cpu, monkeypatch):
    assert check_megatron_version("0.16.1") == "0.16.1"
    with pytest.raises(UnsupportedMegatronVersion, match="found megatron-core 0.17.0"):
        check_megatron_version("0.17.0")
    with cpu_patches([]):
        monkeypatch.setattr(package_info, "__version__", "0.15.2")
        with pytest.raises(UnsupportedMegatronVersion, match="0.15.2"):
            enable_cpu_compat()
        assert active_patches() == ()
        monkeypatch.undo()


def test_unknown_patch_name_is_an_error():
    with pytest.raises(ValueError, match="unknown patch names"):
        enable_cpu_compat(["rotary"])


def test_init_single_process_cpu_is_a_no_op_when_initialised(megatron_cpu):
    assert init_single_process_cpu() is False
    assert torch.distributed.get_world_size() == 1

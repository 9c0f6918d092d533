"""Bytes saved for backward (a deterministic memory figure): the counter counts what a forward creates
and saves, once per storage, and leaves out what existed before (parameters, deployed values); the
aligned model saves no more per decoder layer, nor in total, than Megatron's local spec on the same
batch, at tiny widths, at Qwen3-0.6B widths and for Qwen3-MoE."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_vllm_align.engine.tiny_models import (
    QWEN3_0_6B_WIDTHS,
    TinyModelConfig,
    build_tiny_hf_model,
    random_token_sequences,
)
from megatron_vllm_align.megatron.build import build_gpt_from_hf
from megatron_vllm_align.megatron.logprobs import token_logprobs
from megatron_vllm_align.validation.saved_activations import model_blocks, saved_activation_bytes

pytestmark = pytest.mark.usefixtures("megatron_cpu")

MODELS = {
    "tiny_llama": TinyModelConfig(seed=1),
    "qwen3_0.6b_widths": TinyModelConfig(seed=9, **QWEN3_0_6B_WIDTHS),
    "tiny_qwen3_moe": TinyModelConfig(architecture="qwen3_moe", seed=6),
}


class SavesAnFp32Copy(nn.Module):
    """A planted extra: saves an fp32 copy of its bf16 input for backward (``pow`` saves its input)."""

    def forward(self, x):
        return x.float().pow(2).to(x.dtype)


def test_counter_counts_created_storages_once_and_skips_existing_ones():
    x = torch.randn(10, 8, requires_grad=True)                        # exists before: not counted
    saved = saved_activation_bytes({}, lambda: (x.exp() * 2).sum())   # exp saves its fp32 output
    assert [(t.block, t.shape, t.nbytes) for t in saved.tensors] == [("other", (10, 8), 320)]

    def two_views():
        y = x * 1.0
        return (y[:5].sin() + y[5:].cos()).sum()                       # both views share y's storage
    assert saved_activation_bytes({}, two_views).total() == 320


def test_a_dead_weak_proxy_among_live_objects_is_skipped():
    """A weak proxy whose referent is gone raises ``ReferenceError`` when ``isinstance`` inspects it
    (the garbage collector still lists it); the counter skips it and still counts."""
    import weakref

    class Referent:
        pass
    referent = Referent()
    proxy = weakref.proxy(referent)
    del referent
    with pytest.raises(ReferenceError):
        isinstance(proxy, torch.Tensor)
    x = torch.randn(10, 8, requires_grad=True)
    assert saved_activation_bytes({}, lambda: (x.exp() * 2).sum()).total() == 320


class NoData(torch.Tensor):
    """A tensor without data (as a tracing compiler leaves fake tensors alive): its storage has no pointer."""

    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_wrapper_subclass(cls, (2, 2), dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_tensors_without_data_alive_elsewhere_are_skipped():
    alive = NoData()
    with pytest.raises(RuntimeError):
        alive.untyped_storage().data_ptr()
    x = torch.randn(10, 8, requires_grad=True)
    assert saved_activation_bytes({}, lambda: (x.exp() * 2).sum()).total() == 320


def test_a_planted_fp32_copy_is_counted_in_its_block():
    block = SavesAnFp32Copy()
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_activation_bytes({"planted": block}, lambda: block(x).sum())
    assert saved.per_block() == {"planted": 16 * 32 * 4}
    assert [t.dtype for t in saved.tensors] == [torch.float32]


@pytest.mark.parametrize("name", list(MODELS))
def test_aligned_saves_no_more_than_native_per_layer(tmp_path, name):
    config = MODELS[name]
    checkpoint = build_tiny_hf_model(tmp_path / name, config)
    batch = random_token_sequences((128, 128, 128, 128), vocab_size=config.vocab_size, seed=0)
    figures = {}
    for align in (False, True):
        model = build_gpt_from_hf(checkpoint, align=align).train()
        figures[align] = saved_activation_bytes(model_blocks(model),
                                                lambda: -torch.cat(token_logprobs(model, batch)).mean())
    native, aligned = figures[False].per_block(), figures[True].per_block()
    layers = [f"layer {i}" for i in range(config.num_layers)]
    for layer in layers:
        assert 0 < aligned[layer] <= native[layer], (layer, aligned[layer], native[layer])
    assert figures[True].total() <= figures[False].total()
    print(name, {k: f"{aligned[k] / native[k]:.2f}" for k in layers},
          f"total {figures[True].total() / figures[False].total():.2f}")

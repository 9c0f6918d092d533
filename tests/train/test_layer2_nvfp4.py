"""The layer-2 hook on NVFP4 linears (``ops.nvfp4_linear.VllmNVFP4Linear``, W4A4, clipped activation
STE): master vs dequantized dX from the same dY, the default bitwise the production backward's dX,
and a planted outlier layer flagged by name. The Megatron vLLM spec builds no NVFP4 linear (the CPU
engine does not serve NVFP4), so the model here is a stack of them inside ``layers.<i>``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_vllm_align.ops.nvfp4_linear import VllmNVFP4Linear
from megatron_vllm_align.ops.nvfp4_linear.case import INPUT_SCALE, threshold_input
from megatron_vllm_align.ops.registry import seed_parameters
from megatron_vllm_align.train.config import Layer2Section
from megatron_vllm_align.train.layer2 import NVFP4_PRECISION, Layer2Hook

K, N, TOKENS, LAYERS = 272, 96, 40, 4


class NVFP4Layers(nn.Module):
    """``layers.<i>.linear_fc1``: one NVFP4 linear per layer, each on its own input."""

    def __init__(self, context) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"linear_fc1": VllmNVFP4Linear(
            K, N, bias=False, vllm_context=context, input_scale=INPUT_SCALE)}) for _ in range(LAYERS))
        for i, layer in enumerate(self.layers):
            seed_parameters(layer["linear_fc1"], torch.Generator().manual_seed(i))

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [layer["linear_fc1"](x) for layer, x in zip(self.layers, inputs, strict=True)]


@pytest.fixture(scope="module")
def captured(bf16_context, tmp_path_factory):
    model = NVFP4Layers(bf16_context)
    gen = torch.Generator().manual_seed(7)
    inputs = [threshold_input(gen, TOKENS, K).requires_grad_() for _ in range(LAYERS)]
    upstream = [torch.randn(TOKENS, N, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    lines: list[str] = []
    hook = Layer2Hook(model, Layer2Section(every=1), tmp_path_factory.mktemp("nvfp4"), console=lines.append)
    with hook.capture(1):
        outputs = model(inputs)
        torch.autograd.backward(outputs, upstream)
    return {"hook": hook, "captures": hook.take_captures(), "inputs": inputs, "lines": lines}


def test_default_is_the_production_dx_and_the_alternative_differs(captured):
    captures = captured["captures"]
    assert [(c.kind, c.module_class, c.layer) for c in captures] == [("nvfp4", "linear_fc1", i) for i in range(LAYERS)]
    result = captured["hook"].measure(1, captures)
    assert {(r.precision, r.gradient) for r in result.rows} == {(NVFP4_PRECISION, "dX")} and len(result.rows) == LAYERS
    from megatron_vllm_align.validation.layer2 import nvfp4_dx_gradients

    for c, x in zip(captures, captured["inputs"], strict=True):
        assert 0 < int((~c.saved["input_clip_mask"]).sum()) < c.saved["input_clip_mask"].numel()  # the STE clips some
        ((default, alternative, exact),) = nvfp4_dx_gradients(
            c.dy, c.saved, torch.bfloat16, (torch.bfloat16, torch.bfloat16, None), exact_dtype=torch.float32).values()
        assert torch.equal(default, x.grad), c.name
        # the hook's default is the step's own backward's dX
        assert set(c.production) == {"dX"}
        assert torch.equal(c.production["dX"], x.grad), c.name
        assert not torch.equal(alternative, default)
        clipped = ~c.saved["input_clip_mask"]
        assert torch.equal(alternative[clipped], torch.zeros_like(alternative[clipped]))   # the STE in both
    for r in result.rows:
        # E2M1 keeps one mantissa bit (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 per block scale): relative rounding
        # error up to 1/6, RMS ~0.1, about 3x FP8's 0.036; measured rel L2 0.094-0.096, cosine 0.9954-0.9956.
        assert 0.99 < r.cosine < 0.999 and 0.05 < r.rel_l2 < 0.15 and abs(r.norm_ratio - 1) < 0.01, r
        assert r.sigma_ratio > 5, r   # the master convention's bias is far above the bf16 noise floor
    assert result.outliers == []
    assert any(note.startswith("NVFP4 linears: dX from the master weight") for note in result.notes)


def test_planted_nvfp4_outlier_flagged_by_layer(captured):
    captures = captured["captures"]
    planted = captures[2]
    planted.saved["master_weight"] = planted.saved["master_weight"] * 2
    try:
        result = captured["hook"].measure(3, captures)
    finally:
        planted.saved["master_weight"] = planted.saved["master_weight"] / 2
    assert [(r.module_class, r.layer, r.precision) for r in result.outliers] == [("linear_fc1", 2, NVFP4_PRECISION)]
    captured["hook"].publish(3, result)
    assert captured["lines"] == [f"layer2 WARNING: step 3: linear_fc1 layer 2 flagged [nvfp4 dX]: "
                                 f"{'; '.join(result.outliers[0].reasons)}"]


@pytest.mark.parametrize("changed", ["input", "weight"])
def test_captures_are_not_copies_and_in_place_changes_are_refused(bf16_context, tmp_path, changed):
    """The hook keeps the input and the master weight without copying them: an in-place change
    after the forward (an optimizer step before the measure, an op writing into the input) is
    refused by name instead of being measured."""
    model = NVFP4Layers(bf16_context)
    gen = torch.Generator().manual_seed(3)
    inputs = [threshold_input(gen, TOKENS, K).requires_grad_() for _ in range(LAYERS)]
    hook = Layer2Hook(model, Layer2Section(every=1), tmp_path, console=lambda line: None)
    with hook.capture(1):
        outputs = model(inputs)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    captures = hook._calls["layers.2.linear_fc1"]
    assert captures[0].x.data_ptr() == inputs[2].data_ptr()
    assert captures[0].master_weight.data_ptr() == model.layers[2]["linear_fc1"].weight.data_ptr()
    with torch.no_grad():
        (inputs[2] if changed == "input" else model.layers[2]["linear_fc1"].weight).mul_(1.0)
    message = "input of layers.2.linear_fc1 was modified" if changed == "input" else \
        "weight of layers.2.linear_fc1 changed since the step's forward"
    with pytest.raises(RuntimeError, match=message):
        hook.take_captures()

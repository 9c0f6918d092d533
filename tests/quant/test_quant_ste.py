"""Straight-through estimators: forward value, surrogate derivative on both sides of and at the
threshold (relative to the tensor's scale), and refused STEs and scales."""
import math

import pytest
import torch

from megatron_vllm_align.contracts import STE
from megatron_vllm_align.quant.fp8 import FP8Scheme, dequantize_fp8, quantize_fp8
from megatron_vllm_align.quant.ste import ste_pass_mask, ste_quantize

STATIC = FP8Scheme("per_tensor", static=True)


def fp8_qdq(scale: torch.Tensor):
    """Quantize-dequantize with a static per-tensor FP8 scale, shape-preserving for any ndim."""
    def qdq(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(1, -1)
        q, s = quantize_fp8(flat, STATIC, scale)
        return dequantize_fp8(q, s, STATIC, x.dtype).reshape(x.shape)
    return qdq


def test_identity_ste_passes_the_gradient_unchanged():
    scale = torch.tensor([0.01])
    x = (torch.randn(5, 7) * 3).requires_grad_()
    y = ste_quantize(x, fp8_qdq(scale), STE("identity"), scale)
    assert torch.equal(y, fp8_qdq(scale)(x.detach()))
    assert not torch.equal(y, x.detach()), "the forward must be the quantized value"
    g = torch.randn(5, 7)
    y.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("value_at_threshold", [0.0, 1.0])
def test_clipped_ste_mask_below_above_and_at_threshold(value_at_threshold):
    """Threshold 448 relative to the static scale s: beyond |x| = 448 s the forward saturates and the
    surrogate derivative is 0; exactly at it the derivative is the stated value_at_threshold.
    s = 3 * 2^-8 makes 448 s = 5.25 exact in fp32."""
    scale = torch.tensor([3 * 2.0**-8])
    at = 448 * 3 * 2.0**-8
    x = torch.tensor([0.0, 1.0, -4.0, at, -at, 5.5, -100.0], dtype=torch.float32, requires_grad=True)
    ste = STE("clipped", threshold=448.0, value_at_threshold=value_at_threshold)
    y = ste_quantize(x, fp8_qdq(scale), ste, scale)
    assert y[5] == y[3] and y[6] == y[4], "values beyond the threshold saturate in forward"
    y.backward(torch.full_like(x, 2.0))
    v = 2.0 * value_at_threshold
    assert x.grad.tolist() == [2.0, 2.0, 2.0, v, v, 0.0, 0.0]


def test_threshold_is_relative_to_the_scale_which_broadcasts():
    """Per-row scales [2, 1]: the same |x| passes in the row with the larger scale only; without a
    scale the threshold is in the units of x."""
    x = torch.tensor([[3.0, -3.0, 0.5], [3.0, -3.0, 0.5]])
    ste = STE("clipped", threshold=2.0, value_at_threshold=0.0)
    mask = ste_pass_mask(ste, x, torch.tensor([[2.0], [1.0]]))
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert ste_pass_mask(ste, x).tolist() == [[False, False, True]] * 2
    assert ste_pass_mask(STE("identity"), x, torch.tensor([1.0])) is None


def test_clipped_threshold_is_compared_exactly_in_the_units_of_x():
    """A threshold that bf16 cannot represent must not be rounded to bf16 before the comparison."""
    x = torch.tensor([1.0, 1.0078125, 1.015625], dtype=torch.bfloat16, requires_grad=True)  # consecutive bf16
    ste = STE("clipped", threshold=1.0078125 + 1e-6, value_at_threshold=0.0)
    y = ste_quantize(x, lambda t: t.clone(), ste)
    y.backward(torch.ones_like(x))
    assert x.grad.tolist() == [1.0, 1.0, 0.0]


def test_refused_stes_and_scales():
    qdq = fp8_qdq(torch.tensor([1.0]))
    x = torch.randn(3)
    with pytest.raises(TypeError):
        ste_quantize(x, qdq)  # the STE is required
    with pytest.raises(TypeError, match="contracts.STE"):
        ste_quantize(x, qdq, "identity")
    with pytest.raises(ValueError, match="kind 'none'"):
        ste_quantize(x, qdq, STE("none"))
    with pytest.raises(ValueError, match="invalid value 'soft'"):
        STE("soft")
    with pytest.raises(ValueError, match="positive threshold"):
        STE("clipped", value_at_threshold=1.0)
    with pytest.raises(ValueError, match="value_at_threshold 0.0 or 1.0"):
        STE("clipped", threshold=1.0)
    with pytest.raises(ValueError, match="only a clipped STE has a threshold"):
        STE("identity", threshold=1.0)
    with pytest.raises(ValueError, match="only a clipped STE has a value_at_threshold"):
        STE("identity", value_at_threshold=0.0)
    for bad, message in ((0.0, "positive threshold"), (-1.0, "positive threshold"),
                         (math.inf, "must be finite"), (math.nan, "must be finite")):
        with pytest.raises(ValueError, match=message):
            STE("clipped", threshold=bad, value_at_threshold=1.0)
    for bad in (0.5, True, None):
        with pytest.raises(ValueError, match="value_at_threshold"):
            STE("clipped", threshold=1.0, value_at_threshold=bad)
    with pytest.raises(ValueError, match="expected a number"):
        STE("clipped", threshold="1", value_at_threshold=1.0)
    clipped = STE("clipped", threshold=448.0, value_at_threshold=1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        ste_pass_mask(clipped, torch.randn(3, 4), torch.ones(3))
    for bad in (torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([math.nan])):
        with pytest.raises(ValueError, match="finite and > 0"):
            ste_pass_mask(clipped, x, bad)
    with pytest.raises(TypeError, match="STE scale must be a torch.Tensor"):
        ste_pass_mask(clipped, x, 0.01)
    with pytest.raises(ValueError, match="quant_dequant_fn must return"):
        ste_quantize(x, lambda t: t[:2], STE("identity"))
    with pytest.raises(ValueError, match="quant_dequant_fn must return"):
        ste_quantize(x, lambda t: t.double(), STE("identity"))

"""The layer-1 harness itself: correct modules pass, planted bugs are caught, bad input is refused."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.gradcheck import GradcheckError

from megatron_vllm_align.validation import (
    DY_KINDS,
    compare_one_step_update,
    compare_vjp,
    derive_tolerance,
    gradcheck_module,
    make_dy,
    visible_forward,
    visible_with_surrogate,
)


class _ClosedFormLinear(torch.autograd.Function):
    """Y = X W^T + b with a hand-written backward (fp32 accumulation, fp64 kept for gradcheck);
    ``bug`` plants one mistake."""

    @staticmethod
    def forward(ctx, x, w, b, bug):
        ctx.save_for_backward(x, w)
        ctx.bug = bug
        acc = torch.promote_types(x.dtype, torch.float32)
        return (x.to(acc) @ w.to(acc).T + b.to(acc)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        acc = torch.promote_types(x.dtype, torch.float32)
        gf, wf = g.to(acc), w.to(acc)
        dx = gf @ (wf.T if ctx.bug == "dx_transposed" else wf)
        dw = gf.T @ x.to(acc)
        if ctx.bug == "dw_half":
            dw = dw * 0.5
        db = None if ctx.bug == "drop_bias" else gf.sum(0)
        if ctx.bug == "nan":
            dw[0, 0] = float("nan")
        return dx.to(x.dtype), dw.to(w.dtype), None if db is None else db.to(w.dtype), None


class CandidateLinear(nn.Module):
    def __init__(self, n, k, dtype, bug=None, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter((torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype))
        self.bias = nn.Parameter(torch.randn(n, generator=gen).to(dtype))
        self.bug = bug

    def forward(self, x):
        if self.bug == "detached":
            x = x.detach()
        return _ClosedFormLinear.apply(x, self.weight, self.bias, self.bug)


class ReferenceLinear(nn.Module):
    """Independent reference: autograd of the fp32 formula, never the candidate's backward."""

    def __init__(self, candidate):
        super().__init__()
        self.weight = nn.Parameter(candidate.weight.detach().clone())
        self.bias = nn.Parameter(candidate.bias.detach().clone())

    def forward(self, x):
        return F.linear(x.float(), self.weight.float(), self.bias.float()).to(x.dtype)


def _setup(m, n=48, k=48, dtype=torch.bfloat16, bug=None, seed=0):
    cand = CandidateLinear(n, k, dtype, bug=bug, seed=seed)
    ref = ReferenceLinear(cand)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).requires_grad_()
    tols = {"input[0]": derive_tolerance(dtype, k)[0], "weight": derive_tolerance(dtype, m)[0],
            "bias": derive_tolerance(dtype, m)[0]}
    return cand, ref, x, tols


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("m", [1, 257])
def test_correct_linear_passes(seed, m):
    cand, ref, x, tols = _setup(m, seed=seed)
    report = compare_vjp(cand, ref, [x], tolerances=tols, seed=seed)
    assert report.passed, report.failures
    assert {c.dy_kind for c in report.checks} == {"random", "zero", "sparse", "along_output"}
    assert {c.item for c in report.checks} == {"input[0]", "weight", "bias"}


@pytest.mark.parametrize("bug, item, status", [
    ("dw_half", "weight", "tolerance"),
    ("dx_transposed", "input[0]", "tolerance"),
    ("drop_bias", "bias", "missing"),
    ("detached", "input[0]", "missing"),
    ("nan", "weight", "non_finite"),
])
def test_planted_bugs_are_caught(bug, item, status):
    cand, ref, x, tols = _setup(64, bug=bug)
    report = compare_vjp(cand, ref, [x], tolerances=tols)
    assert not report.passed
    failing = {(c.item, c.status) for c in report.checks if not c.passed}
    assert (item, status) in failing, report.failures
    assert any(item in line for line in report.failures)
    with pytest.raises(AssertionError, match=item.replace("[", r"\[").replace("]", r"\]")):
        report.raise_if_failed()


def test_zero_dy_alone_misses_a_scale_bug_but_random_dy_catches_it():
    cand, ref, x, tols = _setup(16, bug="dw_half")
    assert compare_vjp(cand, ref, [x], tolerances=tols, dy_kinds=["zero"]).passed
    assert not compare_vjp(cand, ref, [x], tolerances=tols, dy_kinds=["random"]).passed


def test_user_dy_is_used_on_both_sides():
    cand, ref, x, tols = _setup(8)
    dy = torch.zeros(8, 48, dtype=torch.bfloat16)
    dy[3, 5] = 1.0
    report = compare_vjp(cand, ref, [x], tolerances=tols, dy_kinds=[[dy]])
    assert report.passed
    grad_x = next(c for c in report.checks if c.item == "input[0]")
    # dX = dY W: only row 3 is non-zero and equals W[5, :]
    assert grad_x.metrics.ref_norm == pytest.approx(float(cand.weight[5].detach().double().norm()), rel=1e-2)


class _IgnoresSecondInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, unused):
        return x * self.scale


def test_unused_differentiable_input_is_reported_not_ignored():
    cand, ref = _IgnoresSecondInput(), _IgnoresSecondInput()
    inputs = [torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)]
    tol, _ = derive_tolerance(torch.float32, 1)
    report = compare_vjp(cand, ref, inputs, tolerances=tol)
    assert {(c.item, c.status) for c in report.checks if not c.passed} == {("input[1]", "unused")}
    assert compare_vjp(cand, ref, inputs, tolerances=tol, declared_unused=["input[1]"]).passed
    with pytest.raises(ValueError, match="declared_unused"):
        compare_vjp(cand, ref, inputs, tolerances=tol, declared_unused=["input[7]"])


def test_parameter_mismatches_are_refused():
    cand, ref, x, tols = _setup(4)
    with pytest.raises(ValueError, match="shares storage"):
        compare_vjp(cand, cand, [x], tolerances=tols)
    other = copy.deepcopy(ref)
    with torch.no_grad():
        other.weight[0, 0] += 1
    with pytest.raises(ValueError, match="'weight' has different values"):
        compare_vjp(cand, other, [x], tolerances=tols)
    renamed = nn.Module()
    renamed.w = nn.Parameter(cand.weight.detach().clone())
    renamed.bias = nn.Parameter(cand.bias.detach().clone())
    with pytest.raises(ValueError, match="only in candidate \\['weight'\\]"):
        compare_vjp(cand, renamed, [x], tolerances=tols)
    with pytest.raises(KeyError, match="no tolerance given for gradient 'bias'"):
        compare_vjp(cand, ref, [x], tolerances={"input[0]": tols["input[0]"], "weight": tols["weight"]})


def test_dy_of_wrong_shape_or_dtype_is_refused():
    cand, ref, x, tols = _setup(4)
    with pytest.raises(ValueError, match="dY\\[0\\] is \\(4, 7\\)"):
        compare_vjp(cand, ref, [x], tolerances=tols, dy_kinds=[[torch.zeros(4, 7, dtype=torch.bfloat16)]])
    with pytest.raises(ValueError, match="torch.float32"):
        compare_vjp(cand, ref, [x], tolerances=tols, dy_kinds=[[torch.zeros(4, 48)]])
    with pytest.raises(ValueError, match="unknown dY kind"):
        compare_vjp(cand, ref, [x], tolerances=tols, dy_kinds=["ones"])


def test_make_dy_kinds():
    out = [torch.empty(40, 50, dtype=torch.bfloat16)]
    (zero,) = make_dy(out, "zero", 0)
    (sparse,) = make_dy(out, "sparse", 0)
    (rand_a,), (rand_b,) = make_dy(out, "random", 3), make_dy(out, "random", 3)
    assert zero.count_nonzero() == 0
    assert 0.02 < sparse.count_nonzero() / sparse.numel() < 0.09
    assert torch.equal(rand_a, rand_b) and rand_a.dtype == torch.bfloat16
    (one,) = make_dy([torch.empty(1, 1)], "sparse", 5)
    assert one.count_nonzero() == 1


def test_derive_tolerance_values_and_reasoning():
    t, reasoning = derive_tolerance(torch.bfloat16, 64)
    u_bf16, u_fp32 = 2.0 ** -8, 2.0 ** -24
    assert t.rel_l2 == pytest.approx(2 * u_bf16 + 4 * 8 * u_fp32)
    assert t.rtol == pytest.approx(4 * t.rel_l2)
    assert "n=64" in reasoning and "bfloat16" in reasoning
    assert derive_tolerance(torch.float32, 1)[0].rel_l2 == pytest.approx(2 * u_fp32 + 4 * u_fp32)
    # a bf16 accumulation contract grows with sqrt(n)
    assert derive_tolerance(torch.bfloat16, 4096, accumulation_dtype=torch.bfloat16)[0].rel_l2 == \
        pytest.approx(2 * u_bf16 + 4 * 64 * u_bf16)
    with pytest.raises(ValueError, match="reduction_length"):
        derive_tolerance(torch.bfloat16, 0)
    with pytest.raises(TypeError, match="not a floating dtype"):
        derive_tolerance(torch.int32, 4)


@pytest.mark.parametrize("seed", range(3))
def test_one_step_update(seed):
    cand, ref, x, tols = _setup(32, seed=seed)
    assert compare_one_step_update(cand, ref, [x], tolerance=tols["weight"], seed=seed).passed
    cand, ref, x, tols = _setup(32, bug="dw_half", seed=seed)
    report = compare_one_step_update(cand, ref, [x], tolerance=tols["weight"], seed=seed)
    assert [c.item for c in report.checks if not c.passed] == ["weight"]


def test_gradcheck_catches_a_wrong_closed_form():
    good = CandidateLinear(5, 4, torch.float32)
    x = torch.randn(3, 4)
    assert gradcheck_module(good, [x])
    with pytest.raises(GradcheckError):
        gradcheck_module(CandidateLinear(5, 4, torch.float32, bug="dw_half"), [x])


def test_visible_with_surrogate_bridge():
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(3, 4)
    visible = (x.detach().bfloat16() @ w.bfloat16().T).float()   # an "inference" value
    surrogate = x @ w.T
    y = visible_with_surrogate(visible, surrogate)
    assert torch.equal(y, visible)
    dy = torch.randn(6, 3)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ w)
    with pytest.raises(ValueError, match="dtype"):
        visible_with_surrogate(visible.double(), surrogate)
    with pytest.raises(ValueError, match="shape"):
        visible_with_surrogate(visible[:2], surrogate)
    with pytest.raises(ValueError, match="device"):
        visible_with_surrogate(visible.to("meta"), surrogate)


def test_visible_forward_bridge():
    x = torch.randn(5, 8, requires_grad=True)
    visible = lambda t: torch.round(t * 4) / 4            # noqa: E731  a "rounded" inference value
    native = lambda t: t * 1.0                            # noqa: E731  identity-STE training math
    y = visible_forward(visible, native, x)
    assert torch.equal(y, visible(x.detach()))
    y.backward(torch.full_like(y, 3.0))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    bad = visible_forward(visible, lambda t: t.sum(), torch.randn(2, requires_grad=True))
    with pytest.raises(ValueError, match="native rerun"):
        bad.backward(torch.ones(2))
    with pytest.raises(TypeError, match="input 1"):
        visible_forward(visible, native, x, 3.0)


def test_report_renders():
    cand, ref, x, tols = _setup(4, bug="drop_bias")
    report = compare_vjp(cand, ref, [x], tolerances=tols)
    md = report.to_markdown()
    assert "FAIL" in md and "| random | `bias` | missing |" in md
    reasoned = compare_vjp(cand, ref, [x], tolerances=tols, tolerance_reasoning="2u + 4 sqrt(n) u")
    assert "Tolerance reasoning: 2u + 4 sqrt(n) u" in reasoned.to_markdown()
    d = report.to_dict()
    assert d["passed"] is False and len(d["checks"]) == 3 * len(DY_KINDS) and d["failures"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_non_finite_gradients_are_classified_exactly(dtype):
    """A candidate with NaN / inf entries is ``non_finite`` with its count and first index; a reference with
    one is refused; a float64 candidate whose float64 norm overflows (1e200) but whose values are finite is
    not called non-finite (the element-wise test decides where the norm is not finite)."""
    from megatron_vllm_align.contracts import Tolerance
    from megatron_vllm_align.validation.vjp import compare_gradient

    tolerance = Tolerance(rtol=1e-2, atol=0.0, rel_l2=1e-2)
    ref = torch.linspace(-1, 1, 12, dtype=torch.float64).view(3, 4)
    grad = ref.to(dtype).clone()
    assert compare_gradient("w", "random", grad, ref, tolerance).status == "ok"
    grad[1, 2], grad[2, 0] = float("nan"), float("-inf")
    check = compare_gradient("w", "random", grad, ref, tolerance)
    assert check.status == "non_finite" and check.message.startswith("2 non-finite values")
    assert "first at index (1, 2)" in check.message
    with pytest.raises(ValueError, match="reference gradient of 'w' .* non-finite"):
        compare_gradient("w", "random", ref.to(dtype), torch.where(ref > 0.9, torch.inf, ref), tolerance)
    if dtype == torch.float64:
        huge = ref * 1e200
        assert compare_gradient("w", "random", huge * (1 + 2 ** -40), huge, tolerance).status == "ok"
        assert compare_gradient("w", "random", huge * 2, huge, tolerance).status == "tolerance"

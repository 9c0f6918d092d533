"""The aligned linears' backward IS Megatron's local linear backward (issue 28): for the same X, W and dY,
dX, dW (and db) of the dense linear's autograd Function, the output layer's and the FP8 linear's (its
BF16 GEMM backward on the dequantized references) equal, bit for bit, those of a real Megatron-Core
``ColumnParallelLinear`` / ``RowParallelLinear`` (local, no gradient-accumulation fusion, CPU) at real
widths: Qwen3-0.6B's MLP (hidden 1024, intermediate 3072), the hidden-1024 model's square attention
output projection, and an output layer of 16384 rows.

Controls, in the same test:
* the former fp32 closed form (operands cast to fp32, one rounding per result), computed inline, must
  give other bits than the library's somewhere in the case, so equality is not a property of any
  correct formula. Asserted on CPUs with bf16 matrix units (``avx512_bf16`` / ``amx_bf16``: measured
  here, AVX-512 BF16 EPYC); elsewhere the test only warns when the shape does not tell them apart;
* planted bugs in the aligned backward must break the equality: dY rescaled by one bf16 ulp
  (``1 + 2^-7``), and, for the square layer, dX from the transposed weight.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_vllm_align.ops.dense_linear import module as dense_module
from megatron_vllm_align.ops.dense_linear.module import VllmDenseLinear
from megatron_vllm_align.ops.fp8_linear import vjp as fp8_vjp
from megatron_vllm_align.ops.fp8_linear.kernel import FP8_ACTIVATION_SCHEME, FP8_WEIGHT_SCHEME
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8Linear
from megatron_vllm_align.ops.output_layer import module as output_module
from megatron_vllm_align.ops.output_layer.kernel import VllmLMHeadKernel
from megatron_vllm_align.ops.output_layer.module import OutputLogitsFunction
from megatron_vllm_align.quant.fp8 import dequantize_fp8

pytestmark = pytest.mark.usefixtures("megatron_cpu")

TOKENS = 256            # as [sequence 128, batch 2] on Megatron's side
FP8_PREFIX = "model.layers.0.mlp.down_proj"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str            # "dense", "output" or "fp8": the aligned class
    megatron: str        # "column" or "row": Megatron's local linear class
    in_features: int
    out_features: int
    bias: bool = False


CASES = [
    Case("qwen3-0.6b linear_fc1", "dense", "column", 1024, 2 * 3072),
    Case("qwen3-0.6b linear_fc2", "dense", "row", 3072, 1024),
    Case("hidden1024 linear_proj (square)", "dense", "row", 1024, 1024),
    Case("qwen2-style linear_qkv with bias", "dense", "column", 1024, 2048 + 2 * 512, bias=True),
    Case("output layer [16384, 1024]", "output", "column", 1024, 16384),
    Case("fp8 per-channel linear (3072 -> 1024) with bias", "fp8", "column", 3072, 1024, bias=True),
]


@functools.cache
def cpu_has_bf16_matrix_units() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _operands(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, case.in_features, generator=gen).bfloat16()
    weight = (torch.randn(case.out_features, case.in_features, generator=gen) * case.in_features ** -0.5).bfloat16()
    bias = (torch.randn(case.out_features, generator=gen) * 0.1).bfloat16() if case.bias else None
    dy = (torch.randn(TOKENS, case.out_features, generator=gen) * 1e-3).bfloat16()
    return x, weight, bias, dy


def megatron_grads(case: Case, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """dX [M, K], dW, db from Megatron's own local linear on [s, b, K] = [M / 2, 2, K] inputs."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=case.in_features, num_attention_heads=1,
                               params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
                               perform_initialization=False)
    assert not config.gradient_accumulation_fusion
    common = dict(config=config, init_method=lambda w: None, bias=case.bias, skip_bias_add=False)
    if case.megatron == "column":
        layer = ColumnParallelLinear(case.in_features, case.out_features, gather_output=False, **common)
    else:
        assert not case.bias, "RowParallelLinear adds its bias outside the linear's autograd Function"
        layer = RowParallelLinear(case.in_features, case.out_features, input_is_parallel=True, **common)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if case.bias:
            layer.bias.copy_(bias)
    assert layer.weight.dtype == torch.bfloat16
    inp = x.view(TOKENS // 2, 2, -1).clone().requires_grad_()
    out, _ = layer(inp)
    params = [inp, layer.weight] + ([layer.bias] if case.bias else [])
    grads = torch.autograd.grad(out, params, dy.view(TOKENS // 2, 2, -1))
    names = ["dX", "dW", "db"][:len(grads)]
    return {name: g.reshape(-1, g.shape[-1]) if name == "dX" else g for name, g in zip(names, grads)}


def aligned_grads(case: Case, contexts: dict, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """dX, dW (, db) from the aligned class's autograd Function after its vLLM forward on ``x``."""
    inp = x.clone().requires_grad_()
    if case.kind == "output":
        master = weight.clone().requires_grad_()
        kernel = VllmLMHeadKernel(contexts["bf16"], case.out_features, case.in_features)
        kernel.load(master)
        out = OutputLogitsFunction.apply(inp, master, kernel, (TOKENS,))
        params = [inp, master]
    else:
        if case.kind == "dense":
            layer = VllmDenseLinear(case.in_features, case.out_features, bias=case.bias,
                                    vllm_context=contexts["bf16"])
        else:
            layer = VllmFP8Linear(case.in_features, case.out_features, bias=case.bias,
                                  vllm_context=contexts["fp8"], prefix=FP8_PREFIX)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if case.bias:
                layer.bias.copy_(bias)
        layer.refresh_deployed()
        out = layer(inp)
        params = [inp, layer.weight] + ([layer.bias] if case.bias else [])
    grads = torch.autograd.grad(out, params, dy)
    return dict(zip(["dX", "dW", "db"], grads))


def reference_operands(case: Case, contexts: dict, x: torch.Tensor, weight: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_ref, W_ref) the contract feeds the backward: the operands themselves, or for the FP8 linear
    the dequantized deployed weight and input (its defaults), in bf16."""
    if case.kind != "fp8":
        return x, weight
    layer = VllmFP8Linear(case.in_features, case.out_features, bias=case.bias, vllm_context=contexts["fp8"],
                          prefix=FP8_PREFIX)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.refresh_deployed()
    w_ref = dequantize_fp8(*layer.kernel.fp8_weight(), FP8_WEIGHT_SCHEME, torch.bfloat16)
    x_ref = dequantize_fp8(*layer.kernel.quantize_activation(x), FP8_ACTIVATION_SCHEME, torch.bfloat16)
    return x_ref, w_ref


def _planted(monkeypatch, case: Case, bug: str) -> None:
    """Replace the ``linear_vjp`` the case's class calls by a planted bug."""
    target = {"dense": dense_module, "output": output_module, "fp8": fp8_vjp}[case.kind]
    real = target.linear_vjp

    def planted(grad, x_ref, w_ref, *args, **kwargs):
        if bug == "rescaled":
            grad = grad * (1 + 2 ** -7)
        else:
            w_ref = w_ref.t()
        return real(grad, x_ref, w_ref, *args, **kwargs)
    monkeypatch.setattr(target, "linear_vjp", planted)


def _equal(ours: dict, theirs: dict) -> dict[str, bool]:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
    return {name: torch.equal(ours[name], theirs[name]) for name in ours}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backward_is_megatrons_local_linear_backward_bitwise(case, bf16_context, fp8_context, monkeypatch):
    contexts = {"bf16": bf16_context, "fp8": fp8_context}
    x, weight, bias, dy = _operands(case)
    ours = aligned_grads(case, contexts, x, weight, bias, dy)
    x_ref, w_ref = reference_operands(case, contexts, x, weight)
    theirs = megatron_grads(case, x_ref, w_ref, bias, dy)
    assert all(_equal(ours, theirs).values()), _equal(ours, theirs)

    # Control 1: the former fp32 closed form gives other bits on this shape (on bf16 matrix units).
    fp32_form = {"dX": (dy.float() @ w_ref.float()).bfloat16(), "dW": (dy.float().t() @ x_ref.float()).bfloat16()}
    differs = {name: not torch.equal(fp32_form[name], ours[name]) for name in fp32_form}
    if cpu_has_bf16_matrix_units():
        assert any(differs.values()), f"{case.name}: the fp32 closed form has the library's bits here"
    elif not any(differs.values()):
        warnings.warn(f"{case.name}: on this CPU the fp32 closed form has the library's bits at this shape; "
                      "control 1 does not exercise the difference", stacklevel=1)

    # Control 2: planted bugs break the equality.
    bugs = ["rescaled"] + (["transposed"] if case.in_features == case.out_features else [])
    for bug in bugs:
        with monkeypatch.context() as patch:
            _planted(patch, case, bug)
            planted = aligned_grads(case, contexts, x, weight, bias, dy)
        equal = _equal(planted, theirs)
        assert not equal["dX"], f"{case.name}: planted {bug} backward still equals Megatron's dX"
        if bug == "rescaled":
            assert not equal["dW"], f"{case.name}: planted {bug} backward still equals Megatron's dW"

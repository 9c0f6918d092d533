"""The SwiGLU backward (contract ``silu_and_mul``, case A; the formula is in the module docstring of
:mod:`megatron_vllm_align.ops.silu_and_mul.module`): the closed-form fp32 VJP in blocks of rows."""
from __future__ import annotations

import torch

# fp32 values per block: a block's working set (~6 such tensors) stays in a core's L2 (measured in a training step).
_BLOCK_ELEMENTS = 1 << 16


def silu_and_mul_vjp(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Input gradient of ``silu(gate) * up`` for ``x = [gate | up]`` [..., 2d]: the fp32 closed form
    (module docstring), cast once to ``x``'s dtype. Computed in blocks of rows of about
    ``_BLOCK_ELEMENTS`` fp32 values each (no fp32 copy of the whole input; the passes over a block
    stay in cache): ``d_gate`` by torch's fused ``silu_backward`` kernel on ``dY up`` (fp32),
    ``d_up = dY silu(gate)``."""
    width = x.shape[-1] // 2
    flat_x, flat_grad = x.reshape(-1, 2 * width), grad_out.reshape(-1, width)
    grad_in = torch.empty_like(flat_x)
    step = max(1, _BLOCK_ELEMENTS // max(width, 1))
    for first in range(0, flat_x.shape[0], step):
        rows = slice(first, first + step)
        gate_up = flat_x[rows].float()
        gate, up = gate_up[:, :width], gate_up[:, width:]
        grad = flat_grad[rows].float()
        grad_in[rows, :width] = torch.ops.aten.silu_backward(grad * up, gate)
        grad_in[rows, width:] = grad.mul_(torch.nn.functional.silu(gate))
    return grad_in.view(x.shape)

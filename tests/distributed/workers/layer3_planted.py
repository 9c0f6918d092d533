"""torchrun worker: the layer-3 run with a planted backward bug on tensor-parallel rank 1 only: its aligned
dense linears return dW scaled by ``SCALE``, rank 0's are correct. A comparison of rank 0's shards alone would
pass. Arguments: as ``python -m megatron_vllm_align.train``."""
import sys

from megatron.core import parallel_state

from megatron_vllm_align.ops.dense_linear.module import DenseLinearFunction
from megatron_vllm_align.train.__main__ import main

SCALE = 0.8
_real = DenseLinearFunction.backward


def _scaled_dw_on_rank_1(ctx, grad_out):
    dx, dw, *rest = _real(ctx, grad_out)
    if dw is not None and parallel_state.get_tensor_model_parallel_rank() == 1:
        dw = dw * SCALE
    return (dx, dw, *rest)


DenseLinearFunction.backward = staticmethod(_scaled_dw_on_rank_1)
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

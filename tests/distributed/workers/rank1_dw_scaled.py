"""torchrun worker: a recipe run with a backward bug planted on tensor-parallel rank 1 only: its aligned dense
and FP8 linears return dW scaled by ``SCALE``, rank 0's are correct, so a check that looks at rank 0's shards
alone passes it. Arguments: as ``python -m megatron_vllm_align.train``."""
import sys

from megatron.core import parallel_state

from megatron_vllm_align.ops.dense_linear.module import DenseLinearFunction
from megatron_vllm_align.ops.fp8_linear.module import VllmFP8LinearFunction
from megatron_vllm_align.train.__main__ import main

SCALE = 0.8


def _scaled_on_rank_1(backward):
    def scaled(ctx, *grad_outputs):
        dx, dw, *rest = backward(ctx, *grad_outputs)
        if dw is not None and parallel_state.get_tensor_model_parallel_rank() == 1:
            dw = dw * SCALE
        return (dx, dw, *rest)
    return staticmethod(scaled)


for function in (DenseLinearFunction, VllmFP8LinearFunction):
    function.backward = _scaled_on_rank_1(function.backward)
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

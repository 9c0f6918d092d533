"""One home per op: ``ops/<contract name>/`` holds the op's gradient contract (``<name>.yaml``), its
visible kernel (``kernel.py``: vLLM's op in the engine's configuration, with a native reference), its
autograd module (``module.py``: that forward wired to its backward), its backward (``vjp.py``: the
reused or closed-form VJP as plain functions), its independent float64 reference (``reference.py``) and
its layer-1 cases (``case.py``), registered by name in :mod:`.registry`. Shared here: the engine context
(``vllm_context``), the bf16 cast rule of the CPU kernels (``cpu_cast``), deployed-weight refresh
(``refresh``) and the reference bridge."""

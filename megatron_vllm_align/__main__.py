"""``python -m megatron_vllm_align``: the main job (``megatron_vllm_align.main_job``);
``python -m megatron_vllm_align check --model DIR``: check a checkpoint (``megatron_vllm_align.check``)."""
import sys

if sys.argv[1:2] == ["check"]:
    from megatron_vllm_align.check import main

    sys.exit(main(sys.argv[2:]))

from megatron_vllm_align.main_job import main

sys.exit(main())

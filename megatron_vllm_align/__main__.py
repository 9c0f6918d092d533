"""``python -m megatron_vllm_align``: the main job (see ``megatron_vllm_align.main_job``)."""
import sys

from megatron_vllm_align.main_job import main

sys.exit(main())

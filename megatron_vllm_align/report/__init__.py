"""The run report (Markdown + PNG plots), written atomically and last; layer-3 input data."""
from megatron_vllm_align.validation.layer3_data import (
           ARMS,
           STEP_METRICS,
           ArmStep,
           Layer3DataError,
           Layer3Run,
           Localisation,
           layer3_from_dict,
           layer3_to_dict,
           load_layer3,
)

from .run_report import INCOMPLETE_MARKER, RunReportInputs, layer1_summary, start_run_report, write_run_report

__all__ = ["ARMS", "ArmStep", "INCOMPLETE_MARKER", "Layer3DataError", "Layer3Run", "Localisation", "RunReportInputs",
           "STEP_METRICS", "layer1_summary", "layer3_from_dict", "layer3_to_dict", "load_layer3", "start_run_report",
           "write_run_report"]

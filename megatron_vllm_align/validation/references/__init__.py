"""Independent layer-1 references: plain autograd of each module class's math (never the backward
under test); the FP8 linear's is built from its gradient contract."""
from .attention import ReferenceAttention
from .dense_linear import ReferenceDenseLinear
from .fp8_linear import FP8_LINEAR_VARIABLES, ReferenceFP8Linear
from .rms_norm import ReferenceRMSNorm
from .rotary import ReferenceRotary
from .selected_logprob import ReferenceSelectedLogprob
from .silu_and_mul import ReferenceSiluAndMul

__all__ = ["FP8_LINEAR_VARIABLES", "ReferenceAttention", "ReferenceDenseLinear", "ReferenceFP8Linear",
           "ReferenceRMSNorm", "ReferenceRotary", "ReferenceSelectedLogprob", "ReferenceSiluAndMul"]

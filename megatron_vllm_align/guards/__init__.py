"""Training-time guards against false gradient differences (docs/method.md#false-differences).

* :class:`GradientDumper` / :func:`load_gradient_dump` / :func:`diff_gradient_dumps`: dump
  gradients where the optimizer sees them (after DP / expert-DP scaling, unscaling, clipping;
  FSDP2 shards reassembled), with the scaling factors that were applied.
* :func:`check_optimizer_identity`: the optimizer steps the parameters the forward uses, by
  identity (module replacements, FSDP2 unsharded copies).
* :func:`validate_freeze`: a declared freeze set really stays bitwise unchanged.
"""
from megatron_vllm_align.guards.dump_diff import DumpDiff, diff_dumps, diff_gradient_dumps, format_diff
from megatron_vllm_align.guards.dump_format import GradientDumpError
from megatron_vllm_align.guards.dump_loader import GradientDump, load_gradient_dump
from megatron_vllm_align.guards.freeze import FreezeViolation, FrozenParameterReport, validate_freeze
from megatron_vllm_align.guards.gradient_dump import GradientDumper
from megatron_vllm_align.guards.optimizer_identity import IdentityFinding, check_optimizer_identity
from megatron_vllm_align.guards.scaling import GradientScaling, MegatronScalingProbe

__all__ = [
    "DumpDiff",
    "FreezeViolation",
    "FrozenParameterReport",
    "GradientDump",
    "GradientDumpError",
    "GradientDumper",
    "GradientScaling",
    "IdentityFinding",
    "MegatronScalingProbe",
    "check_optimizer_identity",
    "diff_dumps",
    "diff_gradient_dumps",
    "format_diff",
    "load_gradient_dump",
    "validate_freeze",
]

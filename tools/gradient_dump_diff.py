"""Compare two gradient dumps (written by megatron_vllm_align's GradientDumper).

    python tools/gradient_dump_diff.py DUMP_A DUMP_B --step N [--step-b M] [--json OUT.json]

Prints layer-1 metrics (max abs error, relative L2, norm ratio, cosine) per module class and
per parameter, B being the reference, then parameters present in one dump only, shape
mismatches and differing scaling factors. Exit status 0 when both dumps load, 2 when either
is missing, incomplete or corrupt (the message says which file and why).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_vllm_align.guards import GradientDumpError, diff_gradient_dumps, format_diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_a", help="directory of the dump under comparison")
    parser.add_argument("dump_b", help="directory of the reference dump")
    parser.add_argument("--step", type=int, required=True, help="step of dump A (and of B unless --step-b)")
    parser.add_argument("--step-b", type=int, default=None, help="step of dump B")
    parser.add_argument("--json", type=Path, default=None, help="also write the metrics to this JSON file")
    args = parser.parse_args(argv)
    try:
        diff = diff_gradient_dumps(args.dump_a, args.step, args.dump_b, args.step_b)
    except GradientDumpError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_diff(diff))
    if args.json is not None:
        payload = {
            "per_parameter": {n: m.to_dict() for n, m in diff.per_parameter.items()},
            "per_module_class": {n: m.to_dict() for n, m in diff.per_module_class.items()},
            "only_in_a": diff.only_in_a, "only_in_b": diff.only_in_b,
            "shape_mismatch": diff.shape_mismatch,
            "scaling_a": asdict(diff.scaling_a), "scaling_b": asdict(diff.scaling_b),
            "scaling_differences": diff.scaling_differences,
        }
        temporary = args.json.with_name(args.json.name + ".tmp")
        temporary.write_text(json.dumps(payload, indent=1))
        os.replace(temporary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The row rules on each ISA this machine can run: natively, and with oneDNN capped at lower ISAs
(``ONEDNN_MAX_CPU_ISA``). Per ISA, at Qwen3-0.6B's linear shapes and MoE experts: under the probed rule a
row keeps its bits at row counts the probe never used, and the rule is other than the whole call exactly
where the plain kernel is row-dependent (the control, in the same process). The rules found are printed
with the ISA (measured on an AVX-512 BF16 EPYC: docs/invariance.md#row-rules-per-isa)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "row_rules.py"


@pytest.mark.parametrize("cap", [None, "AVX512_CORE", "AVX2"])
def test_rules_hold_and_are_needed_where_the_kernel_is_row_dependent(cap):
    env = {**os.environ}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    done = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(result["isa"])
    for name, kernel in result["kernels"].items():
        print(f"  {name}: {kernel['rule']} (plain kernel row-dependent: {kernel['plain_differs']})")
    for name, kernel in result["kernels"].items():
        assert kernel["holds"], f"{result['isa']}: {name} changed a row's bits under {kernel['rule']}"
        assert kernel["plain_differs"] == (kernel["rule"] != "whole call"), (result["isa"], name, kernel)

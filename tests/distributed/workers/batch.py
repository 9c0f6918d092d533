"""Many runs of one torchrun worker in one launch: a ``torchrun`` start (about 15 s of imports on 2 cores)
then serves them all. Imported by the workers beside it (their folder is on ``sys.path``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def runs_from_argv(parser: argparse.ArgumentParser) -> list[argparse.Namespace]:
    """``--runs FILE``: one run per line of ``FILE`` (a JSON list of ``parser``'s arguments); otherwise the
    command line's arguments, one run."""
    argv = sys.argv[1:]
    if argv[:1] != ["--runs"]:
        return [parser.parse_args(argv)]
    if len(argv) != 2:
        parser.error("--runs takes one file and nothing else")
    return [parser.parse_args(json.loads(line)) for line in Path(argv[1]).read_text().splitlines() if line]

"""``utils.console.engine_logs_to`` in a fresh process: quiet, vLLM's log lines (through vLLM's own
logging configuration), Python warnings, file-descriptor and C stdio output go to the log and
``print()`` to the terminal, everything is restored after an exception; verbose changes nothing."""
import re
import subprocess
import sys

SCRIPT = r"""
import ctypes, os, sys, warnings
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger
from megatron_vllm_align.utils.console import engine_logs_to

try:
    with engine_logs_to(sys.argv[1], verbose=sys.argv[2] == "verbose"):
        print("progress line")
        configure_logging_if_needed(LoggingConfig())    # what vllm.LLM() does first
        init_logger("vllm.console_test").info("engine log line")
        warnings.warn("library warning")
        os.write(2, b"descriptor 2 output\n")
        ctypes.CDLL(None).printf(b"C stdio output\n")
        raise ValueError("the error")
except ValueError as error:
    print(f"caught: {error}", file=sys.stderr)
os.write(1, b"descriptor 1 restored\n")
"""
LOG_LINE = r"\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] engine log line"   # vLLM's format
QUIET_ONLY = ("engine log line", "library warning", "descriptor 2 output", "C stdio output")


def _run(tmp_path, mode: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "engine.log"), mode],
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout, done.stderr


def test_quiet_sends_engine_and_library_output_to_the_log(tmp_path):
    stdout, stderr = _run(tmp_path, "quiet")
    assert stdout.splitlines() == [f"engine and library logs: {tmp_path / 'engine.log'}", "progress line",
                                   "descriptor 1 restored"]
    assert "caught: the error" in stderr and not any(text in stderr for text in QUIET_ONLY)
    log = (tmp_path / "engine.log").read_text()
    assert all(text in log for text in QUIET_ONLY)
    assert re.search(LOG_LINE, log)


def test_verbose_leaves_everything_on_the_console(tmp_path):
    stdout, stderr = _run(tmp_path, "verbose")
    console = stdout + stderr
    assert all(text in console for text in (*QUIET_ONLY, "progress line", "caught: the error"))
    assert re.search(LOG_LINE, stdout)      # vLLM's default stream, as without the block
    assert "engine and library logs" not in console and not (tmp_path / "engine.log").exists()

"""What every Python process of a test session runs first: this folder is on the ``PYTHONPATH`` that
``tests/conftest.py`` sets, which subprocesses inherit (torchrun ranks, vLLM's engine cores, workers and API
servers, README snippets).

1. The cyclic garbage collector's thresholds raised (:data:`GC_THRESHOLD`). These processes spend most of their
   CPU importing torch, megatron-core and vLLM, and the default young threshold (700) runs a collection every
   700 new objects of imports that create millions. Reference counting still frees every acyclic object at
   once; only cycles wait longer. Nothing computed changes.
2. The vLLM engine cores a session starts, counted. Each engine core logs one
``ENGINE_START_LINE`` at INFO on ``vllm.v1.engine.core``; a file handler on that logger appends it to
``$MVA_ENGINE_START_LOG``. vLLM's own logging configuration (``dictConfig``, which drops the handlers of
``vllm``'s child loggers) is left as vLLM sets it; the handler is attached again after each call. What vLLM
prints is unchanged: its console handler keeps its own level. Each line of the file names the test that
started the engine (``PYTEST_CURRENT_TEST``, which pytest sets and subprocesses inherit), so the session's
summary can say which modules start engines."""
import gc
import logging
import logging.config
import os

ENGINE_CORE_LOGGER = "vllm.v1.engine.core"
ENGINE_START_LINE = "Initializing a V1 LLM engine"
TEST_FIELD_END = " | "   # each line of the file: "<test node id> (<phase>) | <vLLM's message>"
# (young, middle, old): a young collection every 20000 net allocations instead of 700, a middle one every 20
# young ones instead of 10; the old generation as by default.
GC_THRESHOLD = (20000, 20, 10)
_configure = logging.config.dictConfig
_handler = None


def attach() -> None:
    """The file handler on the engine core's logger (idempotent); nothing without ``MVA_ENGINE_START_LOG``."""
    global _handler
    path = os.environ.get("MVA_ENGINE_START_LOG")
    if not path:
        return
    if _handler is None:
        _handler = logging.FileHandler(path)
        _handler.setLevel(logging.INFO)
        _handler.addFilter(_name_the_test)
        _handler.setFormatter(logging.Formatter(f"%(mva_test)s{TEST_FIELD_END}%(message)s"))
    logger = logging.getLogger(ENGINE_CORE_LOGGER)
    if _handler not in logger.handlers:
        logger.addHandler(_handler)
    logger.setLevel(logging.INFO)


def _name_the_test(record: logging.LogRecord) -> bool:
    record.mva_test = os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)")
    return True


def _configure_then_attach(config: dict) -> None:
    _configure(config)
    attach()


logging.config.dictConfig = _configure_then_attach
gc.set_threshold(*GC_THRESHOLD)

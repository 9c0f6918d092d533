"""Counts the vLLM engine cores a test session starts, in every Python process that inherits the session's
``PYTHONPATH`` (this folder; ``tests/conftest.py`` puts it there). Each engine core logs one
``ENGINE_START_LINE`` at INFO on ``vllm.v1.engine.core``; a file handler on that logger appends it to
``$MVA_ENGINE_START_LOG``. vLLM's own logging configuration (``dictConfig``, which drops the handlers of
``vllm``'s child loggers) is left as vLLM sets it; the handler is attached again after each call. What vLLM
prints is unchanged: its console handler keeps its own level."""
import logging
import logging.config
import os

ENGINE_CORE_LOGGER = "vllm.v1.engine.core"
ENGINE_START_LINE = "Initializing a V1 LLM engine"
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
    logger = logging.getLogger(ENGINE_CORE_LOGGER)
    if _handler not in logger.handlers:
        logger.addHandler(_handler)
    logger.setLevel(logging.INFO)


def _configure_then_attach(config: dict) -> None:
    _configure(config)
    attach()


logging.config.dictConfig = _configure_then_attach

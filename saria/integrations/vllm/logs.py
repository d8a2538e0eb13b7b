"""saria's log lines inside vLLM: the ``saria`` loggers write through vLLM's handlers.

vLLM configures only its own ``vllm`` logger (a stream handler with its format, ``propagate``
off) and leaves the root logger alone, so under ``vllm serve`` saria's loggers (``saria.vllm``,
``saria.dataplane...``) have no handler: their INFO lines (the periodic summary) are dropped and
their warnings reach Python's last-resort handler without vLLM's format. :func:`route_to_vllm`,
called when the connector module is imported (the scheduler process and every worker process
import it) and again when a connector is built (vLLM has configured its logging by then), gives the
``saria`` logger a handler that passes each record on to the ``vllm`` logger's handlers as they
are at that moment (vLLM may configure or reconfigure them after the import), and the ``vllm``
logger's level. Records keep their own name, so a line reads ``... [guard.py:123] saria: ...``.

It stands aside when saria's logging is someone else's business:

* ``VLLM_CONFIGURE_LOGGING=0`` (vLLM does not configure logging: neither does saria);
* the ``saria`` logger already has a handler, or the root logger has one (the application
  configured logging: saria's records propagate there as usual).

With vLLM's logger left without handlers (a custom ``VLLM_LOGGING_CONFIG_PATH`` without one),
warnings go to Python's last-resort handler, as they would without this module.

Whatever handles them, the connector's records (the ``saria.vllm`` logger) pass :class:`Redact`
first: a fault's message comes from anywhere below (the control plane, a store, Mooncake) and may
name an object by its bytes, so every run of 16 or more hex digits and every bytes literal in a
message or a traceback is replaced before any handler sees it (docs/security.md: no block hash,
chunk id, salt or token-derived value in a log line). The handler that passes ``saria`` records to
vLLM's redacts every record it passes (the data plane's loggers too).
"""

from __future__ import annotations

import logging
import os
import re
import traceback

SARIA = "saria"
VLLM = "vllm"
CONNECTOR = "saria.vllm"  # the connector's own logger
_SECRETS = re.compile(r"[0-9a-fA-F]{16,}" r"|(?<!\w)b'(?:[^'\\]|\\.)*'" r'|(?<!\w)b"(?:[^"\\]|\\.)*"')
REDACTED = "<redacted>"


def redact(text: str) -> str:
    """``text`` with every run of 16+ hex digits and every bytes literal replaced by ``<redacted>``."""
    return _SECRETS.sub(REDACTED, text)


class Redact(logging.Filter):
    """Redacts a record's message and traceback in place (module docstring); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format: keep its template only
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def protect(name: str = CONNECTOR) -> None:
    """Put :class:`Redact` on the logger ``name`` (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, Redact) for f in logger.filters):
        logger.addFilter(Redact())


class VllmHandler(logging.Handler):
    """Hands a record to the ``vllm`` logger's handlers (looked up per record), redacted
    (:class:`Redact`): every ``saria`` record it carries, the data plane's included."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(Redact())

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger(VLLM).handlers
        if not handlers:
            last = logging.lastResort
            if last is not None and record.levelno >= last.level:
                last.handle(record)
            return
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _configure_logging_enabled() -> bool:
    return os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip().lower() not in ("0", "false", "no", "off")


def _vllm_level() -> int:
    """The ``vllm`` logger's level, else ``VLLM_LOGGING_LEVEL`` (vLLM's default: INFO)."""
    level = logging.getLogger(VLLM).level
    if level != logging.NOTSET:
        return level
    name = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper()
    value = logging.getLevelName(name)
    return value if isinstance(value, int) else logging.INFO


def route_to_vllm() -> bool:
    """Route the ``saria`` loggers through vLLM's handlers unless logging is configured otherwise
    (module docstring). Idempotent: a second call only refreshes the level. Returns whether
    saria's records now go through vLLM's handlers."""
    protect()
    logger = logging.getLogger(SARIA)
    ours = [h for h in logger.handlers if isinstance(h, VllmHandler)]
    if ours:
        logger.setLevel(_vllm_level())
        return True
    if not _configure_logging_enabled() or logger.handlers or logging.getLogger().handlers:
        return False
    logger.addHandler(VllmHandler())
    logger.setLevel(_vllm_level())
    return True

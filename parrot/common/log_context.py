"""Request and session ids on log records (structured logs), and the text / JSON log formats of the commands.

The ids live in context variables. Each request runs in an asyncio task of its own (the executor's task per DAG
request, the completion service's task per prompt), and a task copies its context when it is created, so
:func:`set_log_context` at the top of such a task labels every record logged inside it (by any module: the
dispatcher, failover, the engine client) and never leaks into the caller's or a sibling's records.

:class:`ContextFilter` copies the ids onto each record (``record.request_id``, ``record.session_id``; ``"-"`` when
unset), so a format may name them; :class:`JsonFormatter` writes one JSON object per line with them.
:func:`configure_logging` installs both on the root handler (``parrot serve`` / ``parrot engine``
``--log-format text|json``, env ``PARROT_LOG_FORMAT``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Literal

UNSET = "-"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(session_id)s %(request_id)s]: %(message)s"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("parrot_request_id", default=None)
_session_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("parrot_session_id", default=None)


def set_log_context(*, request_id: str | None = None, session_id: str | None = None) -> None:
    """Label this task's later log records with ``request_id`` / ``session_id``. Call it at the top of a task that
    serves one request (the setting then stays in that task; see the module docstring)."""
    _request_id.set(request_id)
    _session_id.set(session_id)


def current_log_context() -> dict[str, str | None]:
    return {"request_id": _request_id.get(), "session_id": _session_id.get()}


class ContextFilter(logging.Filter):
    """Adds ``request_id`` and ``session_id`` to every record passing a handler (never filters one out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get() or UNSET
        if getattr(record, "session_id", None) is None:
            record.session_id = _session_id.get() or UNSET
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC ISO 8601), ``level``, ``logger``, ``message``, ``request_id`` and
    ``session_id`` (null when unset), ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        sid = getattr(record, "session_id", None)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, object] = {
            "ts": ts, "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "request_id": None if rid in (None, UNSET) else rid,
            "session_id": None if sid in (None, UNSET) else sid,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: Literal["text", "json"] = "text") -> None:
    """The commands' root logging: one stderr handler with :class:`ContextFilter`, in ``fmt``. Raises ValueError
    naming ``log_format`` for another format."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

"""Logging on stderr for the ``tandem`` commands: ``--log-level`` and ``--log-format text|json``,
and the one line each finished request leaves.

- ``text``: ``TIME LOGGER LEVEL MESSAGE``; ``json``: one JSON object per line for every record,
  ``{"time", "level", "logger", "message"}`` plus the record's ``fields`` (a request's figures)
  and ``exc_info`` as text. The command's own status lines (``tandem: serving ...``) go through
  :func:`status`, so with ``json`` every line on stderr is a JSON object.
- The handler is installed only where the root logger has none (as ``logging.basicConfig``),
  so an embedding program's (or pytest's) logging is left as it is.
- :func:`request_line`: at INFO on ``tandem.requests``, one per request that ended (done or
  error), whichever client sent it; its figures are the ``done`` message's (usage, metrics).
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

requests_log = logging.getLogger("tandem.requests")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": round(record.created, 3), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage(), **getattr(record, "fields", {})}
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str | None = None, fmt: str | None = None) -> None:
    """Set the level and/or the format of the command's stderr handler (installed on first use)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.tandem = True
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
        root.addHandler(handler)
    if fmt is not None:
        for handler in _ours():
            handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    if level is not None:
        root.setLevel(level.upper())


def status(message: str, end: str = "\n") -> None:
    """A command's status line on stderr: plain, or under ``--log-format json`` a JSON record (at any
    level: these lines are the command's output, not logging)."""
    json_handlers = [h for h in _ours() if isinstance(h.formatter, JsonFormatter)]
    if not json_handlers:
        sys.stderr.write(message + end)
        sys.stderr.flush()
        return
    record = logging.LogRecord("tandem", logging.INFO, __file__, 0, message.strip(), None, None)
    for handler in json_handlers:
        handler.handle(record)


def request_line(request_id: str, model: str, usage: dict | None, metrics: dict | None, finish_reason: str | None,
                 error: str | None = None) -> None:
    """The one line a finished request leaves (``error``: its error code; then no finish reason)."""
    if not requests_log.isEnabledFor(logging.INFO):
        return
    usage, metrics = usage or {}, metrics or {}
    fields = {"request_id": request_id, "model": model, "prompt_tokens": usage.get("prompt_tokens"),
              "output_tokens": usage.get("completion_tokens"), "ttft_ms": _round(metrics.get("ttft_ms")),
              "duration_ms": _round(metrics.get("total_ms")), "finish_reason": finish_reason, "error": error}
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k != "request_id")
    requests_log.info("request %s finished: %s", request_id, text, extra={"fields": fields})


def _ours() -> list[logging.Handler]:
    return [h for h in logging.getLogger().handlers if getattr(h, "tandem", False)]


def _round(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 1)


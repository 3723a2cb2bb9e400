"""The GPU worker's log records on its stderr: one JSON object a line, logged again by the frontend.

The worker's stderr is a pipe the frontend reads (``frontend/server/worker_handle.py``). Each
record the worker logs is a line of :class:`Formatter`'s JSON; :func:`decode` turns it back into a
record under the worker's logger name, so the command's ``--log-level`` and ``--log-format`` show
both processes' records alike (the worker's chosen CPU kernels, its weights' formats). A line
that is not such a record (what Python prints as a process dies, a library's own output) decodes
to None: the frontend keeps it as text.
"""
from __future__ import annotations

import json
import logging

FIELDS = ("time", "level", "logger", "message")


class Formatter(logging.Formatter):
    """The worker's side: a record as one JSON line (an exception's traceback inside its message)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return json.dumps(dict(zip(FIELDS, (record.created, record.levelname, record.name, message))))


def decode(line: str) -> logging.LogRecord | None:
    """The frontend's side: the record a :class:`Formatter` line carries, or None for any other line."""
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    if not isinstance(fields, dict) or any(k not in fields for k in FIELDS):
        return None
    created = float(fields["time"])
    level = logging.getLevelName(fields["level"])
    return logging.makeLogRecord({
        "name": str(fields["logger"]), "msg": str(fields["message"]), "created": created,
        "msecs": int((created - int(created)) * 1000) + 0.0, "levelname": fields["level"],
        "levelno": level if isinstance(level, int) else logging.WARNING})

"""The client's errors: one class per protocol error code (PROTOCOL.md, errors)."""
from __future__ import annotations


class TandemError(Exception):
    """An ``error`` from the server (or a client-side failure); see ``.code``.

    ``code`` is one of the protocol's codes (``bad_request``, ``unsupported_version``,
    ``duplicate_id``, ``too_long``, ``context_length_exceeded``, ``overloaded``, ``worker_failed``, ``internal``)
    or, for client-side failures, ``timeout`` / ``closed``.  ``id`` is the
    request id, when there is one.  Each code has a subclass; catch
    ``TandemError`` and check ``.code``, or catch the subclass.
    """

    code = "internal"

    def __init__(self, message: str, code: str | None = None, id: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.id = id

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    @staticmethod
    def from_code(code: object, message: object, id: str | None = None) -> TandemError:
        code = code if isinstance(code, str) else "internal"
        message = message if isinstance(message, str) else repr(message)
        cls = _ERROR_CLASSES.get(code, TandemError)
        return cls(message, code, id)


class BadRequest(TandemError):
    code = "bad_request"


class UnsupportedVersion(TandemError):
    code = "unsupported_version"


class DuplicateId(TandemError):
    code = "duplicate_id"


class TooLong(TandemError):
    code = "too_long"


class ContextLengthExceeded(TooLong):
    """The prompt does not fit the model's context (a kind of too long)."""

    code = "context_length_exceeded"


class Overloaded(TandemError):
    code = "overloaded"


class WorkerFailed(TandemError):
    code = "worker_failed"


class InternalError(TandemError):
    code = "internal"


class RequestTimeout(TandemError, TimeoutError):
    """The call did not finish within its timeout (the request was cancelled)."""

    code = "timeout"


class ConnectionClosed(TandemError):
    """The client was closed while the call was waiting (or before it started)."""

    code = "closed"


_ERROR_CLASSES: dict[str, type[TandemError]] = {
    c.code: c
    for c in (BadRequest, UnsupportedVersion, DuplicateId, TooLong, ContextLengthExceeded, Overloaded, WorkerFailed,
              InternalError)
}

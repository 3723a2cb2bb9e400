"""HTTP errors in OpenAI's shape, and the protocol's error codes mapped to HTTP statuses.

Every error answer, on every route, is ``{"error": {"message", "type", "code"}}``
with the status below (``type`` as OpenAI names its classes of error; ``code``
is the Tandem protocol's error code, or an HTTP-level one such as
``model_not_found`` or ``invalid_api_key``).
"""
from __future__ import annotations

from starlette.responses import JSONResponse

# protocol error code -> (HTTP status, OpenAI error type)
STATUS = {
    "bad_request": (400, "invalid_request_error"),
    "too_long": (413, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),  # OpenAI's status and code for it
    "overloaded": (503, "server_overloaded"),
    "worker_failed": (503, "server_error"),
    "internal": (500, "server_error"),
    "duplicate_id": (500, "server_error"),  # the HTTP frontend's own ids: a bug if it happens
    "unsupported_version": (500, "server_error"),
}


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_

    @classmethod
    def from_protocol(cls, msg: dict) -> "HttpError":
        """From a protocol ``error`` message."""
        status, type_ = STATUS.get(msg.get("code"), (500, "server_error"))
        return cls(status, msg.get("message") or "", msg.get("code") or "internal", type_)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, code: str = "bad_request") -> HttpError:
    return HttpError(400, message, code)

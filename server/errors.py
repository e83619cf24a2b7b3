"""`APIError`: an error the client sees as an OpenAI error body. Its own module so that every server module can
raise it (serving, structured outputs, the app) without importing another for it."""
from __future__ import annotations

from server import protocol as p

__all__ = ["APIError"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the client sees as an OpenAI error body with HTTP `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> p.ErrorResponse:
        fallback = "invalid_request_error" if self.status < 500 else "server_error"
        return p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=_ERROR_TYPES.get(self.status, fallback),
                                                 param=self.param, code=self.code))

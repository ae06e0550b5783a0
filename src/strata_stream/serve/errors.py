"""OpenAI-style API errors: every failure a client sees is `{"error": {message, type, param,
code}}` with the HTTP status OpenAI uses for it, so SDKs raise their usual exception types."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client; raised anywhere in a route, rendered by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_exceeded(message: str, *, param: str = "messages") -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist",
        param="model",
        code="model_not_found",
    )


def queue_full(capacity: int) -> APIError:
    return APIError(
        503,
        f"The server is busy: {capacity} requests are already waiting; retry later",
        type="server_error",
        code="queue_full",
    )


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")

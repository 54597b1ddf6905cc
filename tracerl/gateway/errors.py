"""The gateway's refusals: an HTTP status with OpenAI's error fields."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["GatewayError", "invalid"]


class GatewayError(Exception):
    """A request the gateway refuses, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )


def invalid(e: ValidationError) -> GatewayError:
    """A pydantic validation failure as a 400 naming the first offending field."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return GatewayError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)

"""Errors in the shape each route's clients expect: OpenAI's ``{"error": {"message", "type",
"param", "code"}}``, and Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
the Anthropic routes (``/v1/messages...``), whose SDK reads the type to pick its exception."""

from __future__ import annotations

from starlette.responses import JSONResponse

from engine.client import EngineDead, ShutdownCut

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    408: "BadRequestError",
    413: "BadRequestError",
    415: "BadRequestError",
    421: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# Anthropic's error types by HTTP status (any other 4xx: invalid_request_error, 5xx: api_error)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_OVERLOADED = 529  # Anthropic's status for a refusal by load, where OpenAI's clients get 503
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def anthropic_route(path: str) -> bool:
    """Whether the route at ``path`` (past any root path) answers in Anthropic's shape."""
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


class APIError(Exception):
    """An answer to the client; ``headers`` go on the response (e.g. ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else _TYPES.get(status, "server_error"))
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def anthropic_status(self) -> int:
        return ANTHROPIC_OVERLOADED if self.code == "overloaded" else self.status

    def anthropic_body(self) -> dict:
        fallback = "invalid_request_error" if self.status < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.anthropic_status, fallback)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        if anthropic:
            body, status = self.anthropic_body(), self.anthropic_status
        else:
            body, status = self.body(), self.status
        return JSONResponse(body, status_code=status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


RETRY_AFTER_SECONDS = 1


def overloaded(message: str) -> APIError:
    """503 for a request the engine refused by admission control (queue full, or queued
    too long); ``Retry-After`` tells the client when to try again."""
    return APIError(503, message, code="overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def internal_error(request_id: str, code: str | None = None, what: str = "internal error") -> APIError:
    """A 500 that tells the client only a request id; the details go to the server log under it."""
    return APIError(500, f"{what} (request id {request_id})", code=code)


def engine_unavailable() -> APIError:
    """503 for a request that arrives when no engine core runs."""
    return APIError(503, "the engine is not available", code="engine_dead")


def engine_dead(exc: EngineDead, request_id: str) -> APIError:
    """The answer to a request the engine could not finish: a 500 when its core died, a 503
    when the shutdown's deadline cut it; the request id only, the details in the log."""
    status = 503 if isinstance(exc, ShutdownCut) else 500
    return APIError(status, f"{exc.what} (request id {request_id})", code=exc.code)

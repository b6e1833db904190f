"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx."""

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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

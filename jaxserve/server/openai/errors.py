"""Every refusal as OpenAI's error JSON, {"error": {"message", "type", "param", "code"}}, typed as
vLLM types them (the status's name: BadRequestError, NotFoundError...) with the status as the code.

The engine loop's refusals map as gRPC's do: a bad request (ValueError) is 400 with the reason,
a full queue (Overloaded) 429, a server warming up or draining 503.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jaxserve.server.engine_loop import Draining, Overloaded


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    name = "".join(word.capitalize() for word in HTTPStatus(status).phrase.replace("-", " ").split())
    name = name.removesuffix("Error")  # 500's phrase ends in it already: InternalServerError, not ...ErrorError
    return {"error": {"message": message, "type": f"{name}Error", "param": param, "code": status}}


def authentication_error_body(message: str) -> dict:
    """A 401 as OpenAI answers one (clients and UIs read its type and code, not the status's name)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class ErrorResponse(JSONResponse):
    """JSON escaped to ASCII: a refusal may quote the request (an unknown model's name), and a lone
    surrogate in it cannot be encoded as UTF-8."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return ErrorResponse(error_body(status, message, param), status_code=status)


def api_error(error: Exception) -> APIError:
    """The HTTP status an engine-loop refusal stands for."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, Overloaded):
        return APIError(429, str(error))
    if isinstance(error, Draining):
        return APIError(503, str(error))
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    raise error


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint, named by its field path (e.g. messages.0.content)."""
    details = error.errors()
    if not details:
        return "invalid request", None
    first = details[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def install_error_handlers(app: FastAPI, on_refusal) -> None:
    """on_refusal(status) counts each refusal in the metrics."""

    async def refusal_handler(request: Request, error: Exception) -> JSONResponse:
        if isinstance(error, RequestValidationError):
            on_refusal(400)
            message, param = validation_message(error)
            return error_response(400, message, param)
        if isinstance(error, HTTPException):
            return error_response(error.status_code, str(error.detail))
        refusal = api_error(error)  # registered for APIError only: returns it
        on_refusal(refusal.status)
        return error_response(refusal.status, refusal.message, refusal.param)

    for kind in (APIError, RequestValidationError, HTTPException):
        app.add_exception_handler(kind, refusal_handler)

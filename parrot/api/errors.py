"""The HTTP edge of typed errors: every failure leaves as an OpenAI-style body with its status.

* :class:`ParrotError` -> its ``status_code`` and ``to_body()`` (one handler for the whole hierarchy);
* request validation errors -> 400 ``invalid_request`` naming the offending field in ``param``;
* Starlette HTTP errors (unknown route, wrong method) -> their status, OpenAI-shaped;
* anything else -> 500 ``internal_error``, logged with its traceback (a bug).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.common.errors import ParrotError

logger = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def error_body(message: str, *, error_type: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def parrot_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ParrotError)
    if exc.status_code >= 500:
        logger.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code, exc.code,
                       exc.message)
    return JSONResponse(exc.to_body(), status_code=exc.status_code)


def _loc_name(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or ".".join(str(p) for p in loc)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    details = "; ".join(f"{_loc_name(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in errors[:5])
    param = _loc_name(tuple(errors[0].get("loc", ()))) if errors else None
    body = error_body(f"invalid request: {details}", error_type="invalid_request_error", code="invalid_request",
                      param=param)
    return JSONResponse(body, status_code=400)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), error_type=error_type, code=code),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s crashed", request.method, request.url.path, exc_info=exc)
    body = error_body(f"internal server error ({type(exc).__name__})", error_type="server_error",
                      code="internal_error")
    return JSONResponse(body, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ParrotError, parrot_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)

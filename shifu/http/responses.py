"""JSON answers of shifu's services: every refusal and failure is a JSON body (never an HTML page or a bare
traceback), written by the service's ``render(status, field, message, headers)``: the reward service's
``{"error": {"status", "field", "message"}}`` (:func:`json_error`), the gateway's OpenAI-style error.
:func:`error_handlers` maps a :class:`~shifu.http.requests.RequestError` (a 4xx naming the field), an unknown
path or method (404 ``path`` / 405 ``method``) and any other exception (500, the service's ``failed``
message) onto it, for Starlette's ``exception_handlers``.
"""

from __future__ import annotations

from collections.abc import Callable

from shifu.http.requests import RequestError

Render = Callable[..., object]  # (status, field, message, headers, code) -> a Starlette response


def json_error(
    status: int, field_name: str | None, message: str, headers: dict | None = None, code: str | None = None
):
    """``{"error": {"status", "field", "message"}}`` with HTTP ``status`` (the reward service's errors; it
    has no ``code``)."""
    from starlette.responses import JSONResponse

    body = {"error": {"status": status, "field": field_name, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_handlers(
    render: Render, failed: Callable[[Exception], str], expected: tuple[type[Exception], ...] = ()
) -> dict:
    """Starlette exception handlers answering every error as JSON through ``render``; ``failed(exc)`` is the
    message of a 500 (the service says what failed: a reward function, the sampler). ``expected``: failures
    that are not the server's bug (a user's reward function raised): answered the same, without a traceback
    in the log (any other exception is logged with its traceback by Starlette's server-error middleware)."""
    from starlette.exceptions import HTTPException

    async def on_request_error(request, exc: RequestError):
        return render(exc.status, exc.field, exc.message, exc.headers, exc.code)

    async def on_http_error(request, exc: HTTPException):
        where = {404: "path", 405: "method"}.get(exc.status_code)
        return render(
            exc.status_code, where, f"{request.method} {request.url.path}: {exc.detail}", exc.headers
        )

    async def on_failure(request, exc: Exception):
        return render(500, None, failed(exc), None, None)

    handlers = {RequestError: on_request_error, HTTPException: on_http_error, Exception: on_failure}
    return handlers | {kind: on_failure for kind in expected}

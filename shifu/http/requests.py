"""Requests to shifu's HTTP services, read strictly before anything runs: every refusal is a
:class:`RequestError` (a 4xx, never a 5xx) whose ``field`` names what to fix (``responses[3]``,
``messages[2].content``, ``body``, a header).

Bodies are RFC 8259 JSON in UTF-8 (no ``NaN``/``Infinity``, no number beyond a double, no key twice in one
object, no lone surrogate, at most :data:`MAX_DEPTH` levels; :func:`decode_body`), declared
``application/json`` and not encoded (:func:`check_content_headers`), within the size and time limits
(:func:`read_body`); :func:`check_bearer` checks the bearer token. What a body must hold is each service's
own (:mod:`shifu.serve.validation`, :mod:`shifu.gateway.protocol`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with a message naming the ``field`` to fix; ``code``: a
    short machine-readable kind where the service has one (the gateway's OpenAI-style ``error.code``)."""

    def __init__(
        self,
        status: int,
        field_name: str | None,
        message: str,
        headers: dict | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.field, self.message, self.headers, self.code = (
            status,
            field_name,
            message,
            headers,
            code,
        )


MAX_DEPTH = 64  # nesting levels of objects and arrays in a request body (the body itself is level 1)
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}


def json_type(value) -> str:
    """The JSON name of a decoded value's type (``null``, ``array``, ``object`` ...), for messages."""
    return "null" if value is None else _JSON_TYPES.get(type(value), "object")


class _NotJson:
    """Put by the strict decoder where the body had ``NaN``, ``Infinity``, ``-Infinity`` or a number too
    large for a double; :func:`check_tree` then names its place."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


class _Duplicated(dict):
    """A decoded object whose text named ``key`` twice (RFC 8259 leaves which value counts to the parser)."""

    key = ""


def _number(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NotJson(text)


def _object(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set = set()
    dup = _Duplicated(obj)
    dup.key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return dup


_STRICT = json.JSONDecoder(parse_constant=_NotJson, parse_float=_number, object_pairs_hook=_object)


def field_path(path: str, key: str | int) -> str:
    """``rows[0]`` + ``"answer"`` -> ``rows[0].answer``; indices as ``[i]``; odd keys quoted."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not key.isidentifier():
        return f"{path}[{json.dumps(key)}]"
    return f"{path}.{key}" if path else key


def _too_deep(path: str, max_depth: int) -> RequestError:
    where = path or "body"
    return RequestError(
        400, where, f"{where}: nested deeper than {max_depth} levels of objects and arrays; flatten it"
    )


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = path or "body"
        raise RequestError(
            400,
            where,
            f"{where}: holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}), which is no Unicode "
            "character; send valid UTF-8 text",
        ) from None


def check_tree(value, max_depth: int = MAX_DEPTH) -> None:
    """RequestError (400) naming the place in a decoded body that standard JSON (RFC 8259) does not
    allow or this server does not take: ``NaN`` / ``Infinity`` / a number beyond a double, a key named
    twice in one object, a lone UTF-16 surrogate in a string or key, nesting deeper than ``max_depth``.
    Iterative, so no depth can exhaust the stack."""
    stack = [(value, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        kind = type(node)
        if kind is list:
            if depth > max_depth:
                raise _too_deep(path, max_depth)
            for i, v in enumerate(node):
                if type(v) is not int:  # ids and masks: the bulk of a body, nothing to check
                    stack.append((v, f"{path}[{i}]", depth + 1))
        elif kind is dict or kind is _Duplicated:
            stack += _object_children(node, path, depth, max_depth)
        elif kind is str:
            if not node.isascii():
                _check_text(node, path)
        elif kind is _NotJson:
            where = path or "body"
            raise RequestError(
                400,
                where,
                f"{where}: {node.text} is not a JSON number (RFC 8259 has no NaN or Infinity, and this "
                "server takes numbers that fit a double); send a finite number or null",
            )


def _object_children(node, path: str, depth: int, max_depth: int) -> list[tuple]:
    """:func:`check_tree` of an object at ``path``: a RequestError for too deep a nesting, a key named twice
    (``_Duplicated``) or a lone surrogate in a key; else its values to check, as ``(value, path, depth)``."""
    if depth > max_depth:
        raise _too_deep(path, max_depth)
    if type(node) is _Duplicated:
        where = field_path(path, node.key)
        raise RequestError(
            400,
            where,
            f"{where}: the key {json.dumps(node.key)} appears twice in one object; "
            "send each key once (RFC 8259: the names within an object should be unique)",
        )
    children = []
    for k, v in node.items():
        if not k.isascii():
            _check_text(k, field_path(path, k))
        children.append((v, field_path(path, k), depth + 1))
    return children


def decode_body(raw: bytes):
    """Bytes -> a JSON value, strictly (RFC 8259): a 400 names where the body broke or what it holds that
    JSON does not (:func:`check_tree`)."""
    try:
        value = _STRICT.decode(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(400, "body", f"the body is not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise RequestError(
            400, "body", f"the body is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except RecursionError:
        raise RequestError(400, "body", f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise RequestError(400, "body", f"the body holds a number too long to read ({e})") from None
    check_tree(value)
    return value


def unprocessable(name: str, message: str) -> RequestError:
    """A 422 for the field ``name``: the message starts with it."""
    return RequestError(422, name, f"{name}: {message}")


def check_bearer(header: str | None, token: str | None) -> None:
    """401 unless ``header`` is ``Bearer <token>`` (no check when the server has no token)."""
    if token is None:
        return
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        what = "missing" if not header else "wrong"
        raise RequestError(
            401,
            "Authorization",
            f"Authorization header {what}: send 'Authorization: Bearer <token>' with the server's token",
            {"WWW-Authenticate": "Bearer"},
        )


def check_content_headers(headers) -> None:
    """415 unless the body is declared ``application/json`` (charset, when given, utf-8), unencoded."""
    ctype = headers.get("content-type", "")
    media, *params = (p.strip().lower() for p in ctype.split(";"))
    if media != "application/json":
        raise RequestError(
            415,
            "Content-Type",
            f"Content-Type '{ctype}' is not application/json; send JSON as application/json",
        )
    for p in params:
        name, _, value = p.partition("=")
        if name.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            raise RequestError(
                415, "Content-Type", f"Content-Type '{ctype}': JSON is UTF-8 (RFC 8259); send charset=utf-8"
            )
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RequestError(
            415,
            "Content-Encoding",
            f"Content-Encoding '{encoding}' is not supported; send the body unencoded",
        )


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, refused with 413 past ``max_bytes`` and 408 when it takes over ``timeout_s``."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise RequestError(400, "Content-Length", f"Content-Length '{length}' is not a number")
        if int(length) > max_bytes:
            raise RequestError(
                413,
                "body",
                f"the body has {length} bytes, over this server's limit of {max_bytes} (--max-body-bytes); "
                "send a smaller body",
            )

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestError(
                    413,
                    "body",
                    f"the body is over this server's limit of {max_bytes} bytes (--max-body-bytes)",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(
            408, "body", f"the body did not arrive within {timeout_s:g} s (--body-timeout)"
        ) from None

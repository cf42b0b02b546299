"""Requests to ``shifu serve``, checked before anything is scored: every refusal is a :class:`RequestError`
(a 4xx, never a 5xx) whose ``field`` names what to fix (``responses[3]``, ``input_ids[2][5]``,
``rows[0].answer``, ``body``, a header).

Bodies are read strictly: RFC 8259 JSON in UTF-8 (no ``NaN``/``Infinity``, no number beyond a double, no key
twice in one object, no lone surrogate, at most :data:`MAX_DEPTH` levels; :func:`decode_body`), declared
``application/json`` and not encoded (:func:`check_content_headers`), within the size and time limits
(:func:`read_body`). :func:`parse_score_request` checks the fields of ``/v1/score`` and their types, and the
token ids against the vocabulary; what depends on the model (ids to an encoder, rows longer than its
positions) is checked by :meth:`shifu.serve.served.Served.blocks`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from dataclasses import dataclass

import torch

SCORE_FIELDS = ("prompts", "responses", "rows", "input_ids", "attention_mask")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with a message naming the ``field`` to fix."""

    def __init__(self, status: int, field_name: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field_name, message, headers


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


@dataclass
class ScoreRequest:
    """A validated ``/v1/score`` body: text (``prompts``/``responses``/``rows``) and/or token ids (B, T)."""

    prompts: list[str] | None = None
    responses: list[str] | None = None
    rows: list[dict] | None = None
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.prompts) if self.prompts is not None else self.input_ids.shape[0]


def unprocessable(name: str, message: str) -> RequestError:
    return RequestError(422, name, f"{name}: {message}")


def _str_list(body: dict, name: str) -> list[str]:
    value = body[name]
    if not isinstance(value, list):
        raise unprocessable(name, f"expected an array of strings, got {json_type(value)}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise unprocessable(f"{name}[{i}]", f"expected a string, got {json_type(v)}")
    return value


def _int_matrix(body: dict, name: str, low: int, high: int, what: str) -> list[list[int]]:
    """A rectangular list of non-empty lists of ints in ``low..high - 1`` (bools are not ints here)."""
    value = body[name]
    if not isinstance(value, list):
        raise unprocessable(name, f"expected an array of rows of integers, got {json_type(value)}")
    width = None
    for i, row in enumerate(value):
        if not isinstance(row, list):
            raise unprocessable(f"{name}[{i}]", f"expected an array of integers, got {json_type(row)}")
        if width is None:
            width = len(row)
        if len(row) != width or width == 0:
            raise unprocessable(
                f"{name}[{i}]", f"has {len(row)} ids, row 0 has {width}: pad every row to one width >= 1"
            )
        for j, v in enumerate(row):
            if type(v) is not int:
                raise unprocessable(f"{name}[{i}][{j}]", f"expected an integer, got {json_type(v)}")
            if not low <= v < high:
                raise unprocessable(f"{name}[{i}][{j}]", f"{v} is {what}")
    return value


def parse_score_request(body, vocab_rows: int | None = None) -> ScoreRequest:
    """Validate a decoded ``/v1/score`` body; a :class:`RequestError` (422) names the first bad field.

    Text: ``prompts`` and ``responses`` (arrays of strings, equal lengths), optional ``rows`` (objects,
    one per response; passed to reward functions). Tokens: ``input_ids`` and ``attention_mask``, (B, T)
    arrays of ints, ids in ``0..vocab_rows - 1`` (any int64 when ``vocab_rows`` is None), mask 0/1 with
    at least one 1 per row. A body may hold both (same B). What depends on the model (an encoder takes
    no ids; a row's real tokens fit the positions) is checked by :meth:`Served.blocks`.
    """
    if not isinstance(body, dict):
        raise RequestError(422, "body", f"the body must be a JSON object, got {json_type(body)}")
    unknown = sorted(set(body) - set(SCORE_FIELDS))
    if unknown:
        raise unprocessable(
            field_path("", unknown[0]), f"unknown field; a score request has {', '.join(SCORE_FIELDS)}"
        )
    req = ScoreRequest()
    has_text = "prompts" in body or "responses" in body
    has_tokens = "input_ids" in body or "attention_mask" in body
    if not has_text and not has_tokens:
        raise unprocessable(
            "prompts",
            "missing: give prompts and responses (text) or input_ids and attention_mask (token ids)",
        )
    if has_text:
        _read_text(body, req)
    if "rows" in body:
        _read_rows(body, req, has_text)
    if has_tokens:
        _read_tokens(body, req, vocab_rows, has_text)
    return req


def _read_text(body: dict, req: ScoreRequest) -> None:
    """:func:`parse_score_request`'s ``prompts`` and ``responses`` (equal lengths) into ``req``."""
    for name in ("prompts", "responses"):
        if name not in body:
            raise unprocessable(name, "missing: prompts and responses come together")
    req.prompts, req.responses = _str_list(body, "prompts"), _str_list(body, "responses")
    if len(req.responses) != len(req.prompts):
        raise unprocessable(
            "responses",
            f"has {len(req.responses)} items, prompts has {len(req.prompts)}: one response per prompt",
        )


def _read_rows(body: dict, req: ScoreRequest, has_text: bool) -> None:
    """:func:`parse_score_request`'s ``rows``: one object per prompt, only with text."""
    rows = body["rows"]
    if not has_text:
        raise unprocessable("rows", "rows come with prompts and responses")
    if not isinstance(rows, list) or len(rows) != len(req.prompts):
        got = f"{len(rows)} items" if isinstance(rows, list) else json_type(rows)
        raise unprocessable("rows", f"expected an array of {len(req.prompts)} objects, got {got}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise unprocessable(f"rows[{i}]", f"expected an object, got {json_type(r)}")
    req.rows = rows


def _read_tokens(body: dict, req: ScoreRequest, vocab_rows: int | None, has_text: bool) -> None:
    """:func:`parse_score_request`'s ``input_ids`` and ``attention_mask`` (ids below ``vocab_rows``, 0/1
    mask with a real token per row, one shape; as many rows as prompts with text) into ``req``."""
    for name in ("input_ids", "attention_mask"):
        if name not in body:
            raise unprocessable(name, "missing: input_ids and attention_mask come together")
    if vocab_rows is None:
        high, what = 2**63, "not a token id (ids are integers >= 0)"
    else:
        high = vocab_rows
        what = (
            f"outside the reward model's vocabulary 0..{vocab_rows - 1}; send text when the policy's "
            "tokenizer differs (compare /v1/metadata tokenizer.fingerprint)"
        )
    ids = _int_matrix(body, "input_ids", 0, high, what)
    mask = _int_matrix(body, "attention_mask", 0, 2, "not 0 (padding) or 1 (a real token)")
    if len(mask) != len(ids) or (ids and len(mask[0]) != len(ids[0])):
        shape = f"({len(mask)}, {len(mask[0]) if mask else 0})"
        raise unprocessable(
            "attention_mask",
            f"shape {shape} differs from input_ids ({len(ids)}, {len(ids[0]) if ids else 0})",
        )
    for i, row in enumerate(mask):
        if not any(row):
            raise unprocessable(f"attention_mask[{i}]", "no real token (every value is 0)")
    width = len(ids[0]) if ids else 0
    req.input_ids = torch.tensor(ids, dtype=torch.long).reshape(len(ids), width)
    req.attention_mask = torch.tensor(mask, dtype=torch.long).reshape(len(ids), width)
    if has_text and len(req.prompts) != len(ids):
        raise unprocessable("input_ids", f"has {len(ids)} rows, prompts has {len(req.prompts)}")


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
                "send fewer rows per request",
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

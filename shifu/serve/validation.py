"""``/v1/score`` requests of ``shifu serve``, checked before anything is scored: :func:`parse_score_request`
checks the fields and their types, and the token ids against the vocabulary; what depends on the model (ids
to an encoder, rows longer than its positions) is checked by :meth:`shifu.serve.served.Served.blocks`. Bodies
are read strictly by the shared stack (:mod:`shifu.http.requests`): every refusal is a
:class:`~shifu.http.requests.RequestError` (a 4xx, never a 5xx) naming the field to fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shifu.http.requests import RequestError, field_path, json_type, unprocessable

SCORE_FIELDS = ("prompts", "responses", "rows", "input_ids", "attention_mask")


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

"""``shifu serve SOURCE``: a reward model, an ensemble or a rule reward over HTTP (Starlette on uvicorn).

SOURCE is what ``shifu ppo`` takes in process: a reward model directory (one ``shifu rm`` model, an
ensemble directory, or a run directory with ``final/``; loaded by :func:`shifu.rewards.ensemble.load_reward`) or
a rule reward ``package.module:function`` (:func:`shifu.rewards.sources.load_function`). Endpoints, all JSON
(schemas in docs/how-to/reward-service.md):

    GET  /health        {"status": "ok", "kind", "requests", "forwards", "rows", "pending"}  (no token)
    GET  /v1/metadata   kind, source, tokenizer fingerprint, normalisation, ensemble, limits, version
    POST /v1/score      {"prompts", "responses", "rows"?} or {"input_ids", "attention_mask"}
                        -> {"scores": [...]}; from a process reward {"scores", "steps": [[[end, r], ...], ...]}
                        (shifu's steps format) or {"token_scores": [[...], ...]} (one value per element)

**Batching.** One asyncio task (:class:`Batcher`) runs the scoring on one thread, one forward at a time,
while the event loop keeps accepting requests; the requests that arrived during a forward are merged
into the next one, right-padded to one width, up to ``--max-batch-tokens`` (rows x width). Merged scores
equal in-process :class:`shifu.rewards.sources.RewardSource` scores up to float32 summation order (a row's
result depends on its place in the batch in the last bit; tests/test_serve.py bounds the difference by
1e-5 relative). ``--exact`` scores each request in its own forward exactly as sent: a client sending one
of the trainer's micro-batches per request (text is padded per request, as ``score_texts`` pads per
micro-batch) then gets the in-process scores bit for bit. Reward functions are called once per request,
in arrival order, on the same thread.

**Safety.** Binds 127.0.0.1 by default; any other address needs a bearer token (``--token`` or
``SHIFU_SERVE_TOKEN``). Bodies are capped (``--max-body-bytes``, 413) and must arrive within
``--body-timeout`` seconds (408), so a slow client holds one connection, never the server. Every refused
request gets a JSON error ``{"error": {"status", "field", "message"}}`` naming what to fix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shifu.errors import ConfigError, ShifuError
from shifu.rewards.remote import TOKEN_ENV, tokenizer_fingerprint

API_VERSION = 1
MAX_LENGTH = 512  # tokens of a text pair, the in-process default of ScalarModel.encode / score_texts
SCORE_FIELDS = ("prompts", "responses", "rows", "input_ids", "attention_mask")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with a message naming the ``field`` to fix."""

    def __init__(self, status: int, field_name: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field_name, message, headers


class ScoringError(Exception):
    """The served reward failed on a valid request (a reward function raised, returned the wrong count)."""


# ----------------------------------------------------------------------------- request validation
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


def _unprocessable(name: str, message: str) -> RequestError:
    return RequestError(422, name, f"{name}: {message}")


def _str_list(body: dict, name: str) -> list[str]:
    value = body[name]
    if not isinstance(value, list):
        raise _unprocessable(name, f"expected a list of strings, got {type(value).__name__}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise _unprocessable(f"{name}[{i}]", f"expected a string, got {type(v).__name__}")
    return value


def _int_matrix(body: dict, name: str) -> list[list[int]]:
    """A rectangular non-empty list of lists of ints (bools are not ints here)."""
    value = body[name]
    if not isinstance(value, list):
        raise _unprocessable(name, f"expected a list of rows of integers, got {type(value).__name__}")
    width = None
    for i, row in enumerate(value):
        if not isinstance(row, list):
            raise _unprocessable(f"{name}[{i}]", f"expected a list of integers, got {type(row).__name__}")
        if width is None:
            width = len(row)
        if len(row) != width or width == 0:
            raise _unprocessable(
                f"{name}[{i}]", f"has {len(row)} ids, row 0 has {width}: pad every row to one width >= 1"
            )
        for j, v in enumerate(row):
            if type(v) is not int:
                raise _unprocessable(f"{name}[{i}][{j}]", f"expected an integer, got {type(v).__name__}")
    return value


def parse_score_request(body) -> ScoreRequest:
    """Validate a decoded ``/v1/score`` body; a :class:`RequestError` (422) names the first bad field.

    Text: ``prompts`` and ``responses`` (lists of strings, equal lengths), optional ``rows`` (objects,
    one per response; passed to reward functions). Tokens: ``input_ids`` and ``attention_mask``, (B, T)
    lists of ints, mask 0/1 with at least one 1 per row. A body may hold both (same B).
    """
    if not isinstance(body, dict):
        raise RequestError(422, None, f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(SCORE_FIELDS))
    if unknown:
        raise _unprocessable(unknown[0], f"unknown field; a score request has {', '.join(SCORE_FIELDS)}")
    req = ScoreRequest()
    has_text = "prompts" in body or "responses" in body
    has_tokens = "input_ids" in body or "attention_mask" in body
    if not has_text and not has_tokens:
        raise _unprocessable(
            "prompts",
            "missing: give prompts and responses (text) or input_ids and attention_mask (token ids)",
        )
    if has_text:
        for name in ("prompts", "responses"):
            if name not in body:
                raise _unprocessable(name, "missing: prompts and responses come together")
        req.prompts, req.responses = _str_list(body, "prompts"), _str_list(body, "responses")
        if len(req.responses) != len(req.prompts):
            raise _unprocessable(
                "responses",
                f"has {len(req.responses)} items, prompts has {len(req.prompts)}: one response per prompt",
            )
    if "rows" in body:
        rows = body["rows"]
        if not has_text:
            raise _unprocessable("rows", "rows come with prompts and responses")
        if not isinstance(rows, list) or len(rows) != len(req.prompts):
            got = f"{len(rows)} items" if isinstance(rows, list) else type(rows).__name__
            raise _unprocessable("rows", f"expected a list of {len(req.prompts)} objects, got {got}")
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise _unprocessable(f"rows[{i}]", f"expected an object, got {type(r).__name__}")
        req.rows = rows
    if has_tokens:
        for name in ("input_ids", "attention_mask"):
            if name not in body:
                raise _unprocessable(name, "missing: input_ids and attention_mask come together")
        ids, mask = _int_matrix(body, "input_ids"), _int_matrix(body, "attention_mask")
        if len(mask) != len(ids) or (ids and len(mask[0]) != len(ids[0])):
            shape = f"({len(mask)}, {len(mask[0]) if mask else 0})"
            raise _unprocessable(
                "attention_mask",
                f"shape {shape} differs from input_ids ({len(ids)}, {len(ids[0]) if ids else 0})",
            )
        for i, row in enumerate(mask):
            if any(v not in (0, 1) for v in row):
                raise _unprocessable(f"attention_mask[{i}]", "values must be 0 (padding) or 1 (real token)")
            if not any(row):
                raise _unprocessable(f"attention_mask[{i}]", "no real token (every value is 0)")
        req.input_ids = torch.tensor(ids, dtype=torch.long).reshape(len(ids), -1)
        req.attention_mask = torch.tensor(mask, dtype=torch.long).reshape(len(ids), -1)
        if has_text and len(req.prompts) != len(ids):
            raise _unprocessable("input_ids", f"has {len(ids)} rows, prompts has {len(req.prompts)}")
    return req


def decode_body(raw: bytes):
    """Bytes -> JSON value; a 400 says where the JSON broke."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise RequestError(400, "body", f"the body is not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise RequestError(
            400, "body", f"the body is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except RecursionError:
        raise RequestError(400, "body", "the body's JSON is nested too deeply") from None


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


# ------------------------------------------------------------------------------------ what is served
def _tokenizer_meta(tok) -> dict | None:
    if tok is None:
        return None
    return {
        "name": str(getattr(tok, "name_or_path", "") or ""),
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "fingerprint": tokenizer_fingerprint(tok),
    }


def _members(model) -> list:
    return list(model.members) if hasattr(model, "members") else [model]


def shares_one_tokenizer(model) -> bool:
    """True when every member of an ensemble tokenises text the same way (then text is encoded once)."""
    from shifu.rewards.sources import same_tokenizer

    members = _members(model)
    first = members[0]
    return all(
        same_tokenizer(m.tokenizer, first.tokenizer) and m.is_causal == first.is_causal for m in members
    )


def _is_steps(x) -> bool:
    """A response's process reward in shifu's steps format: ``[[end, reward], ...]`` (possibly empty)."""
    return isinstance(x, (list, tuple)) and all(isinstance(s, (list, tuple)) for s in x)


def function_scores(out, n: int) -> dict[str, list]:
    """A reward function's return value -> the answer: ``{"scores"}`` for one number per response;
    ``{"scores", "steps"}`` when some responses get shifu's process-reward steps ``[[end, reward], ...]``
    (:mod:`shifu.rewards.sources`; the others a number, their steps empty, a stepped response's score 0);
    ``{"token_scores"}`` for one list of numbers per response. ScoringError when it is none of these."""
    try:
        items = list(out)
    except TypeError:
        raise ScoringError(
            f"reward function returned a {type(out).__name__}, expected a list of {n}"
        ) from None
    if len(items) != n:
        raise ScoringError(f"reward function returned {len(items)} scores for {n} responses")
    try:
        if any(isinstance(x, (list, tuple)) and x and _is_steps(x) for x in items):
            steps = [
                [[int(e), float(r)] for e, r in x] if isinstance(x, (list, tuple)) else [] for x in items
            ]
            scores = [0.0 if isinstance(x, (list, tuple)) else float(x) for x in items]
            return {"scores": scores, "steps": steps}
        if items and all(isinstance(x, (list, tuple)) for x in items):
            return {"token_scores": [[float(v) for v in x] for x in items]}
        return {"scores": [float(x) for x in items]}
    except (TypeError, ValueError) as e:
        raise ScoringError(f"reward function returned something that is not a number ({e})") from None


@dataclass
class Served:
    """What one server scores: a reward ``model`` (ScalarModel / RewardEnsemble) or a ``function``."""

    source: str
    model: object | None = None
    function: Callable | None = None
    device: str = "cpu"
    one_tokenizer: bool = True
    vocab_rows: int = 0  # ids must be < this: rows of the input embedding

    @property
    def pad_id(self) -> int:
        """The id that pads merged batches (any id works under mask 0; the tokenizer's pad for tidiness)."""
        tok = getattr(self.model, "tokenizer", None)
        return int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0

    @property
    def kind(self) -> str:
        if self.function is not None:
            return "function"
        return "ensemble" if hasattr(self.model, "members") else "model"

    def metadata(self) -> dict:
        """The ``/v1/metadata`` description (without the server's limits)."""
        from shifu import __version__

        meta = {"api": API_VERSION, "shifu_version": __version__, "kind": self.kind, "source": self.source}
        if self.function is not None:
            return meta | {"is_causal": False, "accepts": ["text"], "tokenizer": None, "normalisation": None}
        members = _members(self.model)
        norm = [{"gain": float(m.gain), "bias": float(m.bias)} for m in members]
        meta |= {
            "is_causal": bool(self.model.is_causal),
            "accepts": ["text", "tokens"] if self.model.is_causal else ["text"],
            "tokenizer": _tokenizer_meta(self.model.tokenizer),
            "normalisation": norm[0] if self.kind == "model" else norm,
            "max_length": MAX_LENGTH,
        }
        if self.kind == "ensemble":
            meta["ensemble"] = {
                "members": len(members),
                "aggregate": self.model.how,
                "std_coef": float(self.model.std_coef),
                "one_tokenizer": self.one_tokenizer,
            }
        return meta

    @torch.no_grad()
    def score_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) float32 CPU scores of (B, T) ids, as ``RewardSource``'s token path computes them."""
        return self.model.score(input_ids.to(self.device), attention_mask.to(self.device)).float().cpu()

    def blocks(self, req: ScoreRequest) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The request as (ids, mask) blocks for the batcher, or None when it must be a single call."""
        if self.function is not None:
            if req.prompts is None:
                raise RequestError(
                    422,
                    "prompts",
                    "prompts: missing: a reward function scores text; send prompts and responses",
                )
            return None
        if req.input_ids is not None:
            if not self.model.is_causal:
                raise _unprocessable(
                    "input_ids",
                    "this reward model is an encoder with its own tokenizer; send prompts and responses",
                )
            bad = (req.input_ids < 0) | (req.input_ids >= self.vocab_rows)
            if bad.any():
                i, j = (int(x) for x in bad.nonzero()[0])
                raise _unprocessable(
                    f"input_ids[{i}][{j}]",
                    f"id {int(req.input_ids[i, j])} is outside the reward model's vocabulary "
                    f"0..{self.vocab_rows - 1}; send text when the policy's tokenizer differs "
                    "(compare /v1/metadata tokenizer.fingerprint)",
                )
            return [(req.input_ids, req.attention_mask)]
        if not self.one_tokenizer:
            return None
        if req.size == 0:
            return []
        enc = self.model.encode(self.prompts(req), req.responses, self.model.text_length(MAX_LENGTH))
        return [(enc["input_ids"], enc["attention_mask"])]

    def prompts(self, req: ScoreRequest) -> list[str]:
        """The prompts as a causal reward model saw them in training: a user message through its chat
        template, when its tokenizer has one (:func:`shifu.data.rows.prompt_text`)."""
        if not getattr(self.model, "is_causal", False):
            return req.prompts
        from shifu.data.rows import prompt_text

        return [prompt_text(self.model.tokenizer, {"prompt": p}) for p in req.prompts]

    @torch.no_grad()
    def call(self, req: ScoreRequest) -> tuple[list[float] | None, list[list[float]] | None]:
        """Score a request in one call: a reward function, or an ensemble whose members' tokenizers differ."""
        if self.function is None:
            return {"scores": self.model.score_texts(
                self.prompts(req), req.responses, max(1, req.size), MAX_LENGTH
            ).tolist()}  # fmt: skip
        rows = req.rows if req.rows is not None else [{} for _ in req.prompts]
        try:
            out = self.function(req.prompts, req.responses, rows)
        except Exception as e:  # a user's function: say whose fault it is
            raise ScoringError(f"reward function raised {type(e).__name__}: {e}") from e
        return function_scores(out, req.size)


def load_served(
    source: str, device: str = "cpu", aggregate: str | None = None, std_coef: float | None = None
) -> Served:
    """A reward model / ensemble / run directory, or ``package.module:function`` (errors say which)."""
    if Path(source).is_dir():
        from shifu.models.loading import fuse_tanh_gelu
        from shifu.rewards.ensemble import load_reward

        # the kernels a trainer scores with in process (one fused tanh-GELU): the same scores, bit for bit
        model = fuse_tanh_gelu(load_reward(source, aggregate, std_coef)).to(device).eval()
        first = _members(model)[0]
        rows = first.backbone.get_input_embeddings().num_embeddings
        return Served(
            source, model=model, device=device, one_tokenizer=shares_one_tokenizer(model), vocab_rows=rows
        )
    if ":" in source and not Path(source).exists():
        from shifu.rewards.sources import load_function

        return Served(source, function=load_function(source))
    raise ConfigError(
        f"'{source}' is neither a reward model directory nor a reward function: give a `shifu rm` output "
        "directory (a model, an ensemble, or a run with final/) or 'package.module:function'"
    )


# ------------------------------------------------------------------------------------------ batching
def split_rows(
    ids: torch.Tensor, mask: torch.Tensor, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a (B, T) block into pieces of at most ``max_tokens`` = rows x T (at least one row each)."""
    step = max(1, max_tokens // ids.shape[1])
    return [(ids[i : i + step], mask[i : i + step]) for i in range(0, ids.shape[0], step)]


def stack_blocks(
    blocks: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_i, T_i) blocks -> one (sum n_i, max T_i) batch, narrower blocks right-padded (mask 0).

    Right padding leaves every real position's value unchanged in exact arithmetic (position ids and the
    scored last token come from the mask; causal attention never looks right, and encoders mask padded
    keys), but not in float32: the scores of a merged forward can differ from the same rows scored alone
    by a few units in the last place.
    """
    width = max(ids.shape[1] for ids, _ in blocks)
    out_ids = torch.full((sum(ids.shape[0] for ids, _ in blocks), width), pad_id, dtype=torch.long)
    out_mask = torch.zeros_like(out_ids)
    row = 0
    for ids, mask in blocks:
        n, t = ids.shape
        out_ids[row : row + n, :t], out_mask[row : row + n, :t] = ids, mask
        row += n
    return out_ids, out_mask


@dataclass
class _Job:
    future: asyncio.Future
    block: tuple[torch.Tensor, torch.Tensor] | None = None  # a (n, T) block, merged with others
    call: Callable | None = None  # run alone (reward functions, ensembles of several tokenizers)


@dataclass
class Batcher:
    """The batching queue: one asyncio task takes pending jobs and runs them on ``executor`` (one thread:
    one forward at a time, in arrival order).

    ``merge=True``: the blocks pending when a forward ends go into the next forward together, right-padded
    to one width (:func:`stack_blocks`), up to ``max_batch_tokens`` = rows x width; a larger request is cut
    into pieces of that size. ``merge=False`` (``--exact``): each request is one forward exactly as sent,
    so its scores equal in-process scores of the same micro-batch bit for bit.
    """

    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    max_batch_tokens: int
    executor: ThreadPoolExecutor
    merge: bool = True
    pad_id: int = 0
    stats: dict = field(default_factory=lambda: {"requests": 0, "forwards": 0, "rows": 0})

    def __post_init__(self):
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._held: _Job | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def score_blocks(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(sum n_i,) float32 scores of a request's (n_i, T_i) blocks, once the batcher has run them."""
        loop = asyncio.get_running_loop()
        if self.merge:
            blocks = [piece for ids, mask in blocks for piece in split_rows(ids, mask, self.max_batch_tokens)]
        jobs = [_Job(loop.create_future(), block=b) for b in blocks]
        for job in jobs:
            self.queue.put_nowait(job)
        self.stats["requests"] += 1
        parts = [await job.future for job in jobs]
        return torch.cat(parts) if parts else torch.zeros(0)

    async def run_alone(self, fn: Callable):
        """``fn()`` on the scoring thread, between two forwards."""
        job = _Job(asyncio.get_running_loop().create_future(), call=fn)
        self.queue.put_nowait(job)
        self.stats["requests"] += 1
        return await job.future

    def pending(self) -> int:
        return self.queue.qsize() + (self._held is not None)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _forward(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """On the scoring thread: one forward over the blocks, split back into each block's scores."""
        ids, mask = blocks[0] if len(blocks) == 1 else stack_blocks(blocks, self.pad_id)
        return list(self.score(ids, mask).split([b[0].shape[0] for b in blocks]))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = self._held or await self.queue.get()
            self._held = None
            if job.call is not None:
                await self._settle([job], loop.run_in_executor(self.executor, job.call), forward=False)
                continue
            batch, rows, width = [job], job.block[0].shape[0], job.block[0].shape[1]
            while self.merge and not self.queue.empty():  # what arrived during the last forward
                nxt = self.queue.get_nowait()
                if nxt.call is not None:
                    self._held = nxt
                    break
                n, t = nxt.block[0].shape
                if (rows + n) * max(width, t) > self.max_batch_tokens:
                    self._held = nxt
                    break
                batch.append(nxt)
                rows, width = rows + n, max(width, t)
            await self._settle(
                batch, loop.run_in_executor(self.executor, self._forward, [j.block for j in batch])
            )

    async def _settle(self, jobs: list[_Job], work: asyncio.Future, forward: bool = True) -> None:
        """Await the scoring thread's ``work`` and hand each job its part (or the exception)."""
        try:
            result = await work
        except Exception as e:  # a failed forward or function fails the requests in it, not the server
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(e)
            return
        parts = result if forward else [result]
        if forward:
            self.stats["forwards"] += 1
            self.stats["rows"] += sum(int(p.shape[0]) for p in parts)
        for j, part in zip(jobs, parts):
            if not j.future.done():  # a client that went away leaves a cancelled future
                j.future.set_result(part)


# ------------------------------------------------------------------------------------------- the app
def _json_error(status: int, field_name: str | None, message: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    body = {"error": {"status": status, "field": field_name, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _finite(values: list[float]) -> list[float | None]:
    """Non-finite scores as JSON null (standard JSON has no NaN; the client reads null as NaN)."""
    return [v if math.isfinite(v) else None for v in values]


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


def create_app(
    served: Served,
    token: str | None = None,
    max_batch_tokens: int = 16384,
    max_body_bytes: int = 16 * 2**20,
    body_timeout_s: float = 30.0,
    exact: bool = False,
):
    """The Starlette app serving ``served`` (see the module docstring); run it with uvicorn."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    limits = {
        "max_batch_tokens": max_batch_tokens,
        "max_body_bytes": max_body_bytes,
        "body_timeout_s": body_timeout_s,
        "exact": exact,
    }
    metadata = served.metadata() | {"limits": limits}
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        executor = ThreadPoolExecutor(1, thread_name_prefix="shifu-score")
        # one tokenising thread: HF fast tokenizers are not safe to call from several threads at once
        # (their padding/truncation settings are shared state), and it overlaps with the forwards
        state["encoder"] = ThreadPoolExecutor(1, thread_name_prefix="shifu-encode")
        score = served.score_ids if served.model is not None else None
        state["batcher"] = Batcher(score, max_batch_tokens, executor, merge=not exact, pad_id=served.pad_id)
        try:
            yield
        finally:
            await state["batcher"].close()
            executor.shutdown(wait=True)
            state["encoder"].shutdown(wait=True)

    async def health(request):
        b = state["batcher"]
        return JSONResponse({"status": "ok", "kind": served.kind, "pending": b.pending(), **b.stats})

    async def meta(request):
        check_bearer(request.headers.get("authorization"), token)
        return JSONResponse(metadata)

    async def score(request):
        check_bearer(request.headers.get("authorization"), token)
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise RequestError(415, "Content-Type", f"Content-Type '{ctype}' is not application/json")
        raw = await read_body(request, max_body_bytes, body_timeout_s)
        req = await run_in_threadpool(lambda: parse_score_request(decode_body(raw)))
        blocks = await asyncio.get_running_loop().run_in_executor(state["encoder"], served.blocks, req)
        b = state["batcher"]
        if blocks is None:
            answer = await b.run_alone(lambda: served.call(req))
            if "token_scores" in answer:
                return JSONResponse({"token_scores": [_finite(r) for r in answer["token_scores"]]})
            if "steps" in answer:  # each step's reward as its score is sent: null when not finite
                steps = [[[e, _finite([r])[0]] for e, r in row] for row in answer["steps"]]
                return JSONResponse({"scores": _finite(answer["scores"]), "steps": steps})
            return JSONResponse({"scores": _finite(answer["scores"])})
        return JSONResponse({"scores": _finite((await b.score_blocks(blocks)).tolist())})

    async def on_request_error(request, exc: RequestError):
        return _json_error(exc.status, exc.field, exc.message, exc.headers)

    async def on_http_error(request, exc: HTTPException):
        return _json_error(
            exc.status_code, None, f"{request.method} {request.url.path}: {exc.detail}", exc.headers
        )

    async def on_scoring_error(request, exc: ScoringError):
        return _json_error(500, None, f"{served.source}: {exc}")

    async def on_unexpected(request, exc: Exception):
        return _json_error(500, None, f"{served.source}: scoring failed ({type(exc).__name__}: {exc})")

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/metadata", meta, methods=["GET"]),
            Route("/v1/score", score, methods=["POST"]),
        ],
        exception_handlers={
            RequestError: on_request_error,
            HTTPException: on_http_error,
            ScoringError: on_scoring_error,
            Exception: on_unexpected,
        },
        lifespan=lifespan,
    )


# ------------------------------------------------------------------------------------------- the CLI
def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1 literals (anything else may be reachable from outside)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); connections queue from here on."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ShifuError(f"cannot listen on {host}:{port} ({e}); choose another --port or --host") from None
    sock.listen(512)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shifu serve",
        description="serve a reward model, an ensemble or a rule reward over HTTP "
        "(docs/how-to/reward-service.md)",
    )
    p.add_argument(
        "source",
        metavar="RM_DIR|module:function",
        help="reward model/ensemble/run directory, or a rule reward",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback; others need a token)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    p.add_argument(
        "--token",
        default=None,
        help=f"bearer token clients must send (default: ${TOKEN_ENV}; none: no check)",
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="rows x padded width merged into one forward"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=16 * 2**20, help="largest request body accepted (413 above)"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive (408)"
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="one forward per request as sent (no merging): scores equal in-process ones bit for bit",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device of the reward model (cpu, cuda, cuda:1, ...)"
    )
    p.add_argument(
        "--aggregate",
        default=None,
        help="override an ensemble's aggregation: mean, median, min, mean_minus_std",
    )
    p.add_argument(
        "--std-coef", type=float, default=None, help="override an ensemble's std_coef (mean_minus_std)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: SHIFU_THREADS or torch's)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--access-log", action="store_true", help="log every request (off: it costs time under load)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.token if args.token is not None else (os.environ.get(TOKEN_ENV) or None)
    if not is_loopback(args.host) and not token:
        raise ConfigError(
            f"--host {args.host} is not a loopback address: anyone who reaches it could use the reward "
            f"model. Give --token (or ${TOKEN_ENV}), or bind 127.0.0.1"
        )
    for name in ("max_batch_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.body_timeout <= 0 or not 0 <= args.port < 65536:
        raise ConfigError(
            f"need --body-timeout > 0 and 0 <= --port < 65536; got {args.body_timeout}, {args.port}"
        )
    try:
        import uvicorn
    except ImportError:
        raise ShifuError(
            "shifu serve needs its extra: pip install 'shifu-rlhf[serve]' (starlette, uvicorn)"
        ) from None
    from shifu.parallel.threads import set_threads

    set_threads(args.threads)
    served = load_served(args.source, args.device, args.aggregate, args.std_coef)
    app = create_app(served, token, args.max_batch_tokens, args.max_body_bytes, args.body_timeout, args.exact)
    sock = bind_socket(args.host, args.port)
    print(
        f"shifu serve: {served.kind} {served.source} on {socket_url(sock)} "
        f"(token {'required' if token else 'off'}; stop with Ctrl-C)",
        flush=True,
    )
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
    return 0

"""The Starlette app of ``shifu serve`` (:func:`create_app`): routes, the batcher's lifespan, the JSON errors,
and the API published as an OpenAPI 3.1 document (``openapi.json`` beside this module, written by hand;
``GET /openapi.json`` serves it with the served model's limits filled in, :func:`openapi_document`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shifu.errors import UserCodeError, verbose
from shifu.http.requests import check_bearer, check_content_headers, decode_body, read_body
from shifu.http.responses import error_handlers, json_error
from shifu.serve.batcher import Batcher
from shifu.serve.served import ScoringError, Served
from shifu.serve.validation import parse_score_request

OPENAPI_FILE = Path(__file__).with_name("openapi.json")


def openapi_document(served: Served | None = None, limits: dict | None = None) -> dict:
    """The API as an OpenAPI 3.1 document (``shifu/serve/openapi.json``, written by hand), with what
    ``served`` takes filled in: the largest token id, the positions of a row, the server's limits."""
    from shifu import __version__

    doc = json.loads(OPENAPI_FILE.read_text(encoding="utf-8"))
    doc["info"]["x-shifu-version"] = __version__
    if served is None:
        return doc
    live: dict = {"kind": served.kind, "limits": limits or {}}
    if served.model is not None:
        ids = doc["components"]["schemas"]["TokenIds"]
        ids["items"]["items"]["maximum"] = served.vocab_rows - 1
        ids["description"] += (
            f" This server: ids 0..{served.vocab_rows - 1}, at most {served.positions} real tokens a row."
            if served.positions is not None
            else f" This server: ids 0..{served.vocab_rows - 1}."
        )
        live |= {"vocab_rows": served.vocab_rows, "max_positions": served.positions}
    doc["info"]["x-shifu-served"] = live
    return doc


def _finite(values: list[float]) -> list[float | None]:
    """Non-finite scores as JSON null (standard JSON has no NaN; the client reads null as NaN)."""
    return [v if math.isfinite(v) else None for v in values]


def _print_scoring_error(exc: ScoringError) -> None:
    """A failed request on the server's console too (a reward function's name and file:line, as the client
    gets it), with the user's traceback under ``--verbose``."""
    if verbose() and exc.__cause__ is not None:
        traceback.print_exception(exc)
    print(f"shifu serve: request failed: {exc}", file=sys.stderr, flush=True)


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
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    limits = {
        "max_batch_tokens": max_batch_tokens,
        "max_body_bytes": max_body_bytes,
        "body_timeout_s": body_timeout_s,
        "exact": exact,
    }
    metadata = served.metadata() | {"limits": limits}
    document = openapi_document(served, limits)
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

    async def openapi(request):
        return JSONResponse(document)

    async def score(request):
        check_bearer(request.headers.get("authorization"), token)
        check_content_headers(request.headers)
        raw = await read_body(request, max_body_bytes, body_timeout_s)
        ids_below = served.vocab_rows if served.model is not None else None
        req = await run_in_threadpool(lambda: parse_score_request(decode_body(raw), ids_below))
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

    def failed(exc: Exception) -> str:
        if isinstance(exc, ScoringError):
            _print_scoring_error(exc)
            user = isinstance(exc.__cause__, UserCodeError)  # (its message names the function already)
            return str(exc) if user else f"{served.source}: {exc}"
        return f"{served.source}: scoring failed ({type(exc).__name__}: {exc})"

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/metadata", meta, methods=["GET"]),
            Route("/v1/score", score, methods=["POST"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        exception_handlers=error_handlers(json_error, failed, expected=(ScoringError,)),
        lifespan=lifespan,
    )

"""The gateway's Starlette app: the OpenAI-compatible routes, the recording routes, errors in OpenAI's shape.

    GET  /health               {"status": "ok", "model", "recording", "policy_version", "pending", ...}  (no token)
    GET  /openapi.json         the API (``openapi.json`` beside this module, the served model filled in)  (no token)
    GET  /v1/models            the one served model
    POST /v1/chat/completions  a chat completion (:mod:`shifu.gateway.protocol`, :mod:`shifu.gateway.completions`)
    POST /rl/start_session     recording only: a new session's key (the server's token, when it has one)
    POST /rl/set_reward        recording only: {"reward", "call"?} for the session of the key sent
    POST /rl/end_session       recording only: close the session of the key sent; its summary

Every error is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; ``param`` names the field
to fix). Bodies are read by the shared stack (:mod:`shifu.http.requests`). Prompts are rendered and answers
decoded on one tokenizer thread; sampling runs on one sampler thread (:class:`shifu.http.batching.BatchQueue`
merging concurrent completions into one sampler call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shifu.gateway.completions import answer, check_model, make_job, prompt_ids
from shifu.gateway.protocol import bad, parse_chat_request
from shifu.gateway.sessions import Call, UnknownSession
from shifu.http.requests import RequestError, check_bearer, check_content_headers, decode_body, read_body
from shifu.http.responses import error_handlers

OPENAPI_FILE = Path(__file__).with_name("openapi.json")
_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}


def openai_error(status: int, field_name, message: str, headers: dict | None = None, code: str | None = None):
    from starlette.responses import JSONResponse

    kind = _TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": field_name, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def openapi_document(gateway=None) -> dict:
    """The API as an OpenAPI 3.1 document (``shifu/gateway/openapi.json``, written by hand); with a gateway,
    its model name and limits filled in."""
    from shifu import __version__

    doc = json.loads(OPENAPI_FILE.read_text(encoding="utf-8"))
    doc["info"]["x-shifu-version"] = __version__
    if gateway is not None:
        doc["components"]["schemas"]["ChatRequest"]["properties"]["model"]["enum"] = [gateway.name]
        if not gateway.recording:  # the /rl routes exist on a recording gateway only
            doc["paths"] = {p: v for p, v in doc["paths"].items() if not p.startswith("/rl/")}
        doc["info"]["x-shifu-served"] = {
            "model": gateway.name,
            "recording": gateway.recording,
            "max_positions": gateway.engine.positions,
            "max_tokens": gateway.sampling.max_tokens,
            "tools": "native" if gateway.format.native else "hermes system message",
        }
    return doc


def _bearer(request) -> str | None:
    scheme, _, value = (request.headers.get("authorization") or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _no_session(request) -> RequestError:
    return RequestError(
        401,
        "Authorization",
        "Authorization: this gateway records sessions for training: send 'Authorization: Bearer <session key>' "
        "with the key of an open session (POST /rl/start_session)",
        {"WWW-Authenticate": "Bearer"},
        "invalid_api_key",
    )


class _Routes:
    """The handlers of one gateway's app (see the module docstring); ``state`` is filled by the lifespan."""

    def __init__(self, gw):
        self.gw, self.started, self.state = gw, int(time.time()), {}
        self.document = openapi_document(gw)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        sampler = ThreadPoolExecutor(1, thread_name_prefix="shifu-sample")
        # one tokenising thread: HF fast tokenizers are not safe to call from several threads at once
        self.state["encoder"] = ThreadPoolExecutor(1, thread_name_prefix="shifu-encode")
        self.state["queue"] = self.gw.batch_queue(sampler)
        try:
            yield
        finally:
            await self.state["queue"].close()
            sampler.shutdown(wait=True)
            self.state["encoder"].shutdown(wait=True)

    async def on_encoder(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.state["encoder"], fn, *args)

    def session_key(self, request) -> str:
        key = _bearer(request)
        if not self.gw.sessions.is_open(key):
            raise _no_session(request)
        return key

    def caller(self, request) -> str | None:
        """The session key of a completion (recording), else None after the server's token check."""
        if self.gw.recording:
            return self.session_key(request)
        check_bearer(request.headers.get("authorization"), self.gw.token)
        return None

    async def body_of(self, request, allow_empty: bool = False):
        from starlette.concurrency import run_in_threadpool

        limits = self.gw.limits
        raw = await read_body(request, limits["max_body_bytes"], limits["body_timeout_s"])
        if allow_empty and not raw:
            return {}
        check_content_headers(request.headers)
        return await run_in_threadpool(decode_body, raw)

    async def health(self, request):
        gw = self.gw
        return _json(
            {
                "status": "ok",
                "model": gw.name,
                "recording": gw.recording,
                "policy_version": gw.engine.version,
                "pending": self.state["queue"].pending(),
                "sampler_calls": gw.engine.calls,
                "open_sessions": len(gw.sessions.open_keys()),
            }
        )

    async def openapi(self, request):
        return _json(self.document)

    async def models(self, request):
        gw = self.gw
        if not (gw.recording and gw.sessions.is_open(_bearer(request))):
            check_bearer(request.headers.get("authorization"), gw.token)
        entry = {"id": gw.name, "object": "model", "created": self.started, "owned_by": "shifu"}
        return _json({"object": "list", "data": [entry | {"max_model_len": gw.engine.positions}]})

    async def chat(self, request):
        gw = self.gw
        key = self.caller(request)
        req = parse_chat_request(await self.body_of(request))
        check_model(req, gw.name)
        memory = gw.memory_of(key)
        ids = await self.on_encoder(prompt_ids, gw.tok, req, gw.format, memory)
        job = gw.identify(make_job(req, ids, gw.sampling, gw.engine.positions, gw.recording), key)
        choices = await self.state["queue"].submit(job)
        body, segments = await self.on_encoder(
            answer, gw.tok, req, gw.format, ids, job, choices, memory, gw.name, gw.recording
        )
        if key is not None:
            with contextlib.suppress(UnknownSession):  # ended while sampling: nothing to record into
                gw.sessions.record(key, Call(body["id"], ids, segments))
        return _json(body)

    async def start_session(self, request):
        check_bearer(request.headers.get("authorization"), self.gw.token)
        body = await self.body_of(request, allow_empty=True)
        if not isinstance(body, dict) or set(body) - {"row_id"}:
            raise bad("body", "expected an object with at most the field row_id", "unknown_field")
        row_id = body.get("row_id")
        if row_id is not None and type(row_id) not in (str, int):
            raise bad("row_id", "expected a string, an integer or null")
        key = self.gw.start_session(row_id)
        return _json({"session_key": key, "model": self.gw.name, "row_id": row_id})

    async def set_reward(self, request):
        key = self.session_key(request)
        body = await self.body_of(request)
        if not isinstance(body, dict) or "reward" not in body or set(body) - {"reward", "call"}:
            raise bad("body", 'expected {"reward": number, "call"?: a completion id or "last"}')
        if type(body["reward"]) not in (int, float):
            raise bad("reward", "expected a number")
        call = body.get("call")
        if call is not None and not isinstance(call, str):
            raise bad("call", 'expected a completion id (the answer\'s id) or "last"')
        try:
            n = self.gw.set_reward(key, body["reward"], call)
        except KeyError as e:
            raise RequestError(409, "call", f"call: {e.args[0]}", code="no_such_call") from None
        return _json({"session_key": key, "reward": float(body["reward"]), "call": call, "segments": n})

    async def end_session(self, request):
        key = self.session_key(request)
        if await self.body_of(request, allow_empty=True) != {}:
            raise bad("body", "send no body, or {}", "unknown_field")
        rec = self.gw.end_session(key)
        self.gw.ended.put(rec)
        sampled = sum(len(s.sampled_ids) for t in rec.trajectories for s in t.segments)
        summary = {"session_key": key, "row_id": rec.row_id, "calls": rec.calls, "forks": rec.forks}
        return _json(
            summary | {"trajectories": len(rec.trajectories), "sampled_tokens": sampled, "reward": rec.reward}
        )


def _json(body: dict):
    from starlette.responses import JSONResponse

    return JSONResponse(body)


def create_app(gw):
    """The Starlette app of a :class:`shifu.gateway.gateway.Gateway` (see the module docstring)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    r = _Routes(gw)
    routes = [
        Route("/health", r.health, methods=["GET"]),
        Route("/openapi.json", r.openapi, methods=["GET"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/v1/chat/completions", r.chat, methods=["POST"]),
    ]
    if gw.recording:
        routes += [
            Route("/rl/start_session", r.start_session, methods=["POST"]),
            Route("/rl/set_reward", r.set_reward, methods=["POST"]),
            Route("/rl/end_session", r.end_session, methods=["POST"]),
        ]

    def failed(exc: Exception) -> str:
        return f"the gateway failed ({type(exc).__name__}: {exc})"

    return Starlette(
        routes=routes, exception_handlers=error_handlers(openai_error, failed), lifespan=r.lifespan
    )

"""The gateway's Starlette app: the dialects' routes on one engine path, the recording routes, errors in OpenAI's
shape (Anthropic's on its dialect's route).

    GET  /health               {"status": "ok", "model", "recording", "policy_version", "pending", ...}  (no token)
    GET  /openapi.json         the API (:mod:`shifu.gateway.openapi`, the served model filled in)  (no token)
    GET  /v1/models            the one served model
    GET  /v1/models/{id}       the served model (404 model_not_found for another id)
    POST /v1/chat/completions  OpenAI's chat completions (:mod:`shifu.gateway.chat`)
    POST /v1/responses         OpenAI's Responses API (:mod:`shifu.gateway.responses`)
    POST /v1/messages          Anthropic's Messages API (:mod:`shifu.gateway.messages`)
    POST /rl/start_session     recording only: a new session's key (the server's token, when it has one)
    POST /rl/set_reward        recording only: {"reward", "call"?} for the session of the key sent
    POST /rl/end_session       recording only: close the session of the key sent; its summary

Every dialect's request becomes the engine's :class:`~shifu.gateway.protocol.ChatRequest` that the same handlers
prepare (render, budget), sample or stream, answer and record (:meth:`_Routes.prepare`, ``sample`` / ``stream``,
``finish``, ``record``), so the calls of any dialect join one session. On a recording gateway each dialect's
route answers a session's request once (:meth:`_Routes.once`): a retry gets the first answer again
(:mod:`shifu.gateway.retries`). The API key comes as ``Authorization:
Bearer`` or ``x-api-key``. Every error is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape;
``param`` names the field to fix), but on ``/v1/messages``. Bodies are read by the shared stack
(:mod:`shifu.http.requests`). Prompts are rendered and answers decoded on one tokenizer thread; sampling runs on
one sampler thread (:class:`shifu.http.batching.BatchQueue` merging concurrent completions into one sampler
call).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import shifu.gateway.chat as chat
import shifu.gateway.messages as messages
import shifu.gateway.responses as responses
from shifu.gateway.completions import (
    Completed,
    Prepared,
    answer,
    check_model,
    make_job,
    offered_tools,
    prompt_ids,
)
from shifu.gateway.openapi import EndSession, SetReward, StartSession, build
from shifu.gateway.protocol import ChatRequest, bad
from shifu.gateway.retries import ANSWERING, Answer, fingerprint
from shifu.gateway.sessions import Call, UnknownSession, system_digest
from shifu.gateway.streaming import stream_events, withheld
from shifu.gateway.typed import validated
from shifu.http.requests import RequestError, check_content_headers, decode_body, read_body
from shifu.http.responses import error_handlers

_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}


def openai_error(status: int, field_name, message: str, headers: dict | None = None, code: str | None = None):
    from starlette.responses import JSONResponse

    kind = _TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": field_name, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def openapi_document(gateway=None) -> dict:
    """The API as an OpenAPI 3.1 document (:func:`shifu.gateway.openapi.build`, from the dialects' typed
    models); with a gateway, its model name and limits filled in."""
    from shifu import __version__

    doc = build()
    doc["info"]["x-shifu-version"] = __version__
    schemas = doc["components"]["schemas"]
    if gateway is not None:
        for request in ("ChatCompletionRequest", "ResponsesRequest", "MessagesRequest"):
            schemas[request]["properties"]["model"]["enum"] = [gateway.name]
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
    """The API key sent: ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key`` (Anthropic's)."""
    scheme, _, value = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    return request.headers.get("x-api-key")


def _check_token(request, token: str | None) -> None:
    """401 unless the API key sent (:func:`_bearer`) is the server's token (no check without one)."""
    if token is None:
        return
    key = _bearer(request)
    if key is None or not hmac.compare_digest(key.encode(), token.encode()):
        raise RequestError(
            401,
            "Authorization",
            f"Authorization: API key {'missing' if key is None else 'wrong'}: send the server's token as "
            "'Authorization: Bearer <token>' or 'x-api-key: <token>'",
            {"WWW-Authenticate": "Bearer"},
            "invalid_api_key",
        )


def _no_session(request) -> RequestError:
    return RequestError(
        401,
        "Authorization",
        "Authorization: this gateway records sessions for training: send 'Authorization: Bearer <session key>' "
        "(or 'x-api-key: <session key>') with the key of an open session (POST /rl/start_session)",
        {"WWW-Authenticate": "Bearer"},
        "invalid_api_key",
    )


@dataclass
class _Finished(Completed):
    """A completion with the :func:`~shifu.gateway.sessions.system_digest` of its request (side calls)."""

    system: str | None = None


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
        _check_token(request, self.gw.token)
        return None

    async def body_of(self, request, allow_empty: bool = False):
        """The request's JSON body, read once (:meth:`once` reads it before the route): a second call gives the
        same value, or raises the same refusal."""
        kept = getattr(request.state, "shifu_body", None)
        if kept is None:
            try:
                kept = (await self._read(request, allow_empty), None)
            except RequestError as e:
                kept = (None, e)
            request.state.shifu_body = kept
        if kept[1] is not None:
            raise kept[1]
        return kept[0]

    async def _read(self, request, allow_empty: bool):
        from starlette.concurrency import run_in_threadpool

        limits = self.gw.limits
        raw = await read_body(request, limits["max_body_bytes"], limits["body_timeout_s"])
        if allow_empty and not raw:
            return {}
        check_content_headers(request.headers)
        return await run_in_threadpool(decode_body, raw)

    def once(self, route):
        """A dialect's completion ``route`` that answers each request of a recording session once: a retry of
        one (:mod:`shifu.gateway.retries`) gets its answer again, recorded once. Requests without an open
        session's key, or whose body is refused, go to the route as they are."""
        from starlette.concurrency import run_in_threadpool

        async def endpoint(request):
            key = _bearer(request)
            if not (self.gw.recording and self.gw.sessions.is_open(key)):
                return await route(request)
            try:
                body = await self.body_of(request)
            except RequestError:
                return await route(request)  # refused there, in the dialect's own shape
            request_id = await run_in_threadpool(
                fingerprint, request.url.path, body, request.headers.get("idempotency-key")
            )
            sessions = self.gw.sessions
            try:
                answer = sessions.retry_of(key, request_id)
                if answer is None:
                    answer = Answer()
                    sessions.keep(key, request_id, answer)
                    answer.start(
                        lambda: route(request), request_id, lambda: sessions.settle(key, request_id, answer)
                    )
            except UnknownSession:  # ended meanwhile: the route refuses it
                return await route(request)
            return await answer.response()

        return endpoint

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
                "prefix_cache": gw.engine.prefix_counters(),
                "kv_pool": gw.engine.kv_counters(),
            }
        )

    async def openapi(self, request):
        return _json(self.document)

    def model_entry(self, request) -> dict:
        gw = self.gw
        if not (gw.recording and gw.sessions.is_open(_bearer(request))):
            _check_token(request, gw.token)
        entry = {"id": gw.name, "object": "model", "created": self.started, "owned_by": "shifu"}
        return entry | {"max_model_len": gw.engine.positions}

    async def models(self, request):
        return _json({"object": "list", "data": [self.model_entry(request)]})

    async def model(self, request):
        entry, asked = self.model_entry(request), request.path_params["model"]
        if asked != self.gw.name:
            raise RequestError(
                404,
                "model",
                f"model: {asked!r} is not served here; this gateway serves {self.gw.name!r} (GET /v1/models)",
                code="model_not_found",
            )
        return _json(entry)

    async def prepare(self, key: str | None, req: ChatRequest) -> Prepared:
        """The engine's job of a request, whichever dialect asked: ``req`` rendered (the session's memory of
        what it sampled spliced in) and budgeted."""
        gw = self.gw
        check_model(req, gw.name)
        memory = gw.memory_of(key)
        try:
            ids = await self.on_encoder(prompt_ids, gw.tok, req, gw.format, memory)
            job = gw.identify(make_job(req, ids, gw.sampling, gw.engine.positions, gw.recording), key)
            if (why := gw.engine.too_big(job)) is not None:  # it would never fit: refused, not queued
                raise bad("max_tokens", why, "kv_budget_exceeded")
        except RequestError as e:
            if key is not None and e.code == "context_length_exceeded":  # the episode met the context limit
                with contextlib.suppress(UnknownSession):
                    gw.sessions.refused(key)
            raise
        return Prepared(key, req, ids, job, memory)

    async def finish(self, prep: Prepared, choices, completion_id: str | None = None) -> _Finished:
        """The chat answer of sampled ``choices`` (remembered); :meth:`record` keeps it in the session."""
        gw = self.gw
        body, segments = await self.on_encoder(
            answer,
            gw.tok,
            prep.req,
            gw.format,
            prep.ids,
            prep.job,
            choices,
            prep.memory,
            gw.name,
            gw.recording,
            completion_id,
        )
        return _Finished(prep.key, prep.ids, body, choices, segments, system_digest(prep.req.messages))

    async def sample(self, prep: Prepared) -> list:
        """The sampled choices of a prepared request (merged with others into one sampler call)."""
        return await self.state["queue"].submit(prep.job)

    def stream(self, prep: Prepared, resolve):
        """The events of a streamed completion (:func:`shifu.gateway.streaming.stream_events`); ``resolve``
        (the dialect's) turns the sampled choices into its answer, records it and returns their outcomes."""
        holds = withheld(prep.req, self.gw.format, bool(offered_tools(prep.req)))
        return stream_events(self.state["queue"], prep.job, holds, resolve)

    def record(self, done: _Finished, call_id: str) -> None:
        """Record a completion into its session as the call ``call_id`` (the id its dialect answered with), with
        the request it answered (:mod:`shifu.gateway.retries`)."""
        if done.key is not None:
            call = Call(call_id, done.prompt_ids, done.segments, done.system, ANSWERING.get())
            with contextlib.suppress(UnknownSession):  # ended while sampling: nothing to record into
                self.gw.sessions.record(done.key, call)

    async def start_session(self, request):
        _check_token(request, self.gw.token)
        row_id = validated(StartSession, await self.body_of(request, allow_empty=True)).row_id
        key = self.gw.start_session(row_id)
        return _json({"session_key": key, "model": self.gw.name, "row_id": row_id})

    async def set_reward(self, request):
        key = self.session_key(request)
        body = validated(SetReward, await self.body_of(request))
        try:
            n = self.gw.set_reward(key, body.reward, body.call)
        except KeyError as e:
            raise RequestError(409, "call", f"call: {e.args[0]}", code="no_such_call") from None
        return _json({"session_key": key, "reward": float(body.reward), "call": body.call, "segments": n})

    async def end_session(self, request):
        key = self.session_key(request)
        validated(EndSession, await self.body_of(request, allow_empty=True))
        rec = self.gw.end_session(key)
        self.gw.ended.put(rec)
        sampled = sum(len(s.sampled_ids) for t in rec.trajectories for s in t.segments)
        summary = {"session_key": key, "row_id": rec.row_id, "calls": rec.calls, "forks": rec.forks}
        counts = {"trajectories": len(rec.trajectories), "sampled_tokens": sampled, "reward": rec.reward}
        limits = {"side_calls": rec.side_calls, "context_exceeded": rec.context_exceeded}
        return _json(summary | counts | limits)


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
        Route("/v1/models/{model:path}", r.model, methods=["GET"]),
        *[
            Route(route.path, r.once(route.endpoint), methods=["POST"])
            for dialect in (chat, responses, messages)
            for route in dialect.routes(r)
        ],
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

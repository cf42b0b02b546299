"""Retried requests of a recording gateway, answered once: a client that sends a request again after a timeout
or a dropped connection gets the first answer again, and its session records one call.

**The same request** is one of the same session (its key) on the same route (the dialect) with the same body,
compared as canonical JSON (keys sorted, no whitespace), and the same ``Idempotency-Key`` header when the client
sends one (a client that names each request so tells a deliberate repeat from a retry): its
:func:`fingerprint`. **In the same session state**: the earlier request is still being answered, or it recorded
a call that no later call of the session has gone on from (extended one of its choices; calls on other
branches of the session do not count). Then the request is a retry: it waits for the first answer if need be
and gets it again, byte for byte (the same ids; a streamed answer's events from the first, then as they come),
and nothing more is sampled or recorded; it takes no call index of the session either
(:meth:`shifu.gateway.Gateway.identify`), so the calls after it sample what they would have without it. A
request sent again after the agent went on from its answer is a new call (it samples anew: a fork of the
session), and a request that was refused is asked again. So the same request sent twice to draw two samples is
answered once: ask for ``n`` choices, or send an ``Idempotency-Key`` per request.

The first answer is made in a task of its own (:class:`Answer`), so that it is sampled, recorded and kept whole
even when the client that asked has gone away; every requester, the first included, reads it from there.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger(__name__)
ANSWERING: contextvars.ContextVar[str | None] = contextvars.ContextVar("shifu_answering", default=None)
"""The fingerprint of the request that the current task answers (None: one not kept for retries)."""
_RUNNING: set[asyncio.Task] = set()  # answers being made (their requesters may have gone away)


def fingerprint(route: str, body, idempotency_key: str | None) -> str:
    """What makes two requests of a session the same request (module docstring), as a sha256 hex digest."""
    canonical = json.dumps(
        [route, idempotency_key, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class Answer:
    """One request's answer as it was sent, for its requester and its retries: the response's status and raw
    headers, then its body's pieces in order (a streamed answer's events one by one)."""

    def __init__(self):
        self._head: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pieces: list[bytes] = []
        self.finished = False
        self._grown = asyncio.Condition()

    def start(self, respond: Callable[[], Awaitable], request_id: str, settled: Callable[[], None]) -> None:
        """Make the answer in a task of its own: ``respond()`` (the route's handler), its body read to the end;
        ``settled()`` once it is complete."""

        async def run() -> None:
            ANSWERING.set(request_id)
            try:
                await self._fill(respond)
            finally:
                if not self._head.done():  # (cancelled: the server is closing)
                    self._head.set_exception(RuntimeError("the gateway closed before it answered"))
                async with self._grown:
                    self.finished = True
                    self._grown.notify_all()
                settled()

        task = asyncio.get_running_loop().create_task(run())
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)

    async def _fill(self, respond: Callable[[], Awaitable]) -> None:
        from starlette.responses import StreamingResponse

        try:
            response = await respond()
        except Exception as e:  # noqa: BLE001 (every requester raises it: the app's handlers answer it)
            self._head.set_exception(e)
            return
        streamed = isinstance(response, StreamingResponse)
        self._head.set_result((response.status_code, list(response.raw_headers), streamed))
        if not streamed:
            await self._add(response.body)
            return
        try:
            async for piece in response.body_iterator:
                await self._add(piece if isinstance(piece, bytes) else piece.encode(response.charset))
        except Exception:  # the dialects send their failures in the stream; what is left is the server's
            log.exception("a kept streamed answer failed")

    async def _add(self, piece: bytes) -> None:
        async with self._grown:
            self.pieces.append(piece)
            self._grown.notify_all()

    async def _follow(self) -> AsyncIterator[bytes]:
        sent = 0
        while True:
            async with self._grown:
                await self._grown.wait_for(lambda n=sent: len(self.pieces) > n or self.finished)
                new, finished = self.pieces[sent:], self.finished
            for piece in new:
                yield piece
            sent += len(new)
            if finished and sent == len(self.pieces):
                return

    async def response(self):
        """The response of one requester: the answer's status and headers, its body whole (a plain answer, once
        complete) or followed piece by piece (a streamed one)."""
        from starlette.responses import Response, StreamingResponse

        status, headers, streamed = await asyncio.shield(self._head)  # (a requester gone cancels only itself)
        if streamed:
            out = StreamingResponse(self._follow(), status_code=status)
        else:
            async with self._grown:
                await self._grown.wait_for(lambda: self.finished)
            out = Response(b"".join(self.pieces), status_code=status)
        out.raw_headers = list(headers)
        return out

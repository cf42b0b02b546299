"""The Messages dialect's route: ``POST /v1/messages`` on the engine's front (the gateway app's handlers:
``caller``, ``body_of``, ``prepare``, ``sample`` / ``stream``, ``finish``, ``record``). The key comes as Anthropic's client sends it
(``x-api-key``) or as a bearer token; every refusal is in Anthropic's shape, ``{"type": "error", "error":
{"type", "message"}}``, the message starting with the field to fix."""

from __future__ import annotations

import logging
import secrets

from shifu.gateway.messages.protocol import STREAM_EVENTS, MessagesAnswer, MessagesError, MessagesRequest
from shifu.gateway.messages.stream import message_events
from shifu.gateway.messages.translate import answer_body, chat_request, message_head
from shifu.gateway.streaming import SSE_HEADERS, outcomes
from shifu.gateway.typed import components, event_stream, post_operation, renamed, validated
from shifu.http.requests import RequestError

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); others are invalid requests
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
}
log = logging.getLogger(__name__)


def anthropic_error(status: int, message: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


class MessagesRoute:
    """``POST /v1/messages``: validated, translated into a chat request, completed and recorded by the
    engine, answered as a message (streamed with ``stream: true``, :mod:`~shifu.gateway.messages.stream`)."""

    def __init__(self, front):
        self.front = front

    async def create(self, request):
        try:
            return await self._create(request)
        except RequestError as e:
            return anthropic_error(e.status, e.message, e.headers)
        except Exception as e:  # answered in this dialect's shape; the traceback goes to the log
            log.exception("POST /v1/messages failed")
            return anthropic_error(500, f"the gateway failed ({type(e).__name__}: {e})")

    async def _create(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        key = self.front.caller(request)
        req = validated(MessagesRequest, await self.front.body_of(request))
        try:
            prep = await self.front.prepare(key, chat_request(req))
        except RequestError as e:  # the engine names chat's response_format: here it is output_config.format
            raise renamed(e, "output_config.format") from None
        message_id, answered = "msg_" + secrets.token_hex(12), {}

        async def resolve(choices):
            done = await self.front.finish(prep, choices)
            answered["body"] = answer_body(done.body, done.choices[0], message_id)
            self.front.record(done, message_id)
            return outcomes(done.body)

        if not req.stream:
            await resolve(await self.front.sample(prep))
            return JSONResponse(answered["body"])
        head = message_head(message_id, self.front.gw.name, len(prep.ids))
        events = message_events(self.front.stream(prep, resolve), head, answered)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def routes(front) -> list:
    from starlette.routing import Route

    return [Route("/v1/messages", MessagesRoute(front).create, methods=["POST"])]


def openapi() -> dict:
    """This dialect's part of the gateway's OpenAPI document: its path and its schemas."""
    stream, event_schemas = event_stream("MessagesStreamEvent", *STREAM_EVENTS)
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/MessagesError"}}}
    refused = {
        "description": (
            "Refused, in Anthropic's error shape (the reasons of the chat route's refusals; the message starts "
            "with the field to fix)."
        ),
        "content": error,
    }
    answers = {str(s): refused for s in (400, 401, 404, 408, 413, 415)}
    answers["405"] = {
        "$ref": "#/components/responses/Refused"
    }  # the router's, before this dialect is reached
    operation = post_operation(
        "createMessage",
        "Sample a message (Anthropic's Messages API), recorded as a chat completion is.",
        [{"apiKey": []}, {"bearer": []}, {}],
        ("MessagesRequest", "MessagesAnswer"),
        "The message; with stream true, its events (Server-Sent Events).",
        stream,
        answers,
        {"description": "The sampler failed (the message says how).", "content": error},
        description=(
            "The key as x-api-key (Anthropic's clients) or as a bearer token. A refusal of a request this "
            "schema allows: a prompt too long for the model's positions, a chat template that refuses the "
            "messages, a model that is not served, or a forced tool call (tool_choice) with no tools or naming "
            "another tool."
        ),
    )
    schemas = components(MessagesRequest, MessagesAnswer, MessagesError) | event_schemas
    return {"paths": {"/v1/messages": {"post": operation}}, "schemas": schemas}

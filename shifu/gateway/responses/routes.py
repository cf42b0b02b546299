"""The Responses dialect's route: ``POST /v1/responses`` on the engine's front (the gateway app's handlers:
``caller``, ``body_of``, ``prepare``, ``sample`` / ``stream``, ``finish``, ``record``). Errors are OpenAI's
shape, as on the chat route."""

from __future__ import annotations

from shifu.gateway.responses.protocol import STREAM_EVENTS, Response, ResponsesRequest
from shifu.gateway.responses.stream import response_events
from shifu.gateway.responses.translate import (
    Stored,
    answered_turn,
    chat_request,
    new_id,
    response_body,
    response_head,
)
from shifu.gateway.streaming import SSE_HEADERS, outcomes
from shifu.gateway.typed import components, event_stream, post_operation, renamed, validated
from shifu.http.requests import RequestError


class ResponsesRoute:
    """``POST /v1/responses``: validated, translated into a chat request, completed and recorded by the
    engine, answered as a Response (streamed with ``stream: true``, :mod:`~shifu.gateway.responses.stream`);
    its conversation kept for ``previous_response_id`` unless ``store`` is false."""

    def __init__(self, front, stored: Stored | None = None):
        self.front, self.stored = front, stored or Stored()
        front.gw.on_end.append(self.stored.drop)  # a session's conversations end with it

    async def create(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        key = self.front.caller(request)
        req = validated(ResponsesRequest, await self.front.body_of(request))
        history = self.stored.get(req.previous_response_id, key) if req.previous_response_id else []
        try:
            prep = await self.front.prepare(key, chat_request(req, history))
        except RequestError as e:  # the engine names chat's response_format: here it is text.format
            raise renamed(e, "text.format") from None
        response_id, message_id, answered = new_id("resp_"), new_id("msg_"), {}

        async def resolve(choices):
            done = await self.front.finish(prep, choices)
            answered["body"] = response_body(req, done.body, response_id, message_id)
            self.front.record(done, response_id)
            if req.store is not False:
                start = 1 if req.instructions is not None else 0
                self.stored.put(response_id, key, [*prep.req.messages[start:], answered_turn(done.body)])
            return outcomes(done.body)

        if not req.stream:
            await resolve(await self.front.sample(prep))
            return JSONResponse(answered["body"])
        job = prep.job
        sampling = {"temperature": 0.0 if job.greedy else job.temperature, "top_p": job.top_p}
        head = response_head(req, response_id, self.front.gw.name, sampling)
        events = response_events(self.front.stream(prep, resolve), head, message_id, answered)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def routes(front) -> list:
    from starlette.routing import Route

    return [Route("/v1/responses", ResponsesRoute(front).create, methods=["POST"])]


def openapi() -> dict:
    """This dialect's part of the gateway's OpenAPI document: its path and its schemas."""
    stream, event_schemas = event_stream("ResponsesStreamEvent", *STREAM_EVENTS)
    refused = {"$ref": "#/components/responses/Refused"}
    answers = {str(s): refused for s in (400, 401, 404, 405, 408, 413, 415)}
    operation = post_operation(
        "createResponse",
        "Sample a response (OpenAI's Responses API), recorded as a chat completion is.",
        [{"bearer": []}, {"apiKey": []}, {}],
        ("ResponsesRequest", "Response"),
        "The response; with stream true, its events (Server-Sent Events).",
        stream,
        answers,
        {"$ref": "#/components/responses/Failed"},
        description=(
            "A refusal of a request this schema allows: code previous_response_not_found (the response is "
            "not kept for this key), tool_not_offered (a forced call with no tools, or naming another tool), "
            "context_length_exceeded, template_error or model_not_found."
        ),
    )
    schemas = components(ResponsesRequest, Response) | event_schemas
    return {"paths": {"/v1/responses": {"post": operation}}, "schemas": schemas}

"""The chat dialect's route: ``POST /v1/chat/completions`` on the engine's front (the gateway app's handlers:
``caller``, ``body_of``, ``prepare``, ``sample`` / ``stream``, ``finish``, ``record``). The engine's answer is a
chat completion already; errors are OpenAI's shape."""

from __future__ import annotations

from shifu.gateway.chat.protocol import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from shifu.gateway.chat.stream import chat_chunks
from shifu.gateway.chat.translate import parse_chat_request
from shifu.gateway.completions import new_completion_id
from shifu.gateway.streaming import SSE_HEADERS, outcomes
from shifu.gateway.typed import REF, components, post_operation


class ChatRoute:
    """``POST /v1/chat/completions``: validated, translated into the engine's request, completed and recorded,
    answered as a chat completion (streamed as chunks with ``stream: true``, :mod:`~shifu.gateway.chat.stream`)."""

    def __init__(self, front):
        self.front = front

    async def create(self, request):
        from starlette.responses import JSONResponse

        key = self.front.caller(request)
        prep = await self.front.prepare(key, parse_chat_request(await self.front.body_of(request)))
        if prep.req.stream:
            return self.stream(prep)
        done = await self.front.finish(prep, await self.front.sample(prep))
        self.front.record(done, done.body["id"])
        return JSONResponse(done.body)

    def stream(self, prep):
        """``stream: true``: the same job and answer, sent as chunks while it is sampled."""
        from starlette.responses import StreamingResponse

        completion_id, answered = new_completion_id(), {}

        async def resolve(choices):
            done = await self.front.finish(prep, choices, completion_id)
            self.front.record(done, completion_id)
            answered["body"] = done.body
            return outcomes(done.body)

        name = self.front.gw.name
        chunks = chat_chunks(
            self.front.stream(prep, resolve), prep.req, completion_id, name, answered, prep.ids
        )
        return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)


def routes(front) -> list:
    from starlette.routing import Route

    return [Route("/v1/chat/completions", ChatRoute(front).create, methods=["POST"])]


def openapi() -> dict:
    """This dialect's part of the gateway's OpenAPI document: its path and its schemas."""
    refused = {"$ref": "#/components/responses/Refused"}
    # each event's data is a chunk as JSON, but the last one's is [DONE]: a string, its chunks named beside it
    data = {
        "type": "string",
        "description": "A ChatCompletionChunk as JSON; the last event's data is [DONE].",
        "x-sse-data": {"$ref": REF.format(model="ChatCompletionChunk")},
    }
    stream = {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}
    operation = post_operation(
        "createChatCompletion",
        "Sample a chat completion.",
        [{"bearer": []}, {"apiKey": []}, {}],
        ("ChatCompletionRequest", "ChatCompletion"),
        "The completion; with stream true, its chunks as Server-Sent Events.",
        stream,
        {str(s): refused for s in (400, 401, 404, 405, 408, 413, 415)},
        {"$ref": "#/components/responses/Failed"},
    )
    schemas = components(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk)
    return {"paths": {"/v1/chat/completions": {"post": operation}}, "schemas": schemas}

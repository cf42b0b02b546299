"""The Responses dialect's route: ``POST /v1/responses`` on the engine's front (the gateway app's handlers:
``caller``, ``body_of``, ``complete``, ``record``). Errors are OpenAI's shape, as on the chat route."""

from __future__ import annotations

from shifu.gateway.responses.protocol import Response, ResponsesRequest
from shifu.gateway.responses.translate import Stored, answered_turn, chat_request, response_body
from shifu.gateway.typed import components, validated


class ResponsesRoute:
    """``POST /v1/responses``: validated, translated into a chat request, completed and recorded by the
    engine, answered as a Response; its conversation kept for ``previous_response_id`` unless ``store`` is
    false."""

    def __init__(self, front, stored: Stored | None = None):
        self.front, self.stored = front, stored or Stored()

    async def create(self, request):
        from starlette.responses import JSONResponse

        key = self.front.caller(request)
        req = validated(ResponsesRequest, await self.front.body_of(request))
        history = self.stored.get(req.previous_response_id, key) if req.previous_response_id else []
        chat = chat_request(req, history)
        done = await self.front.complete(key, chat)
        body = response_body(req, done.body)
        self.front.record(done, body["id"])
        if req.store is not False:
            start = 1 if req.instructions is not None else 0
            self.stored.put(body["id"], key, [*chat.messages[start:], answered_turn(done.body)])
        return JSONResponse(body)


def routes(front) -> list:
    from starlette.routing import Route

    return [Route("/v1/responses", ResponsesRoute(front).create, methods=["POST"])]


def openapi() -> dict:
    """This dialect's part of the gateway's OpenAPI document: its path and its schemas."""
    refused = {"$ref": "#/components/responses/Refused"}
    answers = {str(s): refused for s in (400, 401, 404, 405, 408, 413, 415)}
    operation = {
        "operationId": "createResponse",
        "summary": "Sample a response (OpenAI's Responses API), recorded as a chat completion is.",
        "description": (
            "A refusal of a request this schema allows: code previous_response_not_found (the response is "
            "not kept for this key), context_length_exceeded, template_error or model_not_found."
        ),
        "security": [{"bearer": []}, {"apiKey": []}, {}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ResponsesRequest"}}},
        },
        "responses": {
            "200": {
                "description": "The response.",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Response"}}},
            },
            **answers,
            "500": {"$ref": "#/components/responses/Failed"},
        },
    }
    return {
        "paths": {"/v1/responses": {"post": operation}},
        "schemas": components(ResponsesRequest, Response),
    }

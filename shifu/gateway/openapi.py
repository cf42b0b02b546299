"""The gateway's API as one OpenAPI 3.1 document, made from typed models: each dialect's part from its own
(:func:`shifu.gateway.chat.openapi`, :func:`shifu.gateway.responses.openapi`, :func:`shifu.gateway.messages.openapi`),
the gateway's own routes (health, models, the recording ``/rl/*`` routes) from the models below, which also read
the ``/rl/*`` bodies (:func:`shifu.gateway.typed.validated`). :func:`build` is the document without a served
model; ``shifu/gateway/openapi.json`` is a copy of it for readers (a test keeps it equal; write it again with
``python -m shifu.gateway.openapi``), and ``GET /openapi.json`` serves it with the served model filled in
(:func:`shifu.gateway.app.openapi_document`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

import shifu.gateway.chat as chat
import shifu.gateway.messages as messages
import shifu.gateway.responses as responses
from shifu.gateway.typed import REF, Strict, components

FILE = Path(__file__).with_name("openapi.json")
Count = Annotated[int, Field(ge=0)]
RowId = str | int | None


class ErrorDetail(Strict):
    message: str = Field(description="Starts with the field; says what is wrong and what to send instead.")
    type: Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error"]
    param: str | None = Field(
        description=(
            "The field to fix ('messages[2].content', 'stop[1]', 'body', 'Authorization', 'path', 'method'); "
            "null when it is the server's fault."
        )
    )
    code: str | None = Field(
        description=(
            "unknown_field, invalid_value, unsupported_value, context_length_exceeded, template_error, "
            "model_not_found, invalid_api_key, no_such_call, previous_response_not_found, tool_not_offered, "
            "constrained_decoding, invalid_json_schema, or null."
        )
    )


class Error(Strict):
    """A refusal (OpenAI's shape; ``/v1/messages`` answers in Anthropic's)."""

    error: ErrorDetail


class Health(Strict):
    status: Literal["ok"]
    model: str
    recording: bool
    policy_version: int
    pending: Count = Field(description="Completions waiting for the sampler thread.")
    sampler_calls: Count = Field(description="Sampler calls run (each may answer several requests).")
    open_sessions: Count
    prefix_cache: dict[str, float] = Field(
        description=(
            "The prefix cache's counters since the gateway started: rows (prompts looked up), hits, hit_rate, "
            "prefill_tokens, reused_tokens (copied from the cache instead), evicted_blocks, bytes, budget_bytes; "
            "empty when it is off."
        )
    )
    kv_pool: dict[str, float] = Field(
        description=(
            "The paged KV pool of requests that join a running decode (shifu serve --policy --kv-budget-mb): "
            "budget_bytes, peak_bytes (the most it held at once), waits (the times a request waited for room)."
        )
    )


class Model(Strict):
    id: str = Field(description="The name to send as model.")
    object: Literal["model"]
    created: int
    owned_by: Literal["shifu"]
    max_model_len: int | None = Field(
        description="The model's positions (prompt + completion); null when unlimited."
    )


class ModelList(Strict):
    object: Literal["list"]
    data: Annotated[list[Model], Field(min_length=1, max_length=1)]


class StartSession(Strict):
    row_id: RowId = Field(None, description="Which task row the episode solves (handed back to the trainer).")


class Session(Strict):
    session_key: str = Field(description="The API key of the session's calls.")
    model: str
    row_id: RowId


class SetReward(Strict):
    reward: float
    call: str | None = Field(
        None,
        description=(
            "A completion's id, or \"last\" for the session's latest call: the reward lands on that call's last "
            "sampled token. Left out: the episode's reward."
        ),
    )


class RewardSet(Strict):
    session_key: str
    reward: float
    call: str | None
    segments: Count = Field(
        description="Completions that got the reward (a call's choices; 0 for the episode's)."
    )


class EndSession(Strict):
    """No fields: send no body, or ``{}``."""


class SessionSummary(Strict):
    session_key: str
    row_id: RowId
    calls: Count
    forks: Count = Field(
        description="Calls whose prompt extended no earlier call of the session (each starts a trajectory)."
    )
    trajectories: Count
    sampled_tokens: Count
    reward: float | None
    side_calls: Count = Field(
        description="Calls sent with another system prompt than the agent's (a title, a summary, a classifier)."
    )
    context_exceeded: bool = Field(
        description="The session's last request was refused for the model's context (context_length_exceeded)."
    )


DESCRIPTION = (
    "Chat completions with OpenAI's fields and vLLM's token fields (return_token_ids -> prompt_token_ids,"
    " choices[].token_ids). Every prompt goes through the policy's chat template. Concurrent requests of "
    "one sampling setting are sampled in one call. With stream: true the answer is sent as Server-Sent "
    "Events while it is sampled (chat: each event's data a ChatCompletionChunk, then data: [DONE]); it "
    "samples, answers and records the same tokens as stream: false. Each dialect's requests, answers and "
    "events are declared once as typed models, from which this document comes. Every body is JSON (RFC "
    "8259, UTF-8): NaN, Infinity, duplicate keys and lone surrogates are refused. Every refusal is a 4xx "
    'with {"error": {"message", "type", "param", "code"}} whose param names the field to fix; a field the'
    " gateway does not take is refused with code unknown_field, never ignored; fields that change nothing"
    " sampled (store, metadata, service_tier, prompt_cache_key, safety_identifier, user, modalities "
    '["text"], zero penalties, an empty logit_bias, vLLM\'s top_k 0 or -1, min_p 0, repetition_penalty 1) '
    "are accepted, and any other value of them is refused with code unsupported_value (shifu records the "
    "exact log-probs of what it samples, and implements none of them). A request that this document "
    "allows is refused only for what a schema cannot say, each with its code: the rendered prompt leaves "
    "no room in the model's positions (400 context_length_exceeded), the chat template refuses the "
    "messages (400 template_error), the model is not the one served (404 model_not_found), tool_choice "
    "forces a call of a tool the request does not offer (400 tool_not_offered), a JSON response_format "
    "that cannot be applied (400 constrained_decoding: on a recording gateway, with a forced call or with"
    " top_logprobs) or followed (400 invalid_json_schema), a reward names a call the session does not "
    "have (409 no_such_call). On /v1/responses also: a previous_response_id the gateway does not keep for"
    " the key sent (400 previous_response_not_found). /v1/responses and /v1/messages (OpenAI's Responses "
    "and Anthropic's Messages APIs) render, sample, stream and record as chat completions do; "
    '/v1/messages answers refusals in Anthropic\'s shape, {"type": "error", "error": {"type", "message"}},'
    " the message starting with the field to fix. The API key is sent as 'Authorization: Bearer <key>' or"
    " as 'x-api-key: <key>' (Anthropic's clients), on every route. The /rl/* routes exist only on a "
    "recording gateway (a trainer's); there the API key of a completion is a session key. Guide: "
    "docs/how-to/policy-endpoint.md."
)
RESPONSES = {
    "Refused": {
        "description": "400: the body is not UTF-8 JSON by RFC 8259, a field is unknown, missing, of the wrong type or out of range, or the request cannot be served (code context_length_exceeded, template_error, tool_not_offered, constrained_decoding, invalid_json_schema). 401: no or wrong bearer token or session key. 404: an unknown path, a /rl route on a gateway that does not record, or a model that is not served (code model_not_found). 405: wrong method. 408: the body did not arrive in time. 409: a reward for a call the session does not have. 413: the body is too large. 415: Content-Type is not application/json (charset utf-8), or the body is encoded.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    },
    "Failed": {
        "description": "The sampler failed (the message says how); the gateway goes on serving.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    },
}
SECURITY = {
    "bearer": {
        "type": "http",
        "scheme": "bearer",
        "description": "The server's token (--token or $SHIFU_SERVE_TOKEN) when it has one; on a recording gateway, a completion's key is a session key instead.",
    },
    "apiKey": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "The same key as the bearer token, the way Anthropic's clients send it.",
    },
    "sessionKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "The key of an open session (POST /rl/start_session).",
    },
}
SUMMARY = "OpenAI chat completions, OpenAI Responses and Anthropic Messages on shifu's own sampler (`shifu serve --policy`), and the sessions that record what it sampled for training, whichever dialect asked."

IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": (
        "On a recording gateway, a request sent again in the same session state with the same body (and the "
        "same key, when one is sent) is a retry: it gets the first answer again and nothing more is recorded. "
        "A key per request tells a deliberate repeat from a retry. Read; changes nothing on a gateway that "
        "does not record."
    ),
}


def _refused(*statuses: int) -> dict:
    return {str(s): {"$ref": "#/components/responses/Refused"} for s in statuses}


def _answer(description: str, model: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}},
    }


def _body(model: str, required: bool) -> dict:
    content = {"application/json": {"schema": {"$ref": REF.format(model=model)}}}
    return {"required": required, "content": content}


def _own_paths() -> dict:
    """The paths of the gateway's own routes (module docstring)."""
    token = [{"bearer": []}, {"apiKey": []}, {}]
    session = [{"sessionKey": []}]
    body_refusals = _refused(400, 401, 404, 405, 408, 413, 415)
    return {
        "/health": {
            "get": {
                "operationId": "health",
                "summary": "Liveness and counters (no token needed).",
                "responses": {"200": _answer("The gateway runs.", "Health"), **_refused(405)},
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document, with the served model filled in (no token needed).",
                "responses": {
                    "200": {
                        "description": "An OpenAPI 3.1 document.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_refused(405),
                },
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The served model.",
                "security": token,
                "responses": {"200": _answer("One model.", "ModelList"), **_refused(401, 405)},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "operationId": "retrieveModel",
                "summary": "The served model by its id.",
                "security": token,
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": _answer("The model.", "Model"), **_refused(401, 404, 405)},
            }
        },
        "/rl/start_session": {
            "post": {
                "operationId": "startSession",
                "summary": (
                    "Recording gateways only: open a session; its key is the API key of the agent's calls (the "
                    "server's token, when it has one)."
                ),
                "security": token,
                "requestBody": _body("StartSession", required=False),
                "responses": {"200": _answer("The new session.", "Session"), **body_refusals},
            }
        },
        "/rl/set_reward": {
            "post": {
                "operationId": "setReward",
                "summary": "Recording gateways only: the reward of the session whose key is sent, or of one of its calls.",
                "security": session,
                "requestBody": _body("SetReward", required=True),
                "responses": {"200": _answer("Reward set.", "RewardSet"), **body_refusals, **_refused(409)},
            }
        },
        "/rl/end_session": {
            "post": {
                "operationId": "endSession",
                "summary": (
                    "Recording gateways only: close the session whose key is sent; the trainer takes what it recorded."
                ),
                "security": session,
                "requestBody": _body("EndSession", required=False),
                "responses": {"200": _answer("The session's summary.", "SessionSummary"), **body_refusals},
            }
        },
    }


def build() -> dict:
    """The gateway's OpenAPI 3.1 document (module docstring), without a served model."""
    paths, schemas = (
        _own_paths(),
        components(
            Error, Health, ModelList, StartSession, Session, SetReward, RewardSet, EndSession, SessionSummary
        ),
    )
    for dialect in (chat, responses, messages):
        part = dialect.openapi()
        for operation in part["paths"].values():
            operation["post"]["parameters"] = [IDEMPOTENCY_KEY]
        paths |= part["paths"]
        schemas |= part["schemas"]
    order = ["/health", "/openapi.json", "/v1/models", "/v1/models/{model}"]
    paths = {p: paths[p] for p in order + sorted(set(paths) - set(order))}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "shifu policy gateway",
            "version": "1",
            "summary": SUMMARY,
            "description": "".join(DESCRIPTION),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "paths": paths,
        "components": {
            "securitySchemes": SECURITY,
            "responses": RESPONSES,
            "schemas": dict(sorted(schemas.items())),
        },
    }


def text() -> str:
    """The document as ``openapi.json`` holds it."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    FILE.write_text(text(), encoding="utf-8")
    sys.stdout.write(f"wrote {FILE}\n")

"""Schemathesis hooks of tests/test_http_fuzz.py (loaded by the fuzzer's process through SCHEMATHESIS_HOOKS).

``documented_refusal`` replaces schemathesis' positive_data_acceptance: a request the document allows may
still be refused, but only for one of the reasons the document names that a JSON Schema cannot express
(the gateway: its error ``code``; the reward service: fields that disagree in length or shape, ids past the
model's positions), never for anything else. With SHIFU_FUZZ_SESSIONS set, every request carries the key
of a fresh session of the recording gateway at that URL (so ending one session leaves the others open).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request

import schemathesis

# the gateway: refusals of schema-valid requests its document lists, by error code
GATEWAY_CODES = {
    "context_length_exceeded",
    "template_error",
    "model_not_found",
    "no_such_call",
    "previous_response_not_found",
    "tool_not_offered",
    "constrained_decoding",
    "invalid_json_schema",
}
# the gateway's Messages route (Anthropic's error shape has no code): the same refusals, by their message
MESSAGES_RULES = [
    r"^messages: the prompt has \d+ tokens, which leaves no room",
    r"^messages: (the chat template refused them|they render to no tokens)",
    r"^model: .* is not served here",
    r"^tool_choice: (a forced call needs tools|names the tool)",
    r"^output_config\.format: (a recording gateway takes only|not with a forced tool call)",
    r"^output_config\.format\.schema: llguidance cannot follow it",
]
# the reward service: cross-field rules its document states in words (ScoreRequest's description)
REWARD_RULES = [
    r"^attention_mask: shape \(\d+, \d+\) differs from input_ids",
    r"^responses: has \d+ items, prompts has \d+",
    r"^rows: expected an array of \d+ objects",
    r"^input_ids: has \d+ rows, prompts has \d+",
    r"^(input_ids|attention_mask)\[\d+\]: has \d+ ids, row 0 has \d+",
    r"^input_ids\[\d+\]: has \d+ real tokens \(attention_mask 1s\), more than",
]


@schemathesis.check
def documented_refusal(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code in (401, 404, 405):
        return None
    if not 400 <= response.status_code < 500:
        return None
    body = json.loads(response.content)
    error = body["error"]
    if body.get("type") == "error":  # Anthropic's shape
        if any(re.match(rule, error["message"]) for rule in MESSAGES_RULES):
            return None
    elif "code" in error:
        if error["code"] in GATEWAY_CODES:
            return None
    elif any(re.match(rule, error["message"]) for rule in REWARD_RULES):
        return None
    raise AssertionError(
        f"a request the document allows was refused for a reason it does not name: {response.status_code} {error}"
    )


if os.environ.get("SHIFU_FUZZ_SESSIONS"):

    @schemathesis.auth(refresh_interval=None)
    class FreshSession:
        """Each request's API key: a new session of the recording gateway."""

        def get(self, case, ctx):
            url = os.environ["SHIFU_FUZZ_SESSIONS"] + "/rl/start_session"
            req = urllib.request.Request(url, data=b"{}", method="POST")
            req.add_header("Content-Type", "application/json")
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())["session_key"]

        def set(self, case, data, ctx):
            case.headers = case.headers or {}
            case.headers["Authorization"] = f"Bearer {data}"

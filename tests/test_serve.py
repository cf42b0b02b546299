"""shifu serve and RemoteReward: real servers on 127.0.0.1 (uvicorn in a thread, and once the `shifu serve`
command), real tiny reward models, ensembles and rule rewards; scores checked bit for bit against the
in-process RewardSource; malformed, oversized, unauthorised and slow requests; a service that is down,
answers garbage, or dies and comes back. Only loopback addresses are used.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

pytest.importorskip("starlette", reason="pip install 'shifu-rlhf[serve]'")
uvicorn = pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from shifu.cli import main as cli  # noqa: E402
from shifu.errors import ConfigError  # noqa: E402
from shifu.models.loading import fuse_tanh_gelu, load_tokenizer  # noqa: E402
from shifu.models.padding import pad_left, pad_right  # noqa: E402
from shifu.models.scalar import ScalarModel  # noqa: E402
from shifu.rewards.ensemble import load_reward, write_manifest  # noqa: E402
from shifu.rewards.remote import (  # noqa: E402
    RemoteReward,
    RewardServiceError,
    RewardServiceUnavailable,
    backoff_delays,
    can_send_token_ids,
    tokenizer_fingerprint,
)
from shifu.rewards.sources import RewardSource, same_tokenizer  # noqa: E402
from shifu.serve.app import create_app  # noqa: E402
from shifu.serve.batcher import Batcher, split_rows, stack_blocks  # noqa: E402
from shifu.serve.served import load_served  # noqa: E402
from shifu.serve.server import bind_socket, is_loopback, main, socket_url  # noqa: E402

TOKEN = "s3cret-token"
PROMPTS = [
    "the movie was",
    "tell me a story about",
    "hello there, how are you",
    "what is two plus three?",
    "the film",
    "user: hi assistant:",
    "a cat",
    "review:",
    "the acting was good and the plot",
    "today",
]
RESPONSES = [
    " great and good",
    " a cat and a dog today, the end",
    " fine",
    " the answer is five",
    " was bad and boring, a terrible plot",
    " hello!",
    " and a dog",
    " great great",
    " was great",
    " i am fine, how are you today? the movie was good",
]
ROWS = [{"bonus": i / 4} for i in range(len(PROMPTS))]


# ------------------------------------------------------------------------------- reward functions
def keyword_reward(prompts, responses, rows):
    """Rule reward served by name ('test_serve:keyword_reward'): 'great' counts + the row's bonus."""
    return [r.count("great") + 0.1 * len(p) + row["bonus"] for p, r, row in zip(prompts, responses, rows)]


def per_char_reward(prompts, responses, rows):
    """A process reward: one value per response character (1 for 'a')."""
    return [[1.0 if c == "a" else 0.0 for c in r] for r in responses]


def step_reward(prompts, responses, rows):
    """A process reward in shifu's steps format (a step at each 'e') for responses with an 'a', a number
    for the others (the choice depends on the row alone: requests split the rows anywhere)."""
    out: list = []
    for r in responses:
        steps = [[j + 1, 0.5] for j, c in enumerate(r) if c == "e"] or [[len(r), -1.0]]
        out.append(steps if "a" in r else float(len(r)))
    return out


def bad_step_reward(prompts, responses, rows):
    """Steps whose end runs past the response."""
    return [[[99, 1.0]] for _ in responses]


def broken_reward(prompts, responses, rows):
    raise ValueError("no judge today")


# ------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def running(app, port: int = 0):
    """uvicorn serving ``app`` on 127.0.0.1 in a thread; yields the URL; stops it on exit."""
    sock = bind_socket("127.0.0.1", port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield socket_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def raw(url, method, path, body=None, headers=None, chunked=False):
    """One request with http.client; returns (status, decoded JSON body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def rollout_ids(tok, prompts, responses):
    """(B, P + R) ids as a rollout lays them out: left-padded prompts, right-padded responses + EOS."""
    p = pad_left([tok(x, add_special_tokens=False)["input_ids"] for x in prompts], tok.pad_token_id)
    r = pad_right(
        [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in responses],
        tok.pad_token_id,
    )
    return torch.cat([p["input_ids"], r["input_ids"]], 1), torch.cat(
        [p["attention_mask"], r["attention_mask"]], 1
    )


def trainer_scored(path):
    """A reward model as a trainer holds it in process (shifu ppo fuses the tanh-GELU, as the server does)."""
    return fuse_tanh_gelu(load_reward(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A causal reward model on the tiny GPT-2 trunk with a fitted-looking normalisation (gain/bias)."""
    path = tmp_path_factory.mktemp("rm")
    model = ScalarModel.from_backbone(tiny_model_dir, seed=0)
    model.gain.fill_(1.7)
    model.bias.fill_(-0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ensemble_dir(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ens")
    members = []
    for k in range(2):
        model = ScalarModel.from_backbone(tiny_model_dir, seed=10 + k)
        model.gain.fill_(1.0 + k)
        model.save_pretrained(root / f"member-{k}")
        members.append(root / f"member-{k}")
    write_manifest(root / "ensemble", members, "mean_minus_std", 0.5)
    return root / "ensemble"


@pytest.fixture(scope="module")
def policy_tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def rm_url(rm_dir):
    """An --exact server: one forward per request as sent (scores equal in-process bit for bit)."""
    with running(create_app(load_served(str(rm_dir)), exact=True)) as url:
        yield url


@pytest.fixture(scope="module")
def merged_url(rm_dir):
    """A merging server (the default): concurrent requests share forwards."""
    with running(create_app(load_served(str(rm_dir)))) as url:
        yield url


def assert_merged_close(got, want):
    """Merged forwards equal in-process scores up to float32 summation order (a row's place in a batch
    moves its score by a few units in the last place): the tolerance this module states."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def guarded_url(rm_dir):
    """A server with a token, a 64 KiB body limit and a 1 s body timeout (the fault tests' target)."""
    app = create_app(load_served(str(rm_dir)), token=TOKEN, max_body_bytes=64 * 1024, body_timeout_s=1.0)
    with running(app) as url:
        yield url


# -------------------------------------------------------------------------------- equal to in process
@pytest.mark.integration
def test_text_path_scores_equal_in_process_bit_for_bit(rm_url, rm_dir):
    local = RewardSource(model=trainer_scored(rm_dir), micro_batch=4)
    with RemoteReward(rm_url, batch_size=4) as remote:
        assert not remote.token_path  # no policy tokenizer given: text
        got = remote(PROMPTS, RESPONSES, ROWS)
    want = local(PROMPTS, RESPONSES, ROWS)
    assert got.dtype == torch.float32 and got.shape == (len(PROMPTS),)
    assert torch.equal(got, want), (got - want).abs().max()
    assert got.std() > 0  # the model tells the responses apart: equality is not 0 == 0


@pytest.mark.integration
def test_token_path_scores_equal_in_process_bit_for_bit(rm_url, rm_dir, policy_tok):
    ids, mask = rollout_ids(policy_tok, PROMPTS, RESPONSES)
    local = RewardSource(model=trainer_scored(rm_dir), policy_tokenizer=policy_tok, micro_batch=3)
    assert local.token_path
    with RemoteReward(rm_url, policy_tokenizer=policy_tok, batch_size=3) as remote:
        assert remote.token_path
        got = remote(PROMPTS, RESPONSES, ROWS, ids, mask)
    want = local(PROMPTS, RESPONSES, ROWS, ids, mask)
    assert torch.equal(got, want), (got - want).abs().max()
    # the token path scores the rollout's ids, not re-tokenised text: the text path differs (left padding)
    assert not torch.equal(got, local.model.score_texts(PROMPTS, RESPONSES, batch_size=3))


@pytest.mark.integration
def test_concurrent_clients_get_their_own_scores(merged_url, rm_dir, policy_tok):
    ids, mask = rollout_ids(policy_tok, PROMPTS, RESPONSES)
    local = RewardSource(model=trainer_scored(rm_dir), policy_tokenizer=policy_tok, micro_batch=2)
    want_tok = local(PROMPTS, RESPONSES, ROWS, ids, mask)
    want_text = RewardSource(model=local.model, micro_batch=2)(PROMPTS, RESPONSES, ROWS)
    remote_tok = RemoteReward(merged_url, policy_tokenizer=policy_tok, batch_size=2)
    remote_text = RemoteReward(merged_url, batch_size=2)
    assert remote_tok.token_path and not remote_text.token_path

    def client(i):
        if i % 2:
            assert_merged_close(remote_tok(PROMPTS, RESPONSES, ROWS, ids, mask), want_tok)
        else:
            assert_merged_close(remote_text(PROMPTS, RESPONSES, ROWS), want_text)
        return True

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(client, range(12)))
    health = remote_text.health()
    assert health["status"] == "ok" and health["pending"] == 0 and health["rows"] == 12 * len(PROMPTS)
    assert health["forwards"] <= health["requests"] == 12 * 5
    remote_tok.close()
    remote_text.close()


@pytest.mark.integration
def test_ensemble_served_equals_in_process(ensemble_dir, policy_tok):
    local_model = trainer_scored(ensemble_dir)
    ids, mask = rollout_ids(policy_tok, PROMPTS, RESPONSES)
    with running(create_app(load_served(str(ensemble_dir)), exact=True)) as url:
        text = RemoteReward(url, batch_size=5)
        tokens = RemoteReward(url, policy_tokenizer=policy_tok, batch_size=5)
        meta = text.metadata
        assert meta["kind"] == "ensemble" and tokens.token_path
        assert meta["ensemble"] == {
            "members": 2,
            "aggregate": "mean_minus_std",
            "std_coef": 0.5,
            "one_tokenizer": True,
        }
        assert [n["gain"] for n in meta["normalisation"]] == [1.0, 2.0]
        got_text = text(PROMPTS, RESPONSES, ROWS)
        got_tok = tokens(PROMPTS, RESPONSES, ROWS, ids, mask)
    assert torch.equal(got_text, RewardSource(model=local_model, micro_batch=5)(PROMPTS, RESPONSES, ROWS))
    local_tok = RewardSource(model=local_model, policy_tokenizer=policy_tok, micro_batch=5)
    assert torch.equal(got_tok, local_tok(PROMPTS, RESPONSES, ROWS, ids, mask))


@pytest.mark.integration
def test_rule_reward_gets_rows_and_equals_in_process():
    with running(create_app(load_served("test_serve:keyword_reward"))) as url:
        remote = RemoteReward(url, batch_size=4)
        assert remote.metadata["kind"] == "function" and remote.metadata["tokenizer"] is None
        got = remote(PROMPTS, RESPONSES, ROWS)
    want = RewardSource(function=keyword_reward)(PROMPTS, RESPONSES, ROWS)
    assert torch.equal(got, want) and want[-3] > want[-4]  # 'great great' + its bonus


@pytest.mark.integration
def test_process_reward_returns_per_token_scores():
    with running(create_app(load_served("test_serve:per_char_reward"))) as url:
        remote = RemoteReward(url, batch_size=3)
        per_token = remote.token_scores(PROMPTS, RESPONSES, ROWS)
        assert [t.tolist() for t in per_token] == per_char_reward(PROMPTS, RESPONSES, ROWS)
        with pytest.raises(RewardServiceError, match="per-token"):
            remote(PROMPTS, RESPONSES, ROWS)


@pytest.mark.integration
def test_process_reward_steps_travel_as_in_process(policy_tok):
    """A function returning shifu's steps ([[end, reward], ...]) for some responses and a number for others:
    the client gets the same (scores, steps) as RewardSource in process, and a total per response."""
    from shifu.rewards.sources import RewardSource

    local = RewardSource(function=step_reward)
    with running(create_app(load_served("test_serve:step_reward"))) as url:
        remote = RemoteReward(url, batch_size=3)
        got_scores, got_steps = remote.score_with_steps(PROMPTS, RESPONSES, ROWS)
        want_scores, want_steps = local.score_with_steps(PROMPTS, RESPONSES, ROWS)
        assert torch.equal(got_scores, want_scores) and got_steps == want_steps and any(want_steps)
        assert torch.equal(remote(PROMPTS, RESPONSES, ROWS), local(PROMPTS, RESPONSES, ROWS))
    with running(create_app(load_served("test_serve:bad_step_reward"))) as url:
        with pytest.raises(RewardServiceError, match=rf"{url}.*response 0, step 0: end 99 must be"):
            RemoteReward(url, retries=0).score_with_steps(PROMPTS, RESPONSES, ROWS)


@pytest.mark.integration
def test_a_failing_reward_function_is_a_clear_500_and_the_server_lives_on():
    with running(create_app(load_served("test_serve:broken_reward"))) as url:
        remote = RemoteReward(url, retries=0)
        with pytest.raises(RewardServiceError, match="HTTP 500.*ValueError: no judge today") as e:
            remote(PROMPTS, RESPONSES, ROWS)
        assert url in str(e.value)
        assert remote.health()["status"] == "ok"


@pytest.mark.integration
def test_metadata_fingerprint_decides_the_token_path(rm_url, policy_tok, tiny_model_dir_pad_eos):
    with RemoteReward(rm_url) as remote:
        meta = remote.metadata
    assert (
        meta["api"] == 1
        and meta["kind"] == "model"
        and meta["is_causal"]
        and meta["accepts"] == ["text", "tokens"]
    )
    assert meta["normalisation"] == {"gain": pytest.approx(1.7), "bias": pytest.approx(-0.3)}
    assert meta["tokenizer"]["fingerprint"] == tokenizer_fingerprint(policy_tok)
    assert meta["limits"]["max_batch_tokens"] == 16384 and "shifu_version" in meta
    # the tiny GPT-2 trunk has 256 positions: token rows hold at most 256 real tokens, text pairs too
    assert (meta["max_length"], meta["max_positions"], meta["vocab_rows"]) == (256, 256, VOCAB_ROWS)
    other = load_tokenizer(tiny_model_dir_pad_eos)  # same merges, no <pad>: another vocabulary
    assert not same_tokenizer(other, policy_tok) and not can_send_token_ids(meta, other)
    assert can_send_token_ids(meta, policy_tok) and not can_send_token_ids(meta, None)
    assert not can_send_token_ids(meta | {"is_causal": False}, policy_tok)


# ------------------------------------------------------------------------------ refused requests
@pytest.mark.integration
def test_token_is_required_and_checked(guarded_url):
    assert raw(guarded_url, "GET", "/health")[0] == 200  # health needs no token
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
        status, body = raw(guarded_url, "GET", "/v1/metadata", headers=headers)
        assert status == 401 and body["error"]["field"] == "Authorization"
    body = json.dumps({"prompts": ["a"], "responses": ["b"]})
    status, _ = raw(guarded_url, "POST", "/v1/score", body, {"Content-Type": "application/json"})
    assert status == 401
    with pytest.raises(RewardServiceError, match="rejected the token") as e:
        RemoteReward(guarded_url, token="nope")
    assert guarded_url in str(e.value)
    assert RemoteReward(guarded_url, token=TOKEN)(PROMPTS[:2], RESPONSES[:2], ROWS[:2]).shape == (2,)


VOCAB_ROWS = 378  # the tiny tokenizer of conftest.py: rows of the reward model's input embedding
DEEP = 1
for _ in range(70):
    DEEP = [DEEP]
DEEP_FIELD = "rows[0].x" + "[0]" * 61  # body 1, rows 2, rows[0] 3, x 4: level 65 is one too deep

BAD = [
    # (case, body, extra headers, status, field)
    ("malformed JSON", b'{"prompts": ["a"', {}, 400, "body"),
    ("not UTF-8", b'{"prompts": ["\xff"]}', {}, 400, "body"),
    ("not an object", b"[1, 2]", {}, 422, "body"),
    ("a string body", b'"score me"', {}, 422, "body"),
    ("empty body", b"", {}, 400, "body"),
    ("nothing to score", {}, {}, 422, "prompts"),
    ("missing field", {"prompts": ["a"]}, {}, 422, "responses"),
    ("unknown field", {"prompts": ["a"], "responses": ["b"], "response": ["b"]}, {}, 422, "response"),
    ("wrong type", {"prompts": ["a", 3], "responses": ["b", "c"]}, {}, 422, "prompts[1]"),
    ("not a list", {"prompts": "a", "responses": "b"}, {}, 422, "prompts"),
    ("length mismatch", {"prompts": ["a", "b"], "responses": ["c"]}, {}, 422, "responses"),
    ("bad rows", {"prompts": ["a"], "responses": ["b"], "rows": [1]}, {}, 422, "rows[0]"),
    ("ragged ids", {"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}, {}, 422, "input_ids[1]"),
    ("float id", {"input_ids": [[1, 2.5]], "attention_mask": [[1, 1]]}, {}, 422, "input_ids[0][1]"),
    ("bool id", {"input_ids": [[1, True]], "attention_mask": [[1, 1]]}, {}, 422, "input_ids[0][1]"),
    ("id outside vocab", {"input_ids": [[1, 99999]], "attention_mask": [[1, 1]]}, {}, 422, "input_ids[0][1]"),
    ("mask shape", {"input_ids": [[1, 2]], "attention_mask": [[1]]}, {}, 422, "attention_mask"),
    ("mask not 0/1", {"input_ids": [[1, 2]], "attention_mask": [[1, 2]]}, {}, 422, "attention_mask[0][1]"),
    ("mask without token", {"input_ids": [[1, 2]], "attention_mask": [[0, 0]]}, {}, 422, "attention_mask[0]"),
    ("ids without mask", {"input_ids": [[1, 2]]}, {}, 422, "attention_mask"),
    (
        "not JSON content",
        {"prompts": ["a"], "responses": ["b"]},
        {"Content-Type": "text/plain"},
        415,
        "Content-Type",
    ),
    ("oversized body", {"prompts": ["x" * 100_000], "responses": ["b"]}, {}, 413, "body"),
    # out-of-range ids: 10**30 overflowed int64 (a 500), a negative id, one past the embedding's rows
    ("id beyond int64", {"input_ids": [[1, 10**30]], "attention_mask": [[1, 1]]}, {}, 422, "input_ids[0][1]"),
    ("negative id", {"input_ids": [[-1, 2]], "attention_mask": [[1, 1]]}, {}, 422, "input_ids[0][0]"),
    (
        "id = vocab rows",
        {"input_ids": [[1, VOCAB_ROWS]], "attention_mask": [[1, 1]]},
        {},
        422,
        "input_ids[0][1]",
    ),
    (
        "a 5000-digit id",
        b'{"input_ids": [[1' + b"0" * 5000 + b']], "attention_mask": [[1]]}',
        {},
        400,
        "body",
    ),
    # not JSON by RFC 8259 (Python's json module reads these by default)
    ("NaN", b'{"prompts": ["a"], "responses": ["b"], "rows": [{"x": NaN}]}', {}, 400, "rows[0].x"),
    (
        "Infinity",
        b'{"prompts": ["a"], "responses": ["b"], "rows": [{"x": [Infinity]}]}',
        {},
        400,
        "rows[0].x[0]",
    ),
    ("-Infinity", b'{"prompts": [-Infinity], "responses": ["b"]}', {}, 400, "prompts[0]"),
    (
        "number beyond a double",
        b'{"prompts": ["a"], "responses": ["b"], "rows": [{"x": 1e999}]}',
        {},
        400,
        "rows[0].x",
    ),
    ("duplicate key", b'{"prompts": ["a"], "responses": ["b"], "prompts": ["c"]}', {}, 400, "prompts"),
    (
        "duplicate nested key",
        b'{"prompts": ["a"], "responses": ["b"], "rows": [{"k": 1, "k": 2}]}',
        {},
        400,
        "rows[0].k",
    ),
    ("lone surrogate", b'{"prompts": ["\\ud800"], "responses": ["b"]}', {}, 400, "prompts[0]"),
    (
        "surrogate key",
        b'{"prompts": ["a"], "responses": ["b"], "rows": [{"\\udfff": 1}]}',
        {},
        400,
        'rows[0]["\\udfff"]',
    ),
    ("nested too deep", {"prompts": ["a"], "responses": ["b"], "rows": [{"x": DEEP}]}, {}, 400, DEEP_FIELD),
    ("nested past the parser", b"[" * 30_000 + b"]" * 30_000, {}, 400, "body"),
    # content types and encodings
    ("no content type", {"prompts": ["a"], "responses": ["b"]}, {"Content-Type": ""}, 415, "Content-Type"),
    (
        "form data",
        b"prompts=a&responses=b",
        {"Content-Type": "application/x-www-form-urlencoded"},
        415,
        "Content-Type",
    ),
    (
        "not UTF-8 charset",
        {"prompts": ["a"], "responses": ["b"]},
        {"Content-Type": "application/json; charset=latin-1"},
        415,
        "Content-Type",
    ),
    (
        "gzip body",
        {"prompts": ["a"], "responses": ["b"]},
        {"Content-Encoding": "gzip"},
        415,
        "Content-Encoding",
    ),
    # wrong types at every field
    ("null prompts", {"prompts": None, "responses": ["b"]}, {}, 422, "prompts"),
    ("responses item", {"prompts": ["a", "b"], "responses": ["c", ["d"]]}, {}, 422, "responses[1]"),
    ("rows an object", {"prompts": ["a"], "responses": ["b"], "rows": {"x": 1}}, {}, 422, "rows"),
    ("rows with ids", {"input_ids": [[1]], "attention_mask": [[1]], "rows": [{}]}, {}, 422, "rows"),
    ("ids a string", {"input_ids": "1 2", "attention_mask": [[1, 1]]}, {}, 422, "input_ids"),
    ("ids row a number", {"input_ids": [5], "attention_mask": [[1]]}, {}, 422, "input_ids[0]"),
    ("empty ids row", {"input_ids": [[]], "attention_mask": [[]]}, {}, 422, "input_ids[0]"),
    ("mask row an object", {"input_ids": [[1]], "attention_mask": [{"0": 1}]}, {}, 422, "attention_mask[0]"),
    ("float mask", {"input_ids": [[1]], "attention_mask": [[1.0]]}, {}, 422, "attention_mask[0][0]"),
    ("mask rows", {"input_ids": [[1], [2]], "attention_mask": [[1]]}, {}, 422, "attention_mask"),
    (
        "ids and prompts rows",
        {"prompts": ["a"], "responses": ["b"], "input_ids": [[1], [2]], "attention_mask": [[1], [1]]},
        {},
        422,
        "input_ids",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize("case,body,headers,status,field", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_a_clear_4xx(guarded_url, case, body, headers, status, field):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    all_headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"} | headers
    all_headers = {k: v for k, v in all_headers.items() if v}
    got, answer = raw(guarded_url, "POST", "/v1/score", data, all_headers)
    err = answer["error"]
    assert (got, err["status"], err["field"]) == (status, status, field), err
    assert field.split("[")[0].split(".")[0] in err["message"]  # the message names the field too
    assert raw(guarded_url, "GET", "/health")[0] == 200  # and the server lives on


@pytest.mark.integration
def test_empty_requests_get_no_scores(guarded_url):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for body in ({"prompts": [], "responses": []}, {"input_ids": [], "attention_mask": []}):
        assert raw(guarded_url, "POST", "/v1/score", json.dumps(body), auth) == (200, {"scores": []})


@pytest.mark.integration
def test_oversized_chunked_body_without_length_and_unknown_routes(guarded_url):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    chunks = iter([b'{"prompts": ["', b"x" * 40_000, b"x" * 40_000, b'"], "responses": ["b"]}'])
    status, answer = raw(guarded_url, "POST", "/v1/score", chunks, auth, chunked=True)
    assert status == 413 and answer["error"]["field"] == "body"
    status, answer = raw(guarded_url, "GET", "/v1/nothing", headers=auth)
    assert status == 404 and "/v1/nothing" in answer["error"]["message"]
    assert answer["error"]["field"] == "path"
    status, answer = raw(guarded_url, "GET", "/v1/score", headers=auth)
    assert status == 405 and "GET /v1/score" in answer["error"]["message"]
    assert answer["error"]["field"] == "method"
    assert raw(guarded_url, "GET", "/health")[0] == 200


@pytest.mark.integration
def test_token_ids_to_a_reward_function_are_refused():
    with running(create_app(load_served("test_serve:keyword_reward"))) as url:
        body = json.dumps({"input_ids": [[1, 2]], "attention_mask": [[1, 1]]})
        status, answer = raw(url, "POST", "/v1/score", body, {"Content-Type": "application/json"})
    assert status == 422 and answer["error"]["field"] == "prompts" and "text" in answer["error"]["message"]


@pytest.mark.integration
def test_a_slow_client_gets_408_while_others_are_served(guarded_url, rm_dir):
    host, port = urlsplit(guarded_url).hostname, urlsplit(guarded_url).port
    slow = socket.create_connection((host, port), timeout=30)
    head = (
        f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    )
    slow.sendall(head.encode() + b'{"prompts": [')  # ... and nothing more
    with RemoteReward(guarded_url, token=TOKEN, batch_size=4) as remote:
        got = remote(PROMPTS, RESPONSES, ROWS)  # served while the slow body is still pending
    assert_merged_close(
        got, RewardSource(model=trainer_scored(rm_dir), micro_batch=4)(PROMPTS, RESPONSES, ROWS)
    )
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = slow.recv(4096)
        if not chunk:
            break
        answer += chunk
    slow.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--body-timeout" in answer
    assert raw(guarded_url, "GET", "/health")[0] == 200


# --------------------------------------------------------------------------------- client failures
@pytest.mark.unit
def test_backoff_schedule_is_bounded():
    assert backoff_delays(5, 0.5, 3.0) == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_delays(0, 0.5, 3.0) == []


@pytest.mark.unit
def test_service_down_is_a_clear_error_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardServiceUnavailable, match="after 3 attempts") as e:
        RemoteReward(url, retries=2, backoff_s=0.01)
    msg = str(e.value)
    assert url in msg and "ConnectionRefusedError" in msg and "shifu serve" in msg
    with pytest.raises(ConfigError, match="must look like http"):
        RemoteReward("127.0.0.1:8000")


class _Broken(http.server.BaseHTTPRequestHandler):
    """A stand-in for a broken service (the real one never answers like this): metadata is right,
    /v1/score answers with ``server.mode``; ``server.calls`` counts score requests."""

    def log_message(self, *args):
        pass

    def _send(self, status, body: bytes, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(
            200, json.dumps({"api": 1, "kind": "model", "is_causal": False, "tokenizer": None}).encode()
        )

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.calls += 1
        mode = self.server.mode
        if mode == "html":
            self._send(200, b"<html>hello</html>", "text/html")
        elif mode == "short":
            self._send(200, json.dumps({"scores": [1.0]}).encode())
        elif mode == "strings":
            self._send(200, json.dumps({"scores": ["1.0", "2.0"]}).encode())
        elif mode == "busy_twice" and self.server.calls <= 2:
            self._send(503, json.dumps({"error": {"status": 503, "field": None, "message": "busy"}}).encode())
        else:
            self._send(200, json.dumps({"scores": [0.5, None]}).encode())


@contextlib.contextmanager
def broken_service(mode):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    server.mode, server.calls = mode, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode,match", [("html", "not a JSON object"), ("short", "1 items"), ("strings", "2 numbers")]
)
def test_garbage_answers_name_the_url(mode, match):
    with broken_service(mode) as (server, url):
        remote = RemoteReward(url, retries=3, backoff_s=0.01)
        with pytest.raises(RewardServiceError, match=match) as e:
            remote(["a", "b"], ["c", "d"], [{}, {}])
    assert url in str(e.value) and server.calls == 1  # garbage is not retried


@pytest.mark.integration
def test_busy_answers_are_retried_and_nulls_are_nan():
    with broken_service("busy_twice") as (server, url):
        got = RemoteReward(url, retries=2, backoff_s=0.01)(["a", "b"], ["c", "d"], [{}, {}])
        assert server.calls == 3
        assert got[0] == 0.5 and torch.isnan(got[1])
    with broken_service("busy_twice") as (server, url):
        with pytest.raises(RewardServiceUnavailable, match="after 2 attempts.*HTTP 503 busy"):
            RemoteReward(url, retries=1, backoff_s=0.01)(["a", "b"], ["c", "d"], [{}, {}])


@pytest.mark.integration
def test_a_service_that_speaks_no_http_is_named():
    class Hello(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            self.request.sendall(b"hello, I am not HTTP\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RewardServiceError, match="did not answer in HTTP") as e:
            RemoteReward(url, retries=2, backoff_s=0.01)
        assert url in str(e.value)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
def test_service_that_dies_mid_run_stops_the_client_and_serves_again_once_back(rm_dir):
    served = load_served(str(rm_dir))
    port = free_port()
    with running(create_app(served, exact=True), port=port) as url:
        remote = RemoteReward(url, batch_size=4, retries=1, backoff_s=0.01)
        before = remote(PROMPTS, RESPONSES, ROWS)
    with pytest.raises(RewardServiceUnavailable, match=f"{url}/v1/score did not answer after 2 attempts"):
        remote(PROMPTS, RESPONSES, ROWS)
    with running(create_app(served, exact=True), port=port):  # back on the same address: the client goes on
        assert torch.equal(remote(PROMPTS, RESPONSES, ROWS), before)
    remote.close()


# ------------------------------------------------------------------------------------------ batching
@pytest.mark.unit
def test_batcher_merges_pending_requests_within_the_token_budget(rm_dir):
    served = load_served(str(rm_dir))
    enc = [served.model.encode(PROMPTS[i : i + 2], RESPONSES[i : i + 2]) for i in range(0, 10, 2)]
    blocks = [(e["input_ids"], e["attention_mask"]) for e in enc]
    assert len({b[0].shape[1] for b in blocks}) > 1  # requests of different widths are merged too
    alone = [served.score_ids(*b) for b in blocks]

    async def submit_all(budget, merge=True):
        with ThreadPoolExecutor(1) as ex:
            batcher = Batcher(served.score_ids, budget, ex, merge=merge, pad_id=served.pad_id)
            # all five are queued before the batching task runs again: what a busy server sees
            out = await asyncio.gather(*[batcher.score_blocks([b]) for b in blocks])
            await batcher.close()
            return out, batcher.stats

    out, stats = asyncio.run(submit_all(10**6))
    assert stats == {"requests": 5, "forwards": 1, "rows": 10}  # all pending: one forward
    for o, a in zip(out, alone):
        assert_merged_close(o, a)
    width = max(b[0].shape[1] for b in blocks)
    out, stats = asyncio.run(submit_all(4 * width))  # at most 4 rows of the widest per forward
    assert stats["forwards"] == 3 and all(o.shape == (2,) for o in out)  # requests 1+2, 3+4, 5
    out, stats = asyncio.run(submit_all(1))  # a budget below one row: every row alone
    assert stats["forwards"] == 10
    out, stats = asyncio.run(submit_all(1, merge=False))  # --exact: each request as sent
    assert stats["forwards"] == 5 and all(torch.equal(o, a) for o, a in zip(out, alone))


@pytest.mark.unit
def test_split_rows_and_stack_blocks():
    ids = torch.arange(12).reshape(4, 3)
    parts = split_rows(ids, ids, 7)  # 7 tokens: 2 rows of width 3
    assert [p[0].tolist() for p in parts] == [ids[:2].tolist(), ids[2:].tolist()]
    a = (torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
    b = (torch.tensor([[7, 8, 9], [3, 4, 2]]), torch.tensor([[1, 1, 1], [0, 1, 0]]))
    got_ids, got_mask = stack_blocks([a, b], pad_id=1)
    assert got_ids.tolist() == [[5, 6, 1], [7, 8, 9], [3, 4, 2]]
    assert got_mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 1, 0]]


# ------------------------------------------------------------------------------------------ the CLI
@pytest.mark.integration
def test_cli_refuses_an_open_address_without_token_and_an_unknown_source(rm_dir, capsys):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.org")
    with pytest.raises(ConfigError, match="not a loopback address.*--token"):
        main([str(rm_dir), "--host", "0.0.0.0"])
    assert cli.main(["serve", "no/such/dir"]) == 2
    assert "neither a reward model directory nor a reward function" in capsys.readouterr().err


@pytest.mark.integration
def test_shifu_serve_command_end_to_end(rm_dir, monkeypatch):
    """The real command in its own process: prints its URL, scores like in process, stops on SIGTERM."""
    monkeypatch.setenv("SHIFU_SERVE_TOKEN", TOKEN)  # read by the server and by the client
    env = os.environ | {"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "shifu",
        "serve",
        str(rm_dir),
        "--port",
        "0",
        "--exact",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "token required" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        with RemoteReward(url, batch_size=4) as remote:
            got = remote(PROMPTS, RESPONSES, ROWS)
        assert torch.equal(
            got, RewardSource(model=trainer_scored(rm_dir), micro_batch=4)(PROMPTS, RESPONSES, ROWS)
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: the exit is SIGTERM's
    assert rc in (0, -signal.SIGTERM) and "Traceback" not in proc.stderr.read()

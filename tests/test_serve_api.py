"""The HTTP API of ``shifu serve`` as a contract: the OpenAPI document describes the real app, a model with 16
positions refuses longer rows with a 422 (not an IndexError 500) and reports them in /v1/metadata, and a
property-based fuzz (hypothesis) of the real ``shifu serve`` command on 127.0.0.1 finds no request that gets
a 5xx, stops the server or logs a traceback; good requests, during and after the fuzzing, score as in
process. Every answer is checked against the document's schemas.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

pytest.importorskip("starlette", reason="pip install 'shifu-rlhf[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
hypothesis = pytest.importorskip("hypothesis", reason="pip install 'shifu-rlhf[dev]'")
from conftest import build_tiny_tokenizer  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_serve import VOCAB_ROWS, raw, rollout_ids, trainer_scored  # noqa: E402

from shifu.models.loading import build_tiny_gpt2, load_tokenizer  # noqa: E402
from shifu.models.scalar import ScalarModel  # noqa: E402
from shifu.rewards.remote import RemoteReward  # noqa: E402
from shifu.rewards.sources import RewardSource  # noqa: E402
from shifu.serve.app import create_app, openapi_document  # noqa: E402
from shifu.serve.served import load_served  # noqa: E402
from shifu.serve.validation import SCORE_FIELDS  # noqa: E402

TOKEN = "fuzz-token"
POSITIONS = 16  # the reward model's context: rows of more real tokens are refused
MAX_BODY = 8192  # the fuzzed server's --max-body-bytes (oversized examples stay small)
FUZZ_EXAMPLES = 800  # generated requests, at most (half bad in each way, a quarter good) ...
FUZZ_SECONDS = 150.0  # ... and no more requests sent after this long
# short pairs: prompt + response + EOS fit the 16 positions, so the token path takes every row
PROMPTS = ["the movie", "a cat", "hi", "today", "review:", "the film was"]
RESPONSES = [" was great", " and a dog", " hello!", " fine", " great great", " bad and boring"]
ROWS = [{"i": i} for i in range(len(PROMPTS))]


# --------------------------------------------------------------------------- the document's schemas
def _is(value, name: str) -> bool:
    if name == "integer":
        return type(value) is int
    if name == "number":
        return type(value) in (int, float)
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool}
    return value is None if name == "null" else type(value) is kinds[name]


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def schema_error(value, schema: dict, doc: dict, path: str = "$") -> str | None:
    """The first way ``value`` breaks ``schema``, or None: the JSON Schema keywords the document uses
    ($ref, type, const, enum, bounds, items/prefixItems/contains, required/properties/additionalProperties/
    dependentRequired, anyOf, oneOf), checked here without a JSON Schema library."""
    if "$ref" in schema:
        node = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return schema_error(value, node, doc, path)
    types = schema.get("type")
    if types is not None and not any(_is(value, t) for t in ([types] if isinstance(types, str) else types)):
        return f"{path}: {value!r:.60} is not {types}"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{path}: {value!r:.60} is not {schema['const']!r}"
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return f"{path}: {value!r:.60} is not one of {schema['enum']}"
    if _is(value, "number") and (err := _number_error(value, schema, path)):
        return err
    if isinstance(value, list) and (err := _array_error(value, schema, doc, path)):
        return err
    if isinstance(value, dict) and (err := _object_error(value, schema, doc, path)):
        return err
    if "anyOf" in schema and all(schema_error(value, s, doc, path) for s in schema["anyOf"]):
        return f"{path}: matches none of anyOf"
    if "oneOf" in schema and sum(schema_error(value, s, doc, path) is None for s in schema["oneOf"]) != 1:
        return f"{path}: does not match exactly one of oneOf"
    return None


def _number_error(value, schema: dict, path: str) -> str | None:
    """:func:`schema_error` of a number: minimum, maximum, exclusiveMinimum."""
    if value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf):
        return f"{path}: {value} is out of bounds"
    if value <= schema.get("exclusiveMinimum", -math.inf):
        return f"{path}: {value} is not above {schema['exclusiveMinimum']}"
    return None


def _array_error(value: list, schema: dict, doc: dict, path: str) -> str | None:
    """:func:`schema_error` of an array: minItems, maxItems, prefixItems, items, contains."""
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf):
        return f"{path}: {len(value)} items"
    prefix = schema.get("prefixItems", [])
    for i, v in enumerate(value):
        sub = prefix[i] if i < len(prefix) else schema.get("items")
        if sub is not None and (err := schema_error(v, sub, doc, f"{path}[{i}]")):
            return err
    if "contains" in schema and all(schema_error(v, schema["contains"], doc) for v in value):
        return f"{path}: no item is {schema['contains']}"
    return None


def _object_error(value: dict, schema: dict, doc: dict, path: str) -> str | None:
    """:func:`schema_error` of an object: required, properties, additionalProperties, dependentRequired."""
    props = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in value:
            return f"{path}: '{key}' is missing"
    for key, v in value.items():
        if key in props:
            if err := schema_error(v, props[key], doc, f"{path}.{key}"):
                return err
        elif schema.get("additionalProperties", True) is False:
            return f"{path}: '{key}' is not allowed"
    for key, needs in schema.get("dependentRequired", {}).items():
        if key in value and any(n not in value for n in needs):
            return f"{path}: '{key}' needs {needs}"
    return None


def schema_of(doc: dict, path: str, method: str, status: int) -> dict:
    responses = doc["paths"][path][method]["responses"]
    answer = responses[str(status)]
    if "$ref" in answer:
        answer = doc["components"]["responses"][answer["$ref"].rsplit("/", 1)[1]]
    return answer["content"]["application/json"]["schema"]


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def short_rm_dir(tmp_path_factory) -> Path:
    """A causal reward model on a tiny GPT-2 trunk with 16 positions (the tokenizer of conftest.py)."""
    root = tmp_path_factory.mktemp("short_rm")
    tok = build_tiny_tokenizer()
    tok.save_pretrained(str(root / "trunk"))
    tok = load_tokenizer(root / "trunk")
    build_tiny_gpt2(tok, n_layer=2, n_embd=32, n_head=2, n_positions=POSITIONS, seed=1).save_pretrained(
        str(root / "trunk")
    )
    model = ScalarModel.from_backbone(root / "trunk", seed=2)
    model.gain.fill_(1.3)
    model.bias.fill_(0.2)
    model.save_pretrained(root / "rm")
    return root / "rm"


@pytest.fixture(scope="module")
def server(short_rm_dir, tmp_path_factory):
    """The real ``shifu serve`` command on 127.0.0.1 (merging, the default), a token, an 8 KiB body limit;
    yields (process, url, path of its stderr log)."""
    log = tmp_path_factory.mktemp("serve_log") / "stderr.txt"
    env = os.environ | {"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", "SHIFU_SERVE_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "shifu", "serve", str(short_rm_dir), "--port", "0", "--threads", "1"]
    cmd += ["--max-body-bytes", str(MAX_BODY), "--log-level", "warning"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, (line, log.read_text())
        yield proc, line.split(" on ")[1].split()[0], log
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def reference(short_rm_dir):
    """The same reward model in process, as a trainer holds it."""
    return trainer_scored(short_rm_dir)


@pytest.fixture(scope="module")
def doc(server):
    status, document = raw(server[1], "GET", "/openapi.json")
    assert status == 200
    return document


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def post(url, body, headers=AUTH):
    return raw(url, "POST", "/v1/score", body if isinstance(body, bytes) else json.dumps(body), headers)


def as_scores(values) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)


def assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---------------------------------------------------------------------------------- the document
def test_openapi_document_describes_the_served_app(server, doc, short_rm_dir):
    url = server[1]
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"] == "1"
    app = create_app(load_served(str(short_rm_dir)))
    routes = {r.path: sorted(m.lower() for m in r.methods - {"HEAD"}) for r in app.routes}
    assert routes == {path: sorted(ops) for path, ops in doc["paths"].items()}
    # the live document knows the served model; the packaged one is the same without it
    assert doc["components"]["schemas"]["TokenIds"]["items"]["items"]["maximum"] == VOCAB_ROWS - 1
    assert doc["info"]["x-shifu-served"]["max_positions"] == POSITIONS
    shipped = openapi_document()
    assert "maximum" not in shipped["components"]["schemas"]["TokenIds"]["items"]["items"]
    assert shipped["paths"] == doc["paths"]
    # what the server answers is what the document says
    status, meta = raw(url, "GET", "/v1/metadata", headers=AUTH)
    assert status == 200 and schema_error(meta, schema_of(doc, "/v1/metadata", "get", 200), doc) is None
    status, health = raw(url, "GET", "/health")
    assert status == 200 and schema_error(health, schema_of(doc, "/health", "get", 200), doc) is None
    status, err = raw(url, "GET", "/v1/metadata")
    assert status == 401 and schema_error(err, schema_of(doc, "/v1/metadata", "get", 401), doc) is None
    good = {"prompts": PROMPTS[:2], "responses": RESPONSES[:2]}
    assert schema_error(good, doc["components"]["schemas"]["ScoreRequest"], doc) is None
    status, answer = post(url, good)
    assert status == 200 and schema_error(answer, schema_of(doc, "/v1/score", "post", 200), doc) is None
    # and the schema checker used on every fuzzed answer is not a yes-machine
    assert schema_error({"scores": ["1"]}, schema_of(doc, "/v1/score", "post", 200), doc)
    assert schema_error({"prompts": ["a"]}, doc["components"]["schemas"]["ScoreRequest"], doc)
    assert schema_error({"error": {"status": 422}}, schema_of(doc, "/v1/score", "post", 422), doc)


# ------------------------------------------------------------------------- a model with 16 positions
def test_short_context_model_refuses_long_rows_and_reports_its_length(server, reference):
    proc, url, log = server
    status, meta = raw(url, "GET", "/v1/metadata", headers=AUTH)
    assert (meta["max_length"], meta["max_positions"], meta["vocab_rows"]) == (
        POSITIONS,
        POSITIONS,
        VOCAB_ROWS,
    )
    ids = [list(range(2, 22))]  # 20 ids, all real: 4 past the last position
    status, answer = post(url, {"input_ids": ids, "attention_mask": [[1] * 20]})
    assert status == 422 and answer["error"]["field"] == "input_ids[0]", answer
    assert "20 real tokens" in answer["error"]["message"] and "16 positions" in answer["error"]["message"]
    # a wide row with 16 real tokens is within the context (positions count the real tokens): scored
    mask = [[0] * 4 + [1] * 16]
    status, answer = post(url, {"input_ids": ids, "attention_mask": mask})
    assert status == 200
    want = reference.score(torch.tensor(ids), torch.tensor(mask))
    assert_close(as_scores(answer["scores"]), want.detach())
    # text longer than the context keeps its end, as in process
    long_prompt = "the movie was great and the acting was good " * 3
    status, answer = post(url, {"prompts": [long_prompt], "responses": [" fine"]})
    want = RewardSource(model=reference, micro_batch=1)([long_prompt], [" fine"], [{}])
    assert status == 200 and torch.equal(as_scores(answer["scores"]), want)
    assert proc.poll() is None and "Traceback" not in log.read_text()


# ------------------------------------------------------------------------------ the property fuzz
JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
)
# broken on purpose, each sure to be refused with a 4xx (None: anything but a 5xx)
MUTATIONS = (
    "id_out_of_range",
    "too_long",
    "mask_value",
    "mask_all_zero",
    "ragged",
    "drop_field",
    "unknown_field",
    "nan",
    "duplicate_key",
    "too_deep",
    "big_number",
    "surrogate",
    "oversized",
    "bad_utf8",
    "truncated",
    "content_type",
    "content_encoding",
    "no_token",
    "wrong_route",
    "wrong_type",
)
SURE_4XX = set(MUTATIONS) - {"wrong_type"}


@st.composite
def token_body(draw) -> dict:
    """(B, T) ids of the vocabulary with a 0/1 mask holding 1..16 contiguous real tokens per row, padded
    left or right (a rollout's layout); T may exceed the positions."""
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, POSITIONS + 6))
    ids = draw(
        st.lists(st.lists(st.integers(0, VOCAB_ROWS - 1), min_size=t, max_size=t), min_size=b, max_size=b)
    )
    mask = []
    for _ in range(b):
        n = draw(st.integers(1, min(t, POSITIONS)))
        start = draw(st.integers(0, t - n))
        mask.append([0] * start + [1] * n + [0] * (t - start - n))
    return {"input_ids": ids, "attention_mask": mask}


@st.composite
def text_body(draw) -> dict:
    n = draw(st.integers(0, 3))
    body = {
        "prompts": draw(st.lists(st.text(max_size=30), min_size=n, max_size=n)),
        "responses": draw(st.lists(st.text(max_size=30), min_size=n, max_size=n)),
    }
    if draw(st.booleans()):
        body["rows"] = draw(
            st.lists(st.dictionaries(st.text(max_size=5), JSON_VALUE, max_size=3), min_size=n, max_size=n)
        )
    return body


def _deep(levels: int):
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


@st.composite
def mutated(draw, label: str) -> dict:
    """A good request broken in one way (``label``): method, path, headers and body bytes."""
    body = draw(token_body() | text_body())
    case = {"label": label, "method": "POST", "path": "/v1/score", "headers": dict(AUTH), "data": None}
    body = _broken_body(draw, label, body)
    data = json.dumps(body, allow_nan=True, ensure_ascii=draw(st.booleans()))
    case["data"] = _broken_text(draw, label, body, data).encode("utf-8", "surrogatepass")
    _break_bytes_or_headers(draw, label, case)
    case["headers"] = {k: v for k, v in case["headers"].items() if v}
    return case


def _broken_body(draw, label: str, body: dict) -> dict:
    """:func:`mutated`'s request body, broken as ``label`` says (the labels that break the body's values)."""
    tokens = "input_ids" in body
    if label == "id_out_of_range":
        bad = draw(
            st.sampled_from([VOCAB_ROWS, -1]) | st.integers(VOCAB_ROWS, 2**80) | st.integers(-(2**80), -1)
        )
        body = body if tokens else draw(token_body())
        body["input_ids"][0][draw(st.integers(0, len(body["input_ids"][0]) - 1))] = bad
    elif label == "too_long":
        t = draw(st.integers(POSITIONS + 1, POSITIONS + 8))
        body = {"input_ids": [[3] * t], "attention_mask": [[1] * t]}
    elif label == "mask_value":
        body = body if tokens else draw(token_body())
        row = body["attention_mask"][0]
        row[draw(st.integers(0, len(row) - 1))] = draw(
            st.integers().filter(lambda v: v not in (0, 1))
            | st.floats(allow_nan=False)
            | st.none()
            | st.text()
        )
    elif label == "mask_all_zero":
        body = body if tokens else draw(token_body())
        body["attention_mask"][-1] = [0] * len(body["attention_mask"][-1])
    elif label == "ragged":
        body = body if tokens else draw(token_body())
        body[draw(st.sampled_from(["input_ids", "attention_mask"]))][0].append(1)
    elif label == "drop_field":
        del body[draw(st.sampled_from(sorted(k for k in body if k != "rows")))]
    elif label == "unknown_field":
        body[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in SCORE_FIELDS))] = draw(JSON_VALUE)
    elif label == "nan":
        body[draw(st.sampled_from(sorted(body)))] = [
            {"x": draw(st.sampled_from([math.nan, math.inf, -math.inf]))}
        ]
    elif label == "too_deep":
        body["rows"] = [{"x": _deep(draw(st.integers(64, 400)))}]
    elif label == "surrogate":
        body["prompts"] = [chr(draw(st.integers(0xD800, 0xDFFF)))]
        body["responses"] = ["x"]
    elif label == "oversized":
        body["prompts"], body["responses"] = ["x" * MAX_BODY], ["y"]
    elif label == "wrong_type":
        body[draw(st.sampled_from(sorted(body)))] = draw(JSON_VALUE)
    return body


def _broken_text(draw, label: str, body: dict, data: str) -> str:
    """:func:`mutated`'s JSON text ``data``, broken as ``label`` says (a duplicate key, a huge number, cut)."""
    if label == "duplicate_key":
        key = draw(st.sampled_from(sorted(body)))
        data = "{" + json.dumps(key) + ": " + json.dumps(body[key]) + ", " + data[1:]
    elif label == "big_number":
        data = data[:-1] + ', "rows": [{"n": 1' + "0" * draw(st.integers(4300, 6000)) + "}]}"
    elif label == "truncated":
        data = data[: draw(st.integers(0, len(data) - 1))]
    return data


def _break_bytes_or_headers(draw, label: str, case: dict) -> None:
    """:func:`mutated`'s bytes, headers or route, broken in ``case`` as ``label`` says."""
    if label == "bad_utf8":
        at = draw(st.integers(0, len(case["data"])))
        case["data"] = (
            case["data"][:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + case["data"][at:]
        )
    elif label == "content_type":
        case["headers"]["Content-Type"] = draw(
            st.sampled_from(
                [
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "application/json; charset=latin-1",
                    "multipart/form-data; boundary=x",
                    "application/jsonl",
                    "application/json-patch+json",
                ]
            )
        )
    elif label == "content_encoding":
        case["headers"]["Content-Encoding"] = draw(st.sampled_from(["gzip", "br", "deflate"]))
    elif label == "no_token":
        case["headers"]["Authorization"] = draw(st.sampled_from(["", "Bearer nope", TOKEN, "Basic eA=="]))
    elif label == "wrong_route":
        case["method"], case["path"] = draw(
            st.sampled_from(
                [
                    ("GET", "/v1/score"),
                    ("PUT", "/v1/score"),
                    ("DELETE", "/v1/score"),
                    ("POST", "/health"),
                    ("POST", "/v1/metadata"),
                    ("POST", "/v1/scores"),
                    ("POST", "/v2/score"),
                    ("PATCH", "/openapi.json"),
                ]
            )
        )


@st.composite
def good(draw) -> dict:
    body = draw(token_body() | text_body())
    return {
        "label": "good",
        "method": "POST",
        "path": "/v1/score",
        "headers": dict(AUTH),
        "body": body,
        "data": json.dumps(body, ensure_ascii=draw(st.booleans())).encode(),
    }


@st.composite
def anything(draw) -> dict:
    """Bytes, any JSON value, or an object over the request's field names with any values."""
    data = draw(
        st.binary(max_size=200)
        | JSON_VALUE.map(lambda v: json.dumps(v).encode())
        | st.dictionaries(st.sampled_from(SCORE_FIELDS), JSON_VALUE, max_size=5).map(
            lambda v: json.dumps(v).encode()
        )
    )
    return {"label": "anything", "method": "POST", "path": "/v1/score", "headers": dict(AUTH), "data": data}


def expected_scores(reference, body: dict) -> torch.Tensor:
    if "input_ids" in body:
        with torch.no_grad():
            return reference.score(torch.tensor(body["input_ids"]), torch.tensor(body["attention_mask"]))
    n = len(body["prompts"])
    if n == 0:
        return torch.zeros(0)
    rows = body.get("rows") or [{} for _ in range(n)]
    return RewardSource(model=reference, micro_batch=n)(body["prompts"], body["responses"], rows)


def check_answer(case: dict, status: int, answer: dict, doc: dict, reference, seen: collections.Counter):
    label = case["label"]
    seen[(label, status // 100 * 100)] += 1
    assert status < 500, (label, case["data"][:300], answer)
    if status == 200:
        assert label not in SURE_4XX, (label, case["data"][:300], answer)
        assert schema_error(answer, schema_of(doc, "/v1/score", "post", 200), doc) is None, answer
        if label == "good":  # each request scored alone: what in-process scoring gives
            assert_close(as_scores(answer["scores"]), expected_scores(reference, case["body"]))
        return
    assert label != "good", (case["data"][:300], answer)
    err = answer["error"]
    assert schema_error(answer, {"$ref": "#/components/schemas/Error"}, doc) is None, answer
    assert err["status"] == status and err["field"], answer  # every refusal names what to fix
    if case["path"] == "/v1/score" and case["method"] == "POST":
        assert str(status) in doc["paths"]["/v1/score"]["post"]["responses"], answer  # documented


def test_fuzzed_requests_never_get_a_5xx_and_good_ones_score_as_in_process(
    server, doc, reference, short_rm_dir
):
    proc, url, log = server
    seen: collections.Counter = collections.Counter()
    deadline = time.monotonic() + FUZZ_SECONDS

    def fuzz(strategy, examples: int) -> None:
        @settings(
            max_examples=examples,
            derandomize=True,  # the same requests on every run
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def one_request(case):
            if time.monotonic() > deadline:
                return
            status, answer = raw_or_text(url, case)
            check_answer(case, status, answer, doc, reference, seen)
            assert proc.poll() is None, "the server stopped"

        one_request()

    t0 = time.perf_counter()
    for label in MUTATIONS:  # each kind of bad request gets its share
        fuzz(mutated(label), FUZZ_EXAMPLES // 2 // len(MUTATIONS))
    fuzz(good(), FUZZ_EXAMPLES // 4)
    fuzz(anything(), FUZZ_EXAMPLES // 4)
    sent = sum(seen.values())
    print(f"\nfuzz: {sent} requests in {time.perf_counter() - t0:.1f} s; (kind, status class): ", end="")
    print(dict(sorted(seen.items())))
    refused = {label for (label, status) in seen if status == 400}
    assert SURE_4XX <= refused, f"mutations never sent: {SURE_4XX - refused}"
    assert seen[("good", 200)] >= 20

    # good requests interleaved with bad ones from several clients: scores as in process
    tok = load_tokenizer(short_rm_dir)
    ids, mask = rollout_ids(tok, PROMPTS, RESPONSES)
    assert int(mask.sum(1).max()) <= POSITIONS
    local_tok = RewardSource(model=reference, policy_tokenizer=tok, micro_batch=2)
    want_tok = local_tok(PROMPTS, RESPONSES, ROWS, ids, mask)
    want_text = RewardSource(model=reference, micro_batch=2)(PROMPTS, RESPONSES, ROWS)
    bad = [
        b'{"input_ids": [[1, 1000000000000000000000000000000]], "attention_mask": [[1, 1]]}',
        json.dumps({"input_ids": [list(range(20))], "attention_mask": [[1] * 20]}).encode(),
        b'{"prompts": ["a"], "responses": ["b"], "rows": [{"x": NaN}]}',
        b'{"prompts": ["a"], "prompts": ["b"], "responses": ["c"]}',
        b'{"prompts": ["\\udc00"], "responses": ["b"]}',
        b'{"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}',
    ]

    def client(k: int) -> bool:
        if k % 2:
            for body in bad:
                status, answer = post(url, body)
                assert 400 <= status < 500 and answer["error"]["field"], answer
            return True
        remote = RemoteReward(url, policy_tokenizer=tok if k % 4 == 0 else None, batch_size=2, token=TOKEN)
        with remote:
            for _ in range(3):
                if remote.token_path:
                    assert_close(remote(PROMPTS, RESPONSES, ROWS, ids, mask), want_tok)
                else:
                    assert_close(remote(PROMPTS, RESPONSES, ROWS), want_text)
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(client, range(8)))
    # one request per call, alone in its forward: the in-process scores bit for bit
    n = len(PROMPTS)
    with RemoteReward(url, policy_tokenizer=tok, batch_size=n, max_in_flight=1, token=TOKEN) as remote:
        assert remote.token_path
        local = RewardSource(model=reference, policy_tokenizer=tok, micro_batch=n)
        assert torch.equal(
            remote(PROMPTS, RESPONSES, ROWS, ids, mask), local(PROMPTS, RESPONSES, ROWS, ids, mask)
        )
    with RemoteReward(url, batch_size=n, max_in_flight=1, token=TOKEN) as remote:
        local = RewardSource(model=reference, micro_batch=n)
        assert torch.equal(remote(PROMPTS, RESPONSES, ROWS), local(PROMPTS, RESPONSES, ROWS))
        health = remote.health()
    assert health["status"] == "ok" and health["pending"] == 0
    assert proc.poll() is None and "Traceback" not in log.read_text(), log.read_text()[-3000:]


def raw_or_text(url: str, case: dict) -> tuple[int, dict]:
    """Send a fuzz case; the answer must be JSON whatever the status."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        data = case["data"] if case["method"] in ("POST", "PUT", "PATCH") else None
        conn.request(case["method"], case["path"], body=data, headers=case["headers"])
        resp = conn.getresponse()
        text = resp.read()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            raise AssertionError(
                f"{case['label']}: HTTP {resp.status} with a body that is not JSON: {text[:200]!r}"
            ) from None
    finally:
        conn.close()

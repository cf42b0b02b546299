"""Both HTTP APIs as their documents say: each OpenAPI document validates as OpenAPI 3.1 (openapi-spec-validator),
and a schema-driven fuzzer (schemathesis: its coverage and fuzzing phases, every check) run against the real
servers (``shifu serve RM_DIR`` and ``shifu serve --policy`` as commands, a recording gateway in process, all
on real uvicorn with tiny real models) finds no 5xx, no answer outside its schema, no undocumented status, no
schema-violating request accepted, and no schema-valid request refused for a reason its document does not
name (tests/schemathesis_hooks.py); every server is alive and has logged no traceback afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("schemathesis", reason="pip install 'shifu-rlhf[dev]'")
pytest.importorskip("openapi_spec_validator", reason="pip install 'shifu-rlhf[dev]'")
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
from openapi_spec_validator import validate  # noqa: E402
from test_gateway import CHATML, chat_tokenizer, tiny_policy  # noqa: E402
from test_serve import raw  # noqa: E402

from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.gateway.app import openapi_document as gateway_document  # noqa: E402
from shifu.serve.app import openapi_document as reward_document  # noqa: E402

TOKEN = "fuzz-token"
EXAMPLES = 40  # per operation and phase: a few hundred requests per server
TESTS = Path(__file__).parent
ENV = os.environ | {"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", "SHIFU_SERVE_TOKEN": TOKEN}


def launch(args: list[str], log: Path):
    """A ``shifu serve`` command on 127.0.0.1 with a free port; (process, URL) once it listens."""
    cmd = [sys.executable, "-m", "shifu", "serve", *args, "--port", "0", "--threads", "1"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd + ["--log-level", "warning"], env=ENV, stdout=subprocess.PIPE, stderr=err, text=True
        )
    line = proc.stdout.readline()
    assert " on http://127.0.0.1:" in line, (line, log.read_text())
    return proc, re.search(r"http://127\.0\.0\.1:\d+", line).group(0)


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    """``shifu serve`` of a causal reward model with 16 positions (rows past them are refused)."""
    from conftest import build_tiny_tokenizer
    from test_serve_api import POSITIONS  # noqa: F401  (the 16-position reward model of that file)

    from shifu.models.loading import build_tiny_gpt2, load_tokenizer
    from shifu.models.scalar import ScalarModel

    root = tmp_path_factory.mktemp("fuzz_rm")
    tok = build_tiny_tokenizer()
    tok.save_pretrained(str(root / "trunk"))
    build_tiny_gpt2(
        load_tokenizer(root / "trunk"), n_layer=2, n_embd=32, n_head=2, n_positions=16, seed=1
    ).save_pretrained(str(root / "trunk"))
    ScalarModel.from_backbone(root / "trunk", seed=2).save_pretrained(root / "rm")
    log = root / "stderr.txt"
    proc, url = launch([str(root / "rm"), "--max-body-bytes", "8192"], log)
    yield proc, url, log
    stop(proc)


@pytest.fixture(scope="module")
def policy_server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_policy")
    template = root / "chatml.jinja"
    template.write_text(CHATML)
    log = root / "stderr.txt"
    args = ["--policy", str(tiny_model_dir), "--chat-template", str(template), "--max-tokens", "4"]
    proc, url = launch(args, log)
    yield proc, url, log
    stop(proc)


@pytest.fixture(scope="module")
def recording_gateway():
    tok = chat_tokenizer()
    with Gateway(tiny_policy(tok), tok, recording=True, sampling=Sampling(max_tokens=4)) as gw:
        yield gw


def test_documents_are_valid_openapi_3_1(reward_server, policy_server, recording_gateway):
    validate(reward_document())
    validate(gateway_document())
    for url in (reward_server[1], policy_server[1], recording_gateway.url):
        status, live = raw(url, "GET", "/openapi.json")
        assert status == 200 and live["openapi"] == "3.1.0"
        validate(live)
    # a gateway that does not record has no /rl routes, and its document says so
    assert not any(p.startswith("/rl/") for p in raw(policy_server[1], "GET", "/openapi.json")[1]["paths"])
    assert "/rl/end_session" in raw(recording_gateway.url, "GET", "/openapi.json")[1]["paths"]


def test_shifu_serve_policy_answers_the_openai_client(policy_server, tiny_model_dir):
    proc, url, log = policy_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN)
    out = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hello"}], extra_body={"return_token_ids": True}
    )
    assert 1 <= len(out.choices[0].model_extra["token_ids"]) <= 4  # --max-tokens 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def fuzz(url: str, tmp_path: Path, env: dict | None = None) -> str:
    """schemathesis against the live document at ``url``; its output. Fails on any finding."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json", "--checks", "all"]
    cmd += ["--exclude-checks", "positive_data_acceptance", "-n", str(EXAMPLES), "--seed", "1", "-w", "1"]
    cmd += ["--generation-database", "none", "--no-color", "--phases", "coverage,fuzzing"]
    if env is None:
        cmd += ["-H", f"Authorization: Bearer {TOKEN}"]
    hooks = {"SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(TESTS)}
    done = subprocess.run(
        cmd, cwd=tmp_path, env=os.environ | hooks | (env or {}), capture_output=True, text=True, timeout=600
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "No issues found" in out, out[-6000:]
    generated = int(re.search(r"(\d+) generated", out).group(1))
    assert generated >= 50, out[-3000:]
    return out


def alive_and_clean(url: str, proc=None, log: Path | None = None) -> None:
    status, health = raw(url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["pending"] == 0
    if proc is not None:
        assert proc.poll() is None
    if log is not None:
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_schema_fuzzer_finds_nothing_on_the_reward_service(reward_server, tmp_path):
    proc, url, log = reward_server
    fuzz(url, tmp_path)
    alive_and_clean(url, proc, log)
    # the request the document allowed and the server refused (shapes that disagree) is described now
    doc = raw(url, "GET", "/openapi.json")[1]
    assert (
        "attention_mask has the shape of input_ids"
        in doc["components"]["schemas"]["ScoreRequest"]["description"]
    )
    status, err = raw(
        url,
        "POST",
        "/v1/score",
        json.dumps({"input_ids": [], "attention_mask": [[1, 0]]}),
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    assert status == 422 and err["error"]["field"] == "attention_mask"


def test_schema_fuzzer_finds_nothing_on_the_policy_gateway(policy_server, tmp_path):
    proc, url, log = policy_server
    fuzz(url, tmp_path)
    alive_and_clean(url, proc, log)


def test_schema_fuzzer_finds_nothing_on_a_recording_gateway(recording_gateway, tmp_path):
    gw = recording_gateway
    fuzz(gw.url, tmp_path, {"SHIFU_FUZZ_SESSIONS": gw.url})
    alive_and_clean(gw.url)
    assert len(gw.ended_sessions()) > 0  # end_session was reached with live keys

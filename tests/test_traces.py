"""Trajectories out and in (shifu.rollout.traces, shifu.data.atif): a PPO run with an environment records its
episodes; ``shifu traces export`` writes them as ATIF that Harbor's own models (harbor 0.25.0, in a Python 3.12
environment of its own) accept; ``shifu sft`` reads the export back, the ids and trained tokens equal to what the
run sampled, and its loss falls. OpenAI chat logs with tools render as the gateway renders an agent's request,
only the assistant turns trained; bad rows name the file, the line and the field."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import build_tiny_tokenizer, write_jsonl
from ppo_task import build_char_model, write_prompts
from test_tool_calls import QWEN_STYLE, TOOLS

from shifu.cli import main as cli
from shifu.data.demonstrations import encode_demonstration
from shifu.data.rows import load_rows
from shifu.errors import DataError
from shifu.models.loading import load_tokenizer
from shifu.models.tool_calls import render_messages, tool_format

HARBOR = "harbor==0.25.0"
HARBOR_ENV = (
    Path(os.environ.get("SHIFU_TEST_HARBOR", Path.home() / ".cache" / "shifu-test-harbor")) / "0.25.0"
)
VALIDATE = """
import json, sys
from harbor.models.trajectories import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator
n = 0
for line in open(sys.argv[1], encoding="utf-8"):
    doc = json.loads(line)
    Trajectory.model_validate(doc)
    v = TrajectoryValidator()
    assert v.validate(doc), v.errors
    n += 1
print(n)
"""


@pytest.fixture(scope="session")
def harbor_python() -> str:
    """A Python 3.12 (pyenv) environment with harbor 0.25.0's trajectory models, made once and kept under
    ~/.cache/shifu-test-harbor (a lock keeps parallel test workers from building it twice; a build that did not
    finish is started again). harbor is installed without its dependencies (litellm, supabase, ...): its
    trajectory models and validator import pydantic only."""
    python, done = HARBOR_ENV / "bin" / "python", HARBOR_ENV / ".complete"
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    if not done.exists() and not found:
        pytest.skip("no Python 3.12 under ~/.pyenv/versions (harbor needs Python >= 3.12)")
    HARBOR_ENV.parent.mkdir(parents=True, exist_ok=True)
    with open(HARBOR_ENV.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(HARBOR_ENV, ignore_errors=True)
            subprocess.run([found[-1], "-m", "venv", str(HARBOR_ENV)], check=True, timeout=300)
            pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            for what in (["--no-deps", HARBOR], ["pydantic>=2.12"]):
                proc = subprocess.run([*pip, *what], capture_output=True, text=True, timeout=600)
                assert proc.returncode == 0, proc.stderr[-3000:]
            done.touch()
    return str(python)


def validate_with_harbor(python: str, path: Path) -> int:
    proc = subprocess.run([python, "-c", VALIDATE, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.strip())


def records(run: Path) -> list[dict]:
    return [
        json.loads(x)
        for p in sorted((run / "episodes").glob("rank-*.jsonl"))
        for x in p.read_text().splitlines()
    ]


@pytest.mark.integration
def test_episodes_leave_as_atif_harbor_accepts_and_come_back_as_sft_data(tmp_path, harbor_python):
    char, prompts = build_char_model(tmp_path / "char"), write_prompts(tmp_path / "prompts.jsonl", 32)
    run = tmp_path / "ppo"
    argv = [
        "ppo",
        "--out",
        str(run),
        f"model.path={char}",
        f"data.train={prompts}",
        f"data.eval={prompts}",
        "env.factory=thirdparty_env:Echo",
        "generation.stop=[g,h,i,j,k,l]",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=2",
        "batch_size=16",
        "minibatch_size=8",
        "eval.every=0",
        "critic.init=sft",
        "progress=false",
        "tensorboard=false",
        "traces.atif=true",
    ]
    assert cli.main(argv) == 0
    recs = records(run)
    assert len(recs) == 32 and {r["iteration"] for r in recs} == {1, 2}
    assert all(1 <= len(r["turns"]) <= 2 and r["source"] for r in recs)
    two = [r for r in recs if len(r["turns"]) == 2]
    assert two and all(r["turns"][0]["read_ids"] and r["turns"][0]["read"].startswith("k") for r in two)
    assert all(len(t["log_probs"]) == len(t["ids"]) for r in recs for t in r["turns"])
    assert all(all(x <= 0 for x in t["log_probs"]) for r in recs for t in r["turns"])

    # export: one ATIF document per episode, accepted by Harbor's own models and validator
    out = tmp_path / "atif.jsonl"
    assert cli.main(["traces", "export", str(run), "--format", "atif", "--out", str(out)]) == 0
    assert validate_with_harbor(harbor_python, out) == 32
    assert validate_with_harbor(harbor_python, run / "episodes" / "atif-rank-0.jsonl") == 32
    docs = [json.loads(x) for x in out.read_text().splitlines()]
    for doc, rec in zip(docs, recs):
        agent = [s for s in doc["steps"] if s["source"] == "agent"]
        assert [s["metrics"]["completion_token_ids"] for s in agent] == [t["ids"] for t in rec["turns"]]
        assert [s["metrics"]["logprobs"] for s in agent] == [t["log_probs"] for t in rec["turns"]]
        assert sum(s["extra"]["reward"] for s in agent) == pytest.approx(rec["return"])
        assert doc["steps"][0]["extra"]["token_ids"] == rec["input_ids"]

    # import: the export as SFT rows, ids as recorded, exactly the sampled turns trained
    tok = load_tokenizer(char)
    rows = load_rows(out, "sft")
    for row, rec in zip(rows, recs):
        prompt, response, mask = encode_demonstration(tok, row)
        flat, trained = list(rec["input_ids"]), [False] * len(rec["input_ids"])
        for t in rec["turns"]:
            flat += t["ids"] + t["read_ids"]
            trained += [True] * len(t["ids"]) + [False] * len(t["read_ids"])
        last = len(trained) - trained[::-1].index(True)
        assert prompt + response == flat[:last]
        assert [False] * len(prompt) + mask == trained[:last]

    # and SFT on it learns: the training loss falls
    sft = tmp_path / "sft"
    argv = [
        "sft",
        "--out",
        str(sft),
        f"model.path={char}",
        f"data.train={out}",
        "max_steps=40",
        "log_every=5",
        "batch_size=8",
        "optim.lr=1e-2",
        "eval.every=0",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    losses = [
        json.loads(x)["sft/loss"]
        for x in (sft / "metrics.jsonl").read_text().splitlines()
        if '"sft/loss"' in x
    ]
    # (the policy's own samples at T = 1: the loss falls towards their entropy, not to 0)
    assert len(losses) == 8 and losses[-1] < 0.9 * losses[0] and losses[-1] == min(losses), losses


@pytest.mark.integration
def test_an_agents_episodes_leave_with_their_tool_calls_and_come_back_as_recorded(tmp_path, harbor_python):
    """An agent's calls on the recording gateway (a model that calls the calculator in its template's syntax):
    the ATIF steps carry the call and link the tool's result to it; read back, the ids and the trained mask are
    the trajectory's."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import test_agent as ta

    from shifu.rollout.agent import AgentEpisodes
    from shifu.rollout.episodes import EpisodeLimits
    from shifu.rollout.traces import TraceWriter

    model, tok = ta.setup_model("native_tool_calls")
    rows = [{"id": i, "prompt": ta.QUESTION[0]["content"], "fork": False} for i in range(2)]
    source = AgentEpisodes(
        ta.tool_agent, "test_agent:tool_agent", EpisodeLimits(10, 100, 4096), concurrency=2
    )
    t = ta.collect(source, model, tok, rows, max_new_tokens=100)
    TraceWriter(tmp_path / "run", 0, tok, "memorized", atif=True).write(t, None, 1, source.name)
    path = tmp_path / "run" / "episodes" / "atif-rank-0.jsonl"
    assert validate_with_harbor(harbor_python, path) == len(t) == 2
    steps = [
        s for x in path.read_text().splitlines() for s in json.loads(x)["steps"] if s["source"] == "agent"
    ]
    called = [s for s in steps if s.get("tool_calls")]
    assert called and all(s["tool_calls"][0]["function_name"] == "calculator" for s in called)
    # (sampled at T = 0.8, a call may come out misspelt: its arguments then are what parsing found)
    assert {"expression": "2+3"} in [s["tool_calls"][0]["arguments"] for s in called]
    linked = [s for s in called if "observation" in s]
    assert linked and all(
        s["observation"]["results"][0]["source_call_id"] == s["tool_calls"][0]["tool_call_id"] for s in linked
    )
    for i, row in enumerate(load_rows(path, "sft")):
        prompt, response, mask = encode_demonstration(tok, row)
        real = t.attention_mask[i].bool()
        full = t.input_ids[i][real].tolist()
        P = int(t.prompt_mask[i].sum())
        trainable = [False] * P + t.trainable[i][t.attention[i]].tolist()
        n = len(prompt) + len(response)
        assert prompt + response == full[:n] and [False] * len(prompt) + mask == trainable[:n]
        assert trainable[n:] == [False] * (len(full) - n)  # (only read ids follow the last trained one)


ECHO = ["generation.stop=[g,h,i,j,k,l]", "generation.max_new_tokens=6", "generation.max_total_tokens=24"]


@pytest.mark.integration
def test_sft_on_a_runs_best_exported_episodes_beats_the_base_on_held_out_prompts(tmp_path):
    """The round trip's point: a PPO run's episodes that earned a return of 0.5 or more, exported and read back
    by shifu sft, teach the base policy; ``shifu eval`` pairs base and SFT policy on 200 held-out prompts with the
    environment (measured: 0.037 -> 0.473, gain +0.436 +- 0.027)."""
    char, prompts = build_char_model(tmp_path / "char"), write_prompts(tmp_path / "prompts.jsonl", 64)
    letters = "abcdefghijkl"
    held_out = [
        {"prompt": "".join(letters[(i * 5 + j * 3 + 1) % 12] for j in range(4 + i % 3))} for i in range(200)
    ]
    held_out_path = write_jsonl(tmp_path / "held_out.jsonl", held_out)
    run = tmp_path / "ppo"
    argv = [
        *(
            "ppo",
            "--out",
            str(run),
            f"model.path={char}",
            f"data.train={prompts}",
            "env.factory=thirdparty_env:Echo",
        ),
        *ECHO,
        *(
            "iterations=12",
            "batch_size=32",
            "minibatch_size=16",
            "ppo_epochs=2",
            "eval.every=0",
            "critic.init=sft",
        ),
        *(
            "optim.lr=1e-2",
            "critic.optim.lr=1e-2",
            "kl.controller=fixed",
            "kl.init_coef=0.01",
            "progress=false",
        ),
        *("tensorboard=false", "traces.episodes=true", "eval.final_prompts=0"),
    ]
    assert cli.main(argv) == 0
    exported = tmp_path / "episodes.atif.jsonl"
    assert cli.main(["traces", "export", str(run), "--format", "atif", "--out", str(exported)]) == 0
    best = [
        d for d in map(json.loads, exported.read_text().splitlines()) if (d["extra"]["return"] or 0) >= 0.5
    ]
    assert len(best) >= 32
    best_path = write_jsonl(tmp_path / "best.atif.jsonl", best)
    sft = tmp_path / "sft"
    argv = [
        *("sft", "--out", str(sft), f"model.path={char}", f"data.train={best_path}", "max_steps=60"),
        *("batch_size=16", "optim.lr=3e-3", "eval.every=0", "progress=false", "tensorboard=false"),
    ]
    assert cli.main(argv) == 0
    record = tmp_path / "eval.json"
    stops = [x for c in "ghijkl" for x in ("--stop", c)]
    argv = [
        *(
            "eval",
            str(char),
            str(sft / "final"),
            "--env",
            "thirdparty_env:Echo",
            "--prompts",
            str(held_out_path),
        ),
        *stops,
        *("--max-new-tokens", "6", "--max-total-tokens", "24", "--max-turns", "2", "--temperature", "0.7"),
        *("--out", str(record), "--no-progress"),
    ]
    assert cli.main(argv) == 0
    paired = json.loads(record.read_text())["paired"]
    assert paired["pairs"] == 200 and paired["gain"] > 0.2 and paired["gain"] > 4 * paired["gain_se"], paired


@pytest.mark.unit
def test_export_refuses_a_run_that_recorded_no_episodes(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    code = cli.main(
        ["traces", "export", str(tmp_path / "run"), "--format", "atif", "--out", str(tmp_path / "x")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "recorded no episodes" in err and "traces.episodes=true" in err
    assert not (tmp_path / "x").exists()


def chat_tokenizer():
    """The tiny BPE with ChatML's markers, <|im_end|> as EOS, and a Qwen-style template that renders tools."""
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_STYLE
    return tok


CHAT_LOG = {
    "messages": [
        {"role": "user", "content": "What is 347*29?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "347*29"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "10063"},
        {"role": "assistant", "content": "10063"},
    ],
    "tools": TOOLS,
}


def runs(ids: list[int], mask: list[bool]) -> list[list[int]]:
    out, prev = [], False
    for t, m in zip(ids, mask):
        if m and not prev:
            out.append([])
        if m:
            out[-1].append(t)
        prev = m
    return out


@pytest.mark.unit
def test_a_chat_log_with_tools_renders_as_the_gateway_and_trains_only_the_assistant_turns(tmp_path):
    tok, fmt = chat_tokenizer(), None
    fmt = tool_format(tok)
    assert fmt.native
    path = write_jsonl(tmp_path / "log.jsonl", [CHAT_LOG])
    row = load_rows(path, "sft")[0]
    prompt, response, mask = encode_demonstration(tok, row)
    msgs = CHAT_LOG["messages"]
    # what the model reads before its first turn is the gateway's rendering of the agent's first request
    first_request = tok(render_messages(tok, msgs[:1], TOOLS, fmt), add_special_tokens=False)["input_ids"]
    assert prompt == first_request and "# Tools" in tok.decode(prompt)
    call, answer = (tok.decode(r) for r in runs(response, mask))
    assert call.startswith("<tool_call>") and "347*29" in call and call.endswith("</tool_call><|im_end|>")
    assert answer == "10063<|im_end|>"
    whole = tok(render_messages(tok, msgs, TOOLS, fmt, generation_prompt=False), add_special_tokens=False)
    assert prompt + response == whole["input_ids"][: len(prompt + response)]
    # the tool's result is read, not trained
    read = tok.decode([t for t, m in zip(response, mask) if not m])
    assert "<tool_response>\n10063" in read


@pytest.mark.unit
def test_an_atif_file_without_token_ids_renders_its_steps_as_the_chat_log(tmp_path):
    tok = chat_tokenizer()
    doc = {
        "schema_version": "ATIF-v1.6",
        "agent": {"name": "other", "version": "1", "tool_definitions": TOOLS},
        "steps": [
            {"step_id": 1, "source": "user", "message": "What is 347*29?"},
            {
                "step_id": 2,
                "source": "agent",
                "message": "",
                "tool_calls": [
                    {
                        "tool_call_id": "call_1",
                        "function_name": "calculator",
                        "arguments": {"expression": "347*29"},
                    }
                ],
                "observation": {"results": [{"source_call_id": "call_1", "content": "10063"}]},
            },
            {"step_id": 3, "source": "agent", "message": "10063"},
        ],
    }
    (tmp_path / "trajectory.json").write_text(json.dumps(doc))
    got = encode_demonstration(tok, load_rows(tmp_path / "trajectory.json", "sft")[0])
    log = encode_demonstration(tok, load_rows(write_jsonl(tmp_path / "log.jsonl", [CHAT_LOG]), "sft")[0])
    assert got == log


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        (lambda d: d["steps"][0].update(source="robot"), "steps[0].source", "expected one of"),
        (lambda d: d["steps"].pop(1), "steps", "no agent step"),
        (
            lambda d: (d["steps"][1].pop("metrics"), d["steps"][1]["tool_calls"][0].pop("function_name")),
            "steps[1].tool_calls[0].function_name",
            "missing",
        ),
        (
            lambda d: d["steps"][1]["metrics"].update(completion_token_ids=[99999]),
            "steps",
            "outside the tokenizer",
        ),
        (
            lambda d: d["steps"][1].update(message="zzzz"),
            "steps[1].metrics.completion_token_ids",
            "another tokenizer",
        ),
    ],
)
def test_bad_atif_rows_name_the_file_line_and_field(tmp_path, change, field, problem):
    tok = chat_tokenizer()
    ids = tok("10063", add_special_tokens=False)["input_ids"]
    doc = {
        "schema_version": "ATIF-v1.8",
        "agent": {"name": "shifu", "version": "0"},
        "steps": [
            {"step_id": 1, "source": "user", "message": "q"},
            {
                "step_id": 2,
                "source": "agent",
                "message": "10063",
                "tool_calls": [{"tool_call_id": "c", "function_name": "calculator", "arguments": {}}],
                "metrics": {"prompt_token_ids": [5, 6], "completion_token_ids": ids},
            },
        ],
    }
    change(doc)
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, doc])
    with pytest.raises(DataError) as e:
        encode_demonstration(tok, load_rows(path, "sft")[1])
    assert f"{path}, line 2, field '{field}'" in str(e.value) and problem in str(e.value)


@pytest.mark.unit
def test_bad_tools_name_the_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [CHAT_LOG | {"tools": [{"type": "function", "function": {}}]}])
    with pytest.raises(DataError, match=r"line 1, field 'tools\[0\]\.function\.name'"):
        load_rows(path, "sft")


@pytest.mark.unit
def test_a_resumed_run_drops_the_episodes_recorded_after_its_checkpoint(tmp_path):
    from shifu.rollout.traces import trim

    d = tmp_path / "episodes"
    d.mkdir()
    write_jsonl(d / "rank-0.jsonl", [{"iteration": i} for i in (1, 2, 3)])
    write_jsonl(d / "atif-rank-0.jsonl", [{"extra": {"iteration": i}} for i in (1, 2, 3)])
    write_jsonl(d / "rank-1.jsonl", [{"iteration": i} for i in (1, 2, 3)])
    trim(tmp_path, 0, 2)
    assert [json.loads(x)["iteration"] for x in (d / "rank-0.jsonl").read_text().splitlines()] == [1, 2]
    assert len((d / "atif-rank-0.jsonl").read_text().splitlines()) == 2
    assert len((d / "rank-1.jsonl").read_text().splitlines()) == 3  # (each rank trims its own)


@pytest.mark.unit
def test_records_split_turns_at_turn_ends_or_at_the_end_of_a_sampled_run():
    """A single-turn batch (no turn_ends) is one turn from its first sampled token to its EOS; with turn_ends,
    two turns with nothing read between them stay two turns. Rewards sum over each turn's tokens."""
    import torch

    from shifu.rollout.batch import Trajectories, Transcript
    from shifu.rollout.traces import atif_trajectory, episode_records

    tok = build_tiny_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    a, b, c = tok("the cat dog", add_special_tokens=False)["input_ids"][:3]
    ids = torch.tensor([[a, b, eos, pad, pad], [a, eos, b, c, eos]])
    trainable = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0, 0, 0.5, 0, 0], [0, 0.25, 0, 0, 1.0]])
    turn_ends = torch.tensor([[0, 0, 1, 0, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    made = dict(
        prompt_ids=torch.tensor([[pad, c], [c, c]]),
        prompt_mask=torch.tensor([[0, 1], [1, 1]]),
        ids=ids,
        trainable=trainable,
        attention=attention,
        rewards=rewards,
        truncated=torch.tensor([False, True]),
        failed=torch.tensor([False, False]),
        rows=[{"prompt": "x"}, {"prompt": "y"}],
        transcripts=[Transcript((), "")] * 2,
        log_probs=-torch.rand(2, 5) * trainable,
    )
    single = episode_records(Trajectories(**made), tok, None, 3, "s")[0]
    assert [t["ids"] for t in single["turns"]] == [[a, b, eos]] and single["turns"][0]["reward"] == 0.5
    assert single["input_ids"] == [c] and single["turns"][0]["read_ids"] == []
    multi = episode_records(Trajectories(**made, turn_ends=turn_ends), tok, None, 3, "s")[1]
    assert [(t["ids"], t["read_ids"]) for t in multi["turns"]] == [([a, eos], []), ([b], [c]), ([eos], [])]
    assert [t["reward"] for t in multi["turns"]] == [0.25, 0.0, 1.0] and multi["return"] == 1.25
    doc = atif_trajectory(multi, "t", "s", "m")
    context = [s["metrics"]["prompt_token_ids"] for s in doc["steps"][1:]]
    assert context == [[c, c], [c, c, a, eos], [c, c, a, eos, b, c]] and doc["extra"]["truncated"]

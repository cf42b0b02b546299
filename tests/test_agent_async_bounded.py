"""``async_schedule=bounded`` with the agent source (``agent.factory``): two sampler threads, each running its own
sessions on a gateway of its own (:class:`shifu.rollout.agent_stream.AgentStream`, one per sampler) at once. The run trains the synchronous run's multiset of
prompts, no trajectory past its bound, and every trained trajectory is its own session's: the row's prompt is its
first input, the observation after its first call echoes that call's own answer, and its return is the one the
agent gave for that row (``traces.episodes`` records what trained)."""

from __future__ import annotations

import collections
import itertools
import threading

import pytest

pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[agents]'")

from test_agent import build_echo_task  # noqa: E402
from test_async_bounded_run import expected_prompts, train_holding, within_bound  # noqa: E402
from test_async_fixed import trained  # noqa: E402
from test_ppo import rows_of  # noqa: E402

from shifu.config.loader import load_config  # noqa: E402
from shifu.trainers import ppo  # noqa: E402
from shifu.trainers.ppo_load import load_prompts  # noqa: E402

pytestmark = pytest.mark.integration

MODEL = "policy"
STOP = ["i", "j", "k", "l"]
SOLVED: list[str] = []  # the thread each episode ran in


def marker(prompt: str) -> float:
    """The return the agent gives a row: its own, so that a row trained with another session's return shows."""
    return (sum(map(ord, prompt)) % 97) / 97


async def solve(client, row: dict) -> float:
    """examples/agents/echo_agent.py's two calls (the second reads back ``k`` and the first answer's first two
    letters), returning the row's marker."""
    SOLVED.append(threading.current_thread().name)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, stop=STOP)
    said = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": said}, {"role": "user", "content": echo(said)}]
    await client.chat.completions.create(model=MODEL, messages=messages, stop=STOP)
    return marker(row["prompt"])


def echo(said: str) -> str:
    return "k" + "".join(c for c in said if c.isalpha())[:2]


def answered(text: str) -> str:
    """A turn's text as the agent read it: up to its first stop letter (the client's content)."""
    return "".join(itertools.takewhile(lambda c: c not in STOP, text))


@pytest.fixture(scope="module")
def echo_task(tmp_path_factory):
    return build_echo_task(tmp_path_factory.mktemp("bounded_agent"))


def test_a_bounded_agent_run_trains_each_session_once_as_its_own_row(echo_task, tmp_path):
    out = tmp_path / "run"
    argv = [
        f"out_dir={out}",
        f"model.path={echo_task['char']}",
        f"data.train={echo_task['prompts']}",
        "agent.factory=test_agent_async_bounded:solve",
        "agent.concurrency=4",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=6",
        "batch_size=8",
        "minibatch_size=4",
        "eval.every=0",
        "eval.num_prompts=4",
        "critic.init=sft",
        "save_every=0",
        "traces.episodes=true",
        "async_schedule=bounded",
        "max_staleness=1",
        "async_samplers=2",
        "decoupled=true",
        "is_mask=4.0",
    ]
    cfg = load_config(ppo.Config, None, argv)
    SOLVED.clear()
    ppo.train(cfg)
    # both samplers ran sessions (each in its agent stream's thread)
    assert {"shifu-ppo-sampler-0", "shifu-ppo-sampler-1"} <= {name.split(" ")[0] for name in SOLVED}
    lines = trained(out)
    assert len(lines) == 6 * 8 and within_bound(lines, 1)
    assert all(sum(x["step"] == k for x in lines) == 8 for k in range(6))
    assert collections.Counter(x["prompt_id"] for x in lines) == expected_prompts(cfg, 8)

    records = rows_of(out / "episodes" / "rank-0.jsonl")
    assert len(records) == len(lines)  # (echo's calls extend each other: no fork rows)
    prompts = [r["prompt"] for r in load_prompts(cfg)[2]]  # (the training prompts: a held-out split is not)
    for k in range(6):  # each trained row is the prompt trained.jsonl names for it
        named = [prompts[x["prompt_id"]] for x in lines if x["step"] == k]
        assert [r["prompt"] for r in records if r["iteration"] == k + 1] == named
    assert sum(len(r["turns"]) == 2 for r in records) > len(records) // 2
    for r in records:
        assert r["input"] == r["prompt"] + " "  # the row's own first input
        assert not r["failed"] and r["return"] == pytest.approx(marker(r["prompt"]), abs=1e-6)
        first = r["turns"][0]
        if len(r["turns"]) == 2:  # the observation echoes this session's own first answer
            assert echo(answered(first["content"])) in first["read"], r
    logged = [m for m in rows_of(out / "metrics.jsonl") if "agent/calls" in m]
    assert len(logged) == 6 and all(m["agent/errors"] == m["agent/timeouts"] == 0 for m in logged)
    assert not any(t.name.startswith("shifu-ppo-sampler") for t in threading.enumerate())


HELD: dict = {}  # the run directory, and what the straggler's holds saw


async def straggler(client, row: dict) -> float:
    """Two calls; the tool between them holds (up to 5 s) on the first episode of 'abc' (tests/ppo_task.py's
    prompts 0, 12, 24, ...) sampled in the background, until the trainer has trained one more batch."""
    import asyncio

    from test_async_bounded_run import n_trained

    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, stop=STOP)
    said = first.choices[0].message.content or ""
    if row["prompt"] == "abc" and HELD.get("out") is not None:
        before, waited = n_trained(HELD["out"]), 0.0
        while waited < 5 and n_trained(HELD["out"]) < before + 8:
            await asyncio.sleep(0.01)
            waited += 0.01
        HELD["overtaken"] += n_trained(HELD["out"]) >= before + 8
        HELD["holds"] += 1
    messages += [{"role": "assistant", "content": said}, {"role": "user", "content": echo(said)}]
    await client.chat.completions.create(model=MODEL, messages=messages, stop=STOP)
    return marker(row["prompt"])


def test_a_slow_agent_holds_its_own_episode_only(echo_task, tmp_path):
    """One sampler: its episodes run on their own on one gateway (shifu.rollout.agent_stream), so batches train
    while an episode waits on its tool; every line within its bound, the synchronous run's multiset of prompts,
    each trained row its own session's, and an evaluation mid-run pauses the gateway and goes on."""
    out = tmp_path / "run"
    argv = [
        f"out_dir={out}",
        f"model.path={echo_task['char']}",
        f"data.train={echo_task['prompts']}",
        "agent.factory=test_agent_async_bounded:straggler",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=10",
        "batch_size=8",
        "minibatch_size=4",
        "eval.every=5",
        "eval.num_prompts=4",
        "eval.final_prompts=0",
        "critic.init=sft",
        "save_every=0",
        "progress=false",
        "tensorboard=false",
        "traces.episodes=true",
        "async_schedule=bounded",
        "max_staleness=1",
        "async_samplers=1",
        "decoupled=true",
    ]
    cfg = load_config(ppo.Config, None, argv)
    lines = train_holding(cfg, out, HELD)
    assert len(lines) == 10 * 8 and within_bound(lines, 1)
    assert collections.Counter(x["prompt_id"] for x in lines) == expected_prompts(cfg, 8)
    assert len({x["version"] for x in lines}) > 2  # the gateway took new weights as the run went
    for r in rows_of(out / "episodes" / "rank-0.jsonl"):
        assert r["input"] == r["prompt"] + " " and r["return"] == pytest.approx(marker(r["prompt"]), abs=1e-6)
    assert any(k.startswith("eval/") for m in rows_of(out / "metrics.jsonl") for k in m)  # (iteration 5's)
    assert not any(t.name.startswith("shifu-ppo-sampler") for t in threading.enumerate())

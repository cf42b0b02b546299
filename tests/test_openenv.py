"""OpenEnv environments (shifu.envs.openenv): OpenEnv servers written in tests/openenv_envs.py against OpenEnv's own
server interface run as local processes; reset and stepped through the adapter (text actions, MCP tools); an
installed environment named in one setting (``env.factory=shifu.envs.openenv:ID``) trains with PPO and its critic
and with a critic-free estimator, its rewards reaching the trainer per turn and its episodes recorded."""

from __future__ import annotations

import json
import sys

import pytest
from ppo_task import build_char_model

pytest.importorskip("openenv")

from openenv_envs import LETTERS  # noqa: E402

from shifu.cli import main as cli  # noqa: E402
from shifu.config.sources import EnvConfig  # noqa: E402
from shifu.envs.base import EnvFault, Environment, Step  # noqa: E402
from shifu.errors import ConfigError  # noqa: E402
from shifu.rollout.build import describe  # noqa: E402

pytestmark = pytest.mark.integration

ECHO = {"app": "openenv_envs:echo_app"}
SUM = {"app": "openenv_envs:sum_app"}


def env(kwargs: dict, factory: str = "shifu.envs.openenv:OpenEnvEnvironment") -> Environment:
    return Environment(EnvConfig(factory=factory, kwargs=kwargs))


def word(seed: int) -> str:  # the first input EchoEnvironment gives for a seed
    return "".join(LETTERS[(seed * 7 + j) % 12] for j in range(3 + seed % 3))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """An installed OpenEnv environment package, ``echo_test_env``, laid out as OpenEnv's template lays one out
    (openenv.yaml naming ``server.app:app``)."""
    root = tmp_path_factory.mktemp("site")
    pkg = root / "echo_test_env"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "openenv.yaml").write_text("spec_version: 1\nname: echo_test_env\napp: server.app:app\n")
    (pkg / "server" / "__init__.py").write_text("")
    (pkg / "server" / "app.py").write_text("from openenv_envs import echo_app as app  # noqa: F401\n")
    sys.path.insert(0, str(root))
    yield "echo_test_env"
    sys.path.remove(str(root))


def test_a_text_environment_resets_and_steps_through_its_server():
    """The seed of a row resets the task; the action's only string field carries the turn, the observation's only
    string field is what the policy reads; the server's reward and done come back as the Step's."""
    e = env(ECHO)
    rows = [{"prompt": "p0", "seed": 1}, {"prompt": "p1", "seed": 2}]
    started = e.start(rows)
    assert [first for _, first in started] == [word(1), word(2)]
    (a, _), (b, _) = started
    first = e.step([(a, "abc", rows[0], 0), (b, "lll", rows[1], 0)])
    assert [s.observation for s in first] == ["kab", "kll"] and not any(s.done for s in first)
    second = e.step([(a, "aab", rows[0], 1), (b, "lll", rows[1], 1)])
    assert [(s.reward, s.done, s.observation) for s in second] == [(2 / 3, True, None), (0.0, True, None)]
    assert a.client is None and b.client is None  # a finished episode's connection is closed
    one = env({**ECHO, "connections": 1})  # a server of one connection: a batch of two is refused, saying why
    outcomes = one.start(rows)  # (the two resets run at once: either may be the one refused)
    refused = [str(o) for o in outcomes if isinstance(o, EnvFault)]
    assert len(refused) == 1 and "CAPACITY_REACHED" in refused[0] and "env.kwargs.connections" in refused[0]


def test_a_tool_environment_offers_its_mcp_tools_and_rewards_their_calls():
    """Its MCP tools are offered as OpenAI function schemas; each <tool_call> is a call_tool step whose result
    (or error) the policy reads as a tool message, counted in Step.info; submitting the right sum ends the
    episode with the environment's reward."""
    e = env(SUM)
    row = {"prompt": "sum", "seed": 1}
    ((instance, first),) = e.start([row])
    assert first == [{"role": "user", "content": "What is 7 + 10?"}]
    assert [t["function"]["name"] for t in instance.tools] == ["add", "submit"]
    assert instance.tools[0]["function"]["parameters"]["required"] == ["a", "b"]

    def call(name: str, **arguments) -> str:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"

    (s,) = e.step([(instance, call("add", a=7, b=10) + call("nope"), row, 0)])
    assert s.observation[0] == {"role": "tool", "content": "17"}
    assert "nope" in s.observation[1]["content"] and s.observation[1]["content"].startswith("error")
    assert (s.reward, s.done, s.info) == (0.0, False, {"tool_calls": 2, "tool_errors": 1})
    (s,) = e.step([(instance, call("submit", answer="17"), row, 1)])
    assert (s.reward, s.done) == (1.0, True)
    ((instance, _),) = e.start([row])
    (s,) = e.step([(instance, "it is 18", row, 0)])  # no call: the answer, and no answer_tool to give it to
    assert s == Step(reward=0.0, done=True, info={"tool_calls": 0, "tool_errors": 0})


def test_an_environment_is_named_in_one_setting_and_describes_itself(installed):
    """``shifu.envs.openenv:ID`` finds the installed package's app through its openenv.yaml; the source says
    which environment it is; an environment that is not installed is refused with what to do."""
    factory = f"shifu.envs.openenv:{installed}"
    e = env({}, factory)
    ((_, first),) = e.start([{"prompt": "p", "seed": 4}])
    assert first == word(4)
    d = describe({"env": {"factory": factory}})
    assert (d.kind, d.scored_by, d.gold, d.name) == (
        "environment",
        "environment reward",
        True,
        f"environment {factory}",
    )
    with pytest.raises(ConfigError, match="no installed OpenEnv environment 'chess'.*env.kwargs.app"):
        env({}, "shifu.envs.openenv:chess")
    with pytest.raises(
        ConfigError, match='server openenv_envs:nothing exited .*Attribute "nothing" not found'
    ):
        env({"app": "openenv_envs:nothing"})  # the server's own words on why it did not start
    with pytest.raises(ConfigError, match="action_field"):
        env({**SUM, "tools": False})  # a call_tool action has several string fields: which one is the turn?


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("openenv_ppo")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": word(i), "seed": i}) + "\n" for i in range(64)))
    return {"char": build_char_model(d / "char"), "prompts": prompts}


def argv(data, out, factory: str, *extra: str) -> list[str]:
    return [
        "ppo",
        "--out",
        str(out),
        f"model.path={data['char']}",
        f"data.train={data['prompts']}",
        f"data.eval={data['prompts']}",
        f"env.factory={factory}",
        "generation.stop=[g,h,i,j,k,l]",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "batch_size=32",
        "minibatch_size=16",
        "ppo_epochs=2",
        "eval.temperature=1.0",
        "critic.init=sft",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.01",
        "traces.episodes=true",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_ppo_with_its_critic_trains_on_an_installed_openenv_environment(data, installed, tmp_path):
    """PPO (GAE on a critic) raises the return the OpenEnv server gives (the fraction of `a` in the second turn;
    random policy ~0.08); the paired evaluation judges by it; every recorded episode carries the server's reward
    on its second turn and nothing on its first; `shifu eval --run` measures the run through the same server."""
    out, factory = tmp_path / "run", f"shifu.envs.openenv:{installed}"
    assert cli.main(argv(data, out, factory, "iterations=12", "eval.every=12", "eval.num_prompts=32")) == 0
    rows = [r for r in metrics(out) if "env/return" in r]
    early = sum(r["env/return"] for r in rows[:3]) / 3
    late = sum(r["env/return"] for r in rows[-3:]) / 3
    assert late > early + 0.1, (early, late)
    evals = [r for r in metrics(out) if "gold/score" in r]
    assert evals[-1]["gold/score"] > evals[0]["gold/score"] + 0.1, evals
    assert all(1.5 < r["env/turns"] <= 2 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["name"] == f"environment {factory}"
    records = [json.loads(x) for x in (out / "episodes" / "rank-0.jsonl").read_text().splitlines()]
    assert len(records) == 12 * 32
    finished = [rec for rec in records[-32:] if not rec["truncated"]]
    assert len(finished) > 16
    for rec in records[-32:]:
        assert rec["turns"][0]["reward"] == 0.0
        if rec["truncated"]:  # a turn cut by its token budget never reached the server
            assert rec["return"] == 0.0
    for rec in finished:
        first, second = rec["turns"]
        letters = [c for c in second["content"] if c.isalpha()]  # (text keeps <eos>)
        assert first["read"].replace(" ", "").startswith("k")  # the server's echo
        assert second["reward"] == pytest.approx(letters.count("a") / max(1, len(letters)), abs=1e-5)
        assert rec["return"] == pytest.approx(second["reward"], abs=1e-5)
    # shifu eval --run: the run's start against its final policy, through the environment the run named
    assert (
        cli.main(["eval", "--run", str(out), "--num-prompts", "32", "--out", str(tmp_path / "eval.json")])
        == 0
    )
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["judge"] == f"episode return of {factory}" and record["paired"]["gain"] > 0.1


def test_a_critic_free_estimator_runs_on_an_openenv_environment(data, tmp_path):
    out = tmp_path / "grpo"
    extra = [
        "iterations=2",
        "eval.num_prompts=8",
        "advantage_estimator=grpo",
        "group_size=4",
        "kl.penalty=loss",
    ]
    assert (
        cli.main(
            argv(data, out, "shifu.envs.openenv:OpenEnvEnvironment", f"env.kwargs={json.dumps(ECHO)}", *extra)
        )
        == 0
    )
    rows = [r for r in metrics(out) if "env/return" in r]
    assert len(rows) == 2 and all(r["rollout/rows"] == 32 and 0 <= r["env/return"] <= 1 for r in rows)


def test_the_example_plays_its_game_through_its_server(monkeypatch):
    """examples/envs/openenv_guess.py, as `cd examples/envs` makes it importable: the game's text is what the
    policy reads, its hint follows a wrong guess, the right number ends the episode with reward 1."""
    import random
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "envs"))
    e = env({"app": "openenv_guess:app"})
    row = {"prompt": "guess seed 3", "seed": 3}
    ((game, first),) = e.start([row])
    assert first.startswith("I am thinking of a number from 1 to 20")
    secret = random.Random(3).randint(1, 20)
    wrong = 1 if secret > 1 else 2
    (s,) = e.step([(game, f"{wrong}\n", row, 0)])
    assert s.observation.startswith("higher" if wrong < secret else "lower") and not s.done
    (s,) = e.step([(game, f"It is {secret}\n", row, 1)])
    assert (s.reward, s.done) == (1.0, True)

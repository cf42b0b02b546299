"""verifiers environments (shifu.envs.verifiers, shifu.rollout.verifiers): a taskset written in the test, installed
as a package where verifiers 0.4 is installed, named in one setting (``verifiers.taskset=ID``): its tasks are the
prompts, verifiers' plain chat harness (a uv script, run as a local process) plays them through the run's policy
gateway, its reward is the return; one PPO step with the critic, a critic-free estimator, the held-out split of its
own, `shifu eval --run`, and a gain test.

verifiers pins an ``openai`` older than the ``agents`` extra's, so it is installed in an environment of its own
(as a user would: ``pip install 'verifiers==0.4.*' uv``), kept under ~/.cache/shifu/harness-envs/verifiers, and
named by ``verifiers.python``. The tests skip only when that environment cannot be made (no package index)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from shifu.cli import main as cli  # noqa: E402
from shifu.config.loader import from_dict  # noqa: E402
from shifu.config.schema import PPOConfig  # noqa: E402
from shifu.errors import ConfigError  # noqa: E402
from shifu.rollout.build import describe  # noqa: E402

pytestmark = pytest.mark.integration

REQUIREMENTS = ("verifiers==0.4.*", "uv>=0.5")
ROOT = Path(__file__).resolve().parents[1]

# a user's own taskset, as `vf-init` lays one out: tasks of letters, rewarded by the fraction of `a` in the reply
TASKSET = """
import verifiers.v1 as vf

LETTERS = "abcdefghijkl"


class LettersData(vf.TaskData):
    pass


class LettersTask(vf.Task[LettersData]):
    @vf.reward(weight=1.0)
    async def a_fraction(self, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        return reply.count("a") / max(1, len(reply))


class LettersConfig(vf.TasksetConfig):
    num_tasks: int = 64
    offset: int = 0


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self):
        for i in range(self.config.offset, self.config.offset + self.config.num_tasks):
            prompt = "".join(LETTERS[(i * 7 + j) % 12] for j in range(3 + i % 3))
            yield LettersTask(LettersData(prompt=prompt), self.config.task)


__all__ = ["LettersTaskset"]
"""

# a taskset whose tasks need a container: refused, since shifu runs verifiers on local processes only
BOXED = """
import verifiers.v1 as vf


class BoxedTask(vf.Task[vf.TaskData]):
    NEEDS_CONTAINER = True


class BoxedTaskset(vf.Taskset[BoxedTask, vf.TasksetConfig]):
    def load(self):
        yield BoxedTask(vf.TaskData(prompt="abc"), self.config.task)


__all__ = ["BoxedTaskset"]
"""


def verifiers_python() -> Path:
    """The Python of a virtual environment with verifiers 0.4 and uv installed from the package index, kept
    under ~/.cache/shifu/harness-envs/verifiers between runs (about a minute and 600 MB the first time)."""
    root = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "shifu"
        / "harness-envs"
        / "verifiers"
    )
    python, ready = root / "bin" / "python", root / f"installed-{' '.join(REQUIREMENTS)}"
    if ready.exists():
        return python
    venv.create(root, clear=True, with_pip=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *REQUIREMENTS],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if pip.returncode != 0:
        pytest.skip(f"could not install {' '.join(REQUIREMENTS)} into {root}: {pip.stderr.strip()[-400:]}")
    ready.touch()
    return python


@contextlib.contextmanager
def tasksets(root: Path):
    """The tasksets of this file as packages (``letters_taskset``, ``boxed_taskset``) in ``root``, on the import
    path the verifiers worker inherits (PYTHONPATH) while the context lasts."""
    for name, text in (("letters_taskset", TASKSET), ("boxed_taskset", BOXED)):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(text)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [old])])
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The tasksets on the worker's import path, the char model with a chat template (tests/test_agent.py's echo
    task), and the verifiers Python."""
    from test_agent import build_echo_task

    d = tmp_path_factory.mktemp("verifiers")
    python = verifiers_python()
    with tasksets(d / "site"):
        yield {"char": build_echo_task(d)["char"], "python": str(python)}


def argv(task, out, *extra: str) -> list[str]:
    return [
        "ppo",
        "--out",
        str(out),
        f"model.path={task['char']}",
        "verifiers.taskset=letters_taskset",
        f"verifiers.python={task['python']}",
        "verifiers.kwargs={num_tasks: 64}",
        "verifiers.concurrency=8",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "batch_size=16",
        "minibatch_size=8",
        "ppo_epochs=2",
        "eval.temperature=1.0",
        "critic.init=sft",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.01",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_taskset_trains_a_ppo_step_with_its_critic_and_is_measured_by_shifu_eval(task, tmp_path):
    """One PPO step (GAE on a critic) on the taskset's tasks: every episode's one call went through verifiers'
    chat harness to the gateway, its return is the task's reward; the source describes itself as the taskset;
    the held-out split is data.eval_fraction of its tasks; `shifu eval --run` plays them again."""
    out = tmp_path / "run"
    assert cli.main(argv(task, out, "iterations=1", "eval.every=1", "eval.num_prompts=4")) == 0
    train = [r for r in metrics(out) if "agent/return" in r]
    assert len(train) == 1 and train[0]["agent/errors"] == 0 and train[0]["agent/calls"] == 1
    assert 0 <= train[0]["agent/return"] <= 1 and "value/explained_var" in train[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["name"] == "environment verifiers:letters_taskset"
    record = tmp_path / "eval.json"
    assert cli.main(["eval", "--run", str(out), "--num-prompts", "4", "--out", str(record)]) == 0
    rec = json.loads(record.read_text())
    assert rec["judge"] == "episode return of verifiers:letters_taskset" and rec["prompts"]["count"] == 3
    assert rec["prompts"]["from"] == "verifiers:letters_taskset (held-out split, data.eval_fraction)"


def test_a_critic_free_estimator_runs_and_the_held_out_split_is_the_tasksets_own(task, tmp_path):
    """RLOO (groups of 4 episodes of one task, no critic) trains a step; with verifiers.eval_kwargs the held-out
    tasks are the taskset loaded with that config (here its tasks from 100 on), all of them, none of training's."""
    out = tmp_path / "run"
    split = ["verifiers.eval_kwargs={offset: 100, num_tasks: 5}", "eval.every=1", "eval.num_prompts=8"]
    extra = ["iterations=1", "advantage_estimator=rloo", "group_size=4", *split]
    assert cli.main(argv(task, out, *extra)) == 0
    train = [r for r in metrics(out) if "agent/return" in r]
    assert len(train) == 1 and train[0]["agent/errors"] == 0 and "value/explained_var" not in train[0]
    evals = [r for r in metrics(out) if "gold/score" in r]
    assert evals and all(r["eval/score"] == r["gold/score"] for r in evals)
    record = tmp_path / "eval.json"
    assert cli.main(["eval", "--run", str(out), "--out", str(record)]) == 0
    rec = json.loads(record.read_text())
    assert rec["prompts"] == {"from": "verifiers:letters_taskset (held-out split)", "count": 5}
    assert [r["prompt"] for r in rec["rows"]] == [letters(i) for i in range(100, 105)]


def letters(i: int) -> str:  # the prompt of task i of TASKSET
    return "".join("abcdefghijkl"[(i * 7 + j) % 12] for j in range(3 + i % 3))


def test_the_config_refuses_what_a_taskset_cannot_run():
    base = {"out_dir": "o", "model": {"path": "m"}, "verifiers": {"taskset": "letters_taskset"}}

    def check(extra: dict) -> str:
        with pytest.raises(ConfigError) as e:
            from_dict(PPOConfig, json.loads(json.dumps(base)) | extra).validate()
        return str(e.value)

    cfg = from_dict(PPOConfig, base)
    cfg.validate()  # alone it is a complete source: its tasks are the prompts
    assert describe(cfg).name == "environment verifiers:letters_taskset" and describe(cfg).gold
    assert "the taskset's tasks are the prompts; unset data.train" in check({"data": {"train": "p.jsonl"}})
    assert "verifiers.taskset rewards its episodes" in check({"reward": {"function": "x:f"}})
    assert "give one of env.factory, agent.factory and verifiers.taskset" in check(
        {"env": {"factory": "x:Y"}}
    )
    assert "unset generation.stop" in check({"generation": {"stop": ["]"]}})
    assert "its id is verifiers.taskset" in check({"verifiers": {"taskset": "x", "kwargs": {"id": "y"}}})


def test_a_taskset_that_cannot_run_here_is_refused_before_the_run_writes_anything(task, tmp_path, capsys):
    """verifiers missing where verifiers.python says, a taskset that is not installed, and one whose tasks need a
    container (shifu runs verifiers on local processes only): each stops `shifu ppo` before its run directory is
    made, saying what to do."""
    out = tmp_path / "run"
    missing = [
        a if not a.startswith("verifiers.python=") else f"verifiers.python={tmp_path}/python"
        for a in argv(task, out)
    ]
    assert cli.main(missing) == 2
    assert "needs verifiers 0.4 in" in capsys.readouterr().err
    assert cli.main([*argv(task, out), "verifiers.taskset=no_such_taskset"]) == 2
    assert "taskset 'no_such_taskset' not found" in capsys.readouterr().err
    assert cli.main([*argv(task, out), "verifiers.taskset=boxed_taskset", "verifiers.kwargs={}"]) == 2
    err = capsys.readouterr().err
    assert "need a container" in err and "local processes only" in err
    assert not out.exists()


@pytest.mark.slow
def test_ppo_raises_the_return_of_a_tasksets_rubric(task, tmp_path):
    """PPO with its critic raises the taskset's reward (the fraction of `a` in the reply, ~0.08 for the random
    policy) in training and on the held-out tasks."""
    out = tmp_path / "run"
    extra = ["iterations=10", "batch_size=32", "minibatch_size=16", "eval.every=10", "eval.num_prompts=16"]
    assert cli.main(argv(task, out, *extra, "data.eval_fraction=0.25")) == 0
    train = [r for r in metrics(out) if "agent/return" in r]
    assert len(train) == 10 and all(r["agent/errors"] == 0 for r in train)
    early = sum(r["agent/return"] for r in train[:3]) / 3
    late = sum(r["agent/return"] for r in train[-3:]) / 3
    assert late > early + 0.1, (early, late)
    evals = [r for r in metrics(out) if "gold/score" in r]
    assert evals[-1]["gold/score"] > evals[0]["gold/score"] + 0.1, evals


def test_a_quickstart_plan_takes_a_taskset_instead_of_its_environment(task):
    """A quickstart plan's PPO stage names a taskset as it names an environment: its source is the taskset, its
    stage trains on the taskset's tasks (no data.train) with the plan's reward function left out, and the final
    evaluation's held-out rows are the ones the stage held out."""
    from shifu.pipelines.quickstart import _plan
    from shifu.pipelines.stages import ppo_overrides
    from shifu.rollout.build import plan_prompts, source_prompts

    sets = ["ppo.env.factory=null", "ppo.generation.stop=[]", "ppo.verifiers.taskset=letters_taskset"]
    plan = _plan("arith_tool", "smollm2", sets)
    assert describe(plan["ppo"]).name == "environment verifiers:letters_taskset"
    files = {"prompts_train": "train.jsonl", "prompts_val": "val.jsonl"}
    over = ppo_overrides(plan["ppo"], "sft", files, {}, 0)
    assert "train" not in over.get("data", {}) and "function" not in over.get("reward", {})
    with pytest.raises(ConfigError, match="give one of env.factory, agent.factory and verifiers.taskset"):
        _plan("arith_tool", "smollm2", sets[1:])
    stage = {
        "verifiers": {"taskset": "letters_taskset", "python": task["python"], "kwargs": {"num_tasks": 40}}
    }
    stage["data"] = {"eval_fraction": 0.25}
    train, held_out, where = plan_prompts(stage, seed=3)
    assert (len(train), len(held_out)) == (30, 10) and where.endswith("(held-out split, data.eval_fraction)")
    cfg = from_dict(PPOConfig, {"out_dir": "o", "model": {"path": "m"}, "seed": 3, **stage})
    assert source_prompts(cfg, cfg.seed)[:2] == (train, held_out)


def test_the_example_taskset_loads_its_splits_and_scores_letters_in_place(task, monkeypatch):
    """examples/envs/verifiers_acronyms.py, imported by verifiers from the working directory: its train and test
    splits are disjoint phrases, a task's prompt asks for the acronym, and its score counts letters in place."""
    from shifu.envs import verifiers as V

    monkeypatch.chdir(ROOT / "examples" / "envs")
    splits = {"train": {"num_tasks": 32}, "eval": {"num_tasks": 32, "split": "test"}}
    worker = V.Worker(task["python"], "verifiers_acronyms", "", splits)
    try:
        train, test = ({t["prompt"] for t in worker.tasks[s]} for s in ("train", "eval"))
        assert len(train) == len(test) == 32 and not train & test
        assert all(p.startswith("Write the acronym of the phrase") and p.endswith(":") for p in train)
    finally:
        worker.stop()
    check = (
        "import verifiers_acronyms as m\n"
        "assert m.score('PNG', 'PNG') == 1.0 and m.score('PN', 'PNG') == 2 / 3\n"
        "assert m.score('A PNG', 'PNG') == 1.0\n"
        "assert m.score('PXGQ', 'PNG') == 2 / 4 and m.score('', 'PNG') == 0.0\n"
        "assert m.score('The acronym is PNG.', 'PNG') == 1.0 and m.acronym('open source') == 'OS'\n"
    )
    out = subprocess.run([task["python"], "-c", check], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_an_episode_past_its_timeout_ends_truncated_and_the_worker_plays_on(task):
    """verifiers.timeout_s: episodes still playing when it passes end truncated (agent/timeouts), the worker is
    told to stop them, and the next batch on the same worker plays to the end."""
    import torch
    from test_agent import batch_of

    from shifu.envs import verifiers as V
    from shifu.generation.rollout import SamplingParams
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.rollout.episodes import EpisodeLimits
    from shifu.rollout.sources import Policy
    from shifu.rollout.verifiers import VerifiersEpisodes

    tok = load_tokenizer(task["char"])
    tok.padding_side = "left"
    policy = Policy(load_causal_lm(str(task["char"])), tok, with_log_probs=True)
    worker = V.worker(task["python"], "letters_taskset", "", {"num_tasks": 4}, {})
    rows, limits = V.task_rows(worker, "train"), EpisodeLimits(1, 6, 24, ())
    params = SamplingParams(6, 1.0)

    def collect(timeout_s: float) -> dict:
        source = VerifiersEpisodes(worker, "letters_taskset", limits, timeout_s=timeout_s)
        return source.collect(policy, batch_of(rows), params, torch.Generator().manual_seed(0)).metrics

    cut = collect(0.01)
    assert cut["agent/timeouts"] == 1.0 and cut["agent/errors"] == 0.0
    played = collect(600.0)
    assert played["agent/timeouts"] == 0.0 and played["agent/errors"] == 0.0 and played["agent/calls"] == 1.0

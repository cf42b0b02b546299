"""``async_schedule=bounded`` with an environment: each sampler's episodes advance on their own
(:class:`shifu.rollout.episode_stream.EpisodeStream`), so a slow environment step holds its own episode only. With one
sampler, batches train while a straggler's step is still waiting (the sampler's other episodes go on); every line
of ``trained.jsonl`` stays within its bound, the run trains the synchronous run's multiset of prompts, a prompt's
group of episodes trains in one batch, and each iteration's episode metrics are logged; a run SIGKILLed at random
points and resumed trains the uninterrupted run's multiset of prompts."""

from __future__ import annotations

import collections
import random
import signal
import threading
from pathlib import Path

import pytest
from ppo_task import build_char_model, write_prompts
from test_async_bounded_run import (
    expected_prompts,
    groups_train_together,
    hold,
    last_logged,
    train_holding,
    within_bound,
)
from test_async_fixed import async_argv, trained
from test_ppo import rows_of, task  # noqa: F401 (the fixture)
from test_resume import Run, latest_step, logged_step_at_least, tmp_write_started

from shifu import Step
from shifu.config.loader import load_config
from shifu.trainers import ppo

pytestmark = pytest.mark.integration

HELD: dict = {}  # the run directory, and what the straggler's holds saw
SLOW_TEXT = "abc"  # tests/ppo_task.py's prompts 0, 12, 24, 36, 48 and 60


class Straggler:
    """Two turns; reward: the fraction of 'a' in the action. A first step of a SLOW_TEXT episode sampled in the
    background holds (up to 5 s) until the trainer has trained one more batch: counted in HELD["overtaken"]
    when a batch trained while it waited."""

    def __init__(self):
        self.prompt, self.turn = "", 0

    def reset(self, row: dict) -> str:
        self.prompt, self.turn = row["prompt"], 0
        return row["prompt"]

    def step(self, action: str) -> Step:
        if self.prompt == SLOW_TEXT and self.turn == 0 and HELD.get("out") is not None:
            hold(HELD)
        self.turn += 1
        return Step(observation="k", reward=action.count("a") / max(1, len(action)), done=self.turn >= 2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounded_episodes")
    return {"model": build_char_model(d / "model"), "prompts": write_prompts(d / "prompts.jsonl")}


def config(data, out: Path, *extra: str):
    return load_config(
        ppo.Config,
        None,
        [
            f"out_dir={out}",
            f"model.path={data['model']}",
            f"data.train={data['prompts']}",
            "env.factory=test_async_bounded_episodes:Straggler",
            "generation.max_turns=2",
            "generation.stop=[g,h,i,j,k,l]",
            "generation.max_new_tokens=6",
            "generation.max_total_tokens=16",
            "critic.init=sft",
            "batch_size=8",
            "minibatch_size=4",
            "optim.lr=1e-2",
            "critic.optim.lr=1e-2",
            "eval.every=0",
            "eval.final_prompts=0",
            "save_every=0",
            "progress=false",
            "tensorboard=false",
            "async_schedule=bounded",
            "max_staleness=1",
            "async_samplers=1",
            "decoupled=true",
            "is_mask=4.0",
            *extra,
        ],
    )


def test_a_straggling_step_holds_its_own_episode_only(data, tmp_path):
    out = tmp_path / "run"
    cfg = config(data, out, "iterations=10")
    # one sampler: a batch trained while one of its episodes waited on the environment
    lines = train_holding(cfg, out, HELD)
    assert len(lines) == 10 * 8 and within_bound(lines, 1)
    assert sorted({x["step"] for x in lines}) == list(range(10))
    assert collections.Counter(x["prompt_id"] for x in lines) == expected_prompts(cfg, 8)
    rows = [r for r in rows_of(out / "metrics.jsonl") if "rollout/staleness" in r]
    assert len(rows) == 10 and sum(r["env/turns"] for r in rows) / 10 > 1.5  # most episodes take both turns
    assert not any(t.name.startswith("shifu-ppo-sampler") for t in threading.enumerate())


def test_a_prompts_episodes_train_together(data, tmp_path):
    """group_size 2: a prompt's two episodes end as one group and train in the same batch."""
    out = tmp_path / "run"
    cfg = config(data, out, "iterations=4", "advantage_estimator=rloo", "group_size=2", "async_samplers=2")
    ppo.train(cfg)
    lines = trained(out)
    assert len(lines) == 4 * 8 and within_bound(lines, 1)
    assert groups_train_together(lines, cfg, 4, 2)


@pytest.mark.slow
def test_a_bounded_episode_run_killed_anywhere_trains_the_same_prompts(task, tmp_path):  # noqa: F811
    """The episode stream under SIGKILL at random points and --resume: the uninterrupted run's multiset of
    prompts, every line within its bound (what was in flight at a kill is sampled again)."""
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    episodes = [
        "env.factory=test_async_bounded_episodes:Straggler",
        "generation.max_turns=2",
        "generation.stop=[g,h,i,j,k,l]",
        "generation.max_total_tokens=16",
        "async_schedule=bounded",
        "async_samplers=1",
    ]
    argv = [a for a in async_argv(task, resumed) if not a.startswith("reward.")] + episodes
    clean_argv = [str(clean) if a == str(resumed) else a for a in argv]
    assert Run(clean_argv, tmp_path / "clean.log").wait() == 0
    rnd, r, kills = random.Random(0), Run(argv, tmp_path / "0.log"), 0
    for k in range(3):  # SIGKILL 1 or 2 iterations past the furthest logged yet, or mid-write
        after = max(0, latest_step(resumed))
        target = max(after, last_logged(resumed)) + rnd.randint(1, 2)
        cond = tmp_write_started(resumed, after) if k == 2 else logged_step_at_least(resumed, target)
        if not r.signal_when(cond, signal.SIGKILL):
            break
        kills += 1
        r = Run([*argv, "--resume"], tmp_path / f"{k + 1}.log")
    assert r.wait() == 0, r.output()
    assert kills >= 1
    a, b = trained(clean), trained(resumed)
    assert within_bound(a, 1) and within_bound(b, 1) and len(b) == 10 * 8
    assert collections.Counter(x["prompt_id"] for x in b) == collections.Counter(x["prompt_id"] for x in a)
    assert sorted({x["step"] for x in b}) == list(range(10))

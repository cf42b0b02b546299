"""Asynchronous PPO, ``async_schedule=bounded``, in the trainer: a producer thread samples the ledger's prompts
on the last published weights, and each iteration trains the first trajectories finished within the bound.
``trained.jsonl`` has a version per trajectory and no line past its bound (``step - version <= S``); the run
trains the synchronous run's multiset of prompts (each prompt of an epoch once); a straggler does not hold its
batch; an error in the thread stops the run with it; and a run SIGKILLed at random points and resumed each time
(real processes, as ``test_resume.py``'s) trains the uninterrupted run's multiset of prompts, none past its
bound."""

from __future__ import annotations

import collections
import json
import random
import signal
import sys
import threading
import time

import pytest
from test_async_fixed import THREADS, async_argv, trained
from test_ppo import make_cfg, rows_of, task  # noqa: F401 (the fixture)
from test_resume import Run, latest_step, logged_step_at_least, tmp_write_started

from shifu.trainers import ppo
from shifu.trainers.ppo_bounded import epoch_order
from shifu.trainers.ppo_load import load_prompts

pytestmark = pytest.mark.integration

SHORT = ("batch_size=8", "minibatch_size=4", "eval.every=0", "eval.num_prompts=8")
BOUNDED = ("async_schedule=bounded", "max_staleness=1", "decoupled=true", "is_mask=4.0")


def expected_prompts(cfg, per_batch: int) -> collections.Counter:
    """The synchronous run's prompts as a multiset: the epochs' orders of ``cfg``'s training prompts end to end,
    the first ``iterations * per_batch``."""
    n = len(load_prompts(cfg)[1])
    total, out, e = cfg.iterations * per_batch, [], 0
    while len(out) < total:
        out += epoch_order(n, cfg.seed, e)
        e += 1
    return collections.Counter(out[:total])


def last_logged(out) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(x).get("step", 0) for x in lines if x.strip().endswith("}")), default=0)


def within_bound(lines: list[dict], S: int) -> bool:
    return all(0 <= x["step"] - x["version"] <= S for x in lines)


def test_bounded_run_trains_each_prompt_once_within_its_bound(task, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    THREADS.clear()
    reward = "reward.function=test_async_fixed:frac_a_where"
    cfg = make_cfg(task, out, "iterations=10", *SHORT, *BOUNDED, reward, "eval.every=5")
    ppo.train(cfg)
    assert any(t.startswith("shifu-ppo-sampler-") for t in THREADS)  # sampled in the producer thread
    lines = trained(out)
    assert len(lines) == 10 * 8 and within_bound(lines, 1)
    assert sorted({x["step"] for x in lines}) == list(range(10))
    assert all(sum(x["step"] == k for x in lines) == 8 for k in range(10))
    # epoch 0 whole, then the first 16 prompts of epoch 1's order: the synchronous run's multiset
    assert collections.Counter(x["prompt_id"] for x in lines) == expected_prompts(cfg, 8)
    rows = [r for r in rows_of(out / "metrics.jsonl") if "rollout/staleness" in r]
    assert len(rows) == 10 and all(0 <= r["rollout/staleness"] <= 1 for r in rows)
    assert all(r["rollout/requeued"] >= 0 for r in rows)
    # the iterations' mean staleness is the lines' (the metric reports what trained)
    for r in rows:
        step = [x for x in lines if x["step"] == r["step"] - 1]
        assert r["rollout/staleness"] == pytest.approx(
            sum(x["step"] - x["version"] for x in step) / len(step)
        )
    assert (out / "final").is_dir()
    assert not any(
        t.name.startswith("shifu-ppo-sampler") for t in threading.enumerate()
    )  # stopped at the end


def test_bounded_groups_stay_together(task, tmp_path):  # noqa: F811
    """group_size 2: a prompt's two responses are sampled in one call and trained in the same batch."""
    out = tmp_path / "run"
    group = ("advantage_estimator=rloo", "group_size=2")
    cfg = make_cfg(task, out, "iterations=4", *SHORT, *BOUNDED, *group)
    ppo.train(cfg)
    lines = trained(out)
    assert len(lines) == 4 * 8 and within_bound(lines, 1)
    assert groups_train_together(lines, cfg, 4, 2)


HELD: dict = {}  # the straggler test's run directory and what its holds saw


def straggling_reward(prompts, responses, rows):
    """ppo_task's frac_a; a background call with a prompt of SLOW_TEXT holds (up to 5 s) until the trainer has
    trained one more batch: a straggler, counted in HELD["overtaken"] when a batch trained without it."""
    if threading.current_thread().name.startswith("shifu-ppo-sampler") and any(
        r["prompt"] == SLOW_TEXT for r in rows
    ):
        hold(HELD)
    return [r.count("a") / max(1, len(r)) for r in responses]


SLOW_TEXT = "abc"  # tests/ppo_task.py's prompts 0, 12, 24, 36, 48 and 60


def groups_train_together(lines: list[dict], cfg, per_batch: int, G: int) -> bool:
    """Each prompt's ``G`` trajectories of a step trained in that step, and the run trained the synchronous run's
    prompts (``per_batch`` a batch), each ``G`` times."""
    per_step = collections.defaultdict(collections.Counter)
    for x in lines:
        per_step[x["step"]][x["prompt_id"]] += 1
    together = all(set(c.values()) == {G} for c in per_step.values())
    multiset = collections.Counter({p: G * k for p, k in expected_prompts(cfg, per_batch).items()})
    return together and collections.Counter(x["prompt_id"] for x in lines) == multiset


def hold(held: dict, batch: int = 8, timeout_s: float = 5.0) -> None:
    """A straggler's wait: until the run in ``held["out"]`` has trained ``batch`` more trajectories (counted in
    ``held["overtaken"]``) or ``timeout_s`` seconds passed; counted in ``held["holds"]``."""
    before, deadline = n_trained(held["out"]), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if n_trained(held["out"]) >= before + batch:
            held["overtaken"] += 1
            break
        time.sleep(0.01)
    held["holds"] += 1


def train_holding(cfg, out, held: dict) -> list[dict]:
    """``cfg``'s run (into ``out``) with its straggler's holds counted in ``held`` (:func:`hold`): asserts that a
    batch trained while a straggler waited, and returns the run's ``trained.jsonl`` lines."""
    held.update(out=out, overtaken=0, holds=0)
    try:
        ppo.train(cfg)
    finally:
        held["out"] = None
    assert held["holds"] > 0 and held["overtaken"] > 0, held
    return trained(out)


def n_trained(out) -> int:
    path = out / "trained.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_straggler_does_not_hold_the_batches(task, tmp_path):  # noqa: F811
    """While a background sampler call waits on a slow reward, the trainer trains the next batch from what
    finished before it; every line stays within its bound and the run trains the synchronous run's prompts."""
    from ppo_task import ALPHABET

    assert SLOW_TEXT == "".join(ALPHABET[:3])
    out = tmp_path / "run"
    reward = "reward.function=test_async_bounded_run:straggling_reward"
    cfg = make_cfg(task, out, "iterations=10", *SHORT, *BOUNDED, reward)
    lines = train_holding(cfg, out, HELD)  # a batch trained while a straggler sampled
    assert within_bound(lines, 1)
    assert collections.Counter(x["prompt_id"] for x in lines) == expected_prompts(cfg, 8)


def failing_reward(prompts, responses, rows):
    raise ValueError("the judge is broken")


def test_an_error_in_the_sampler_thread_stops_the_run(task, tmp_path):  # noqa: F811
    cfg = make_cfg(
        task,
        tmp_path / "run",
        "iterations=3",
        *SHORT,
        *BOUNDED,
        "reward.function=test_async_bounded_run:failing_reward",
    )
    with pytest.raises(Exception, match="the judge is broken") as info:
        ppo.train(cfg)
    assert any("sampler thread" in n for n in getattr(info.value, "__notes__", []))
    assert not any(t.name.startswith("shifu-ppo-sampler") for t in threading.enumerate())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bounded_run_killed_anywhere_trains_the_same_prompts(task, tmp_path, seed):  # noqa: F811
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    argv = [a for a in async_argv(task, resumed) if a != "max_staleness=1"] + [
        "max_staleness=1",
        "async_schedule=bounded",
    ]
    clean_argv = [str(clean) if a == str(resumed) else a for a in argv]
    assert Run(clean_argv, tmp_path / "clean.log").wait() == 0
    rnd, report = random.Random(seed), []
    r = Run(argv, tmp_path / "0.log")
    for k in range(
        4
    ):  # SIGKILL at random points: 1 or 2 iterations past the furthest logged yet, or mid-write
        after = max(0, latest_step(resumed))
        target = max(after, last_logged(resumed)) + rnd.randint(1, 2)
        cond = tmp_write_started(resumed, after) if k == 2 else logged_step_at_least(resumed, target)
        if not r.signal_when(cond, signal.SIGKILL):
            break
        report.append(latest_step(resumed))
        r = Run([*argv, "--resume"], tmp_path / f"{k + 1}.log")
    assert r.wait() == 0, r.output()
    print("latest checkpoints after each kill:", report, file=sys.__stderr__)
    a, b = trained(clean), trained(resumed)
    assert within_bound(a, 1) and within_bound(b, 1)
    count = collections.Counter
    assert (
        count(x["prompt_id"] for x in b)
        == count(x["prompt_id"] for x in a)
        == expected_prompts(make_cfg(task, clean, "iterations=10"), 8)
    )
    assert sorted({x["step"] for x in b}) == list(range(10)) and len(b) == 10 * 8
    assert len([r for r in rows_of(resumed / "metrics.jsonl") if "rollout/staleness" in r]) == 10

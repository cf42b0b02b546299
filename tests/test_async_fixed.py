"""Asynchronous PPO, ``async_schedule=fixed``: iteration k trains a batch sampled by version max(0, k - 1 - S),
sampled in the background while the trainer updates; ``trained.jsonl`` says so, line by line; the prompts are
those of the synchronous run in the same order; and a run SIGKILLed at several points (real processes, as
``test_resume.py``'s) resumes to the uninterrupted run's end bit for bit: weights, metrics, ``trained.jsonl``."""

from __future__ import annotations

import json
import signal
import sys
import threading

import pytest
from test_ppo import make_cfg, rows_of, task  # noqa: F401 (the fixture)
from test_resume import Run, latest_step, logged_step_at_least, metric_rows, tmp_write_started, weights_digest

from shifu.trainers import ppo

pytestmark = pytest.mark.integration

THREADS: list[str] = []  # the thread each reward call ran in (in-process runs)


def frac_a_where(prompts, responses, rows):
    """ppo_task's frac_a, noting the thread that called it."""
    THREADS.append(threading.current_thread().name)
    return [r.count("a") / max(1, len(r)) for r in responses]


def trained(out) -> list[dict]:
    return rows_of(out / "trained.jsonl")


def by_step(lines: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for x in lines:
        out.setdefault(x["step"], []).append(x["prompt_id"])
    return out


SHORT = ("iterations=6", "batch_size=8", "minibatch_size=4", "eval.every=0", "eval.num_prompts=8")


def test_fixed_staleness_samples_each_batch_from_its_version_in_the_background(task, tmp_path):  # noqa: F811
    sync, stale = tmp_path / "s0", tmp_path / "s2"
    THREADS.clear()
    ppo.train(make_cfg(task, sync, *SHORT, "reward.function=test_async_fixed:frac_a_where"))
    assert set(THREADS) == {"MainThread"}
    THREADS.clear()
    ppo.train(
        make_cfg(task, stale, *SHORT, "reward.function=test_async_fixed:frac_a_where", "max_staleness=2")
    )
    # batches 1, 2 sampled by version 0 before the first update; batches 3..6 while iterations 1..4 train
    assert THREADS.count("shifu-ppo-sampler") == 4, THREADS
    a, b = trained(sync), trained(stale)
    assert len(a) == len(b) == 6 * 8
    assert [x["version"] for x in a] == [x["step"] for x in a]  # synchronous: the policy before the step
    assert [x["version"] for x in b] == [max(0, x["step"] - 2) for x in b]
    assert by_step(a) == by_step(b)  # the same prompts in the same order: only who sampled them differs
    rows = [r for r in rows_of(stale / "metrics.jsonl") if "rollout/staleness" in r]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert all("rollout/mismatch_abs_log_ratio" in r for r in rows)  # the behaviour policy's mismatch, logged
    assert not any("rollout/staleness" in r for r in rows_of(sync / "metrics.jsonl"))
    # a stale batch is no longer the policy that trains it: the first batch sampled by an older version differs
    first_stale = next(r for r in rows if r["rollout/staleness"] == 1)
    assert first_stale["rollout/mismatch_abs_log_ratio"] > 0


def test_decoupled_masked_fixed_run_learns(task, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out, "max_staleness=2", "decoupled=true", "is_mask=3.0", "eval.every=12"))
    rows = [r for r in rows_of(out / "metrics.jsonl") if "objective/score" in r]
    first = sum(r["objective/score"] for r in rows[:3]) / 3
    last = sum(r["objective/score"] for r in rows[-3:]) / 3
    assert last > first + 0.1, (first, last)
    assert all(0 <= r["rollout/is_maskfrac"] < 0.5 for r in rows)
    assert max(r["objective/kl"] for r in rows) < 12.0


def async_argv(inputs, out) -> list[str]:
    return [
        "ppo",
        "--out",
        str(out),
        f"model.path={inputs['model']}",
        f"data.train={inputs['prompts']}",
        "reward.function=ppo_task:frac_a",
        "critic.init=sft",
        "iterations=10",
        "batch_size=8",
        "minibatch_size=4",
        "ppo_epochs=2",
        "generation.max_new_tokens=6",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "kl.controller=adaptive",
        "kl.target=2.0",
        "eval.every=0",
        "eval.num_prompts=8",
        "save_every=2",
        "progress=false",
        "tensorboard=false",
        "max_staleness=1",
        "decoupled=true",
        "is_mask=4.0",
    ]


@pytest.mark.slow
def test_fixed_run_killed_anywhere_resumes_bit_identically(task, tmp_path):  # noqa: F811
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    assert Run(async_argv(task, clean), tmp_path / "clean.log").wait() == 0
    argv, report = async_argv(task, resumed), []
    # 1. SIGKILL as soon as the checkpoint of iteration 2 has landed (iteration 3 and batch 4's sampling running)
    r = Run(argv, tmp_path / "1.log")
    assert r.signal_when(lambda: latest_step(resumed) >= 2, signal.SIGKILL), "ended before SIGKILL"
    report.append(latest_step(resumed))
    # 2. resume; SIGKILL between checkpoints, 3 iterations after the latest one
    r = Run([*argv, "--resume"], tmp_path / "2.log")
    after = latest_step(resumed)
    assert r.signal_when(logged_step_at_least(resumed, after + 3), signal.SIGKILL), "ended before SIGKILL"
    report.append(latest_step(resumed))
    # 3. resume; SIGKILL when the next checkpoint write begins
    stopped = latest_step(resumed)
    r = Run([*argv, "--resume"], tmp_path / "3.log")
    assert r.signal_when(tmp_write_started(resumed, stopped), signal.SIGKILL), "ended before SIGKILL"
    report.append(latest_step(resumed))
    # 4. resume to the end
    r = Run([*argv, "--resume"], tmp_path / "4.log")
    assert r.wait() == 0, r.output()
    print("latest checkpoints after each kill:", report, file=sys.__stderr__)
    assert metric_rows(clean) == metric_rows(resumed)
    for d in ("final", "critic"):
        assert weights_digest(clean / d) == weights_digest(resumed / d), d
    a = (clean / "trained.jsonl").read_text()
    assert a == (resumed / "trained.jsonl").read_text()
    lines = [json.loads(x) for x in a.splitlines()]
    assert len(lines) == 10 * 8 and all(x["version"] == max(0, x["step"] - 1) for x in lines)


def test_a_longer_resumed_run_samples_the_batches_the_old_end_did_not_need(task, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    short = ("batch_size=8", "minibatch_size=4", "eval.every=0", "eval.num_prompts=8", "max_staleness=1")
    ppo.train(make_cfg(task, out, "iterations=4", *short))
    ppo.train(make_cfg(task, out, "iterations=6", *short), resume=True)
    lines = trained(out)
    assert sorted(by_step(lines)) == [0, 1, 2, 3, 4, 5] and all(len(v) == 8 for v in by_step(lines).values())
    # batch 4 (iteration 5) was not sampled before the old end: sampled on resume by version 4; batch 5 in the
    # background
    assert {x["step"]: x["version"] for x in lines} == {0: 0, 1: 0, 2: 1, 3: 2, 4: 4, 5: 4}
    assert all(0 <= x["step"] - x["version"] <= 1 for x in lines)  # never past the bound

"""The pipeline commands (``shifu quickstart``, ``shifu study``) never delete or overwrite what they did not
write, and run one at a time per directory (issue 38): user files in every place a stage writes, a
trainer's finished run directory given as --out, two real ``python -m shifu quickstart`` processes on one
directory (the second started at several moments), and the lock of a killed pipeline taken over.

The live pipeline of the race scores PPO with ``pipeline_gate.exact_match_after_gate`` (tests/): it waits
in its PPO stage until the test opens the gate, so it is alive whenever the second process looks, however
fast or slow the machine; the second process runs the same command without the gate.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_jsonl
from test_sft import corpus

from shifu.cli.main import main as cli_main
from shifu.errors import ShifuError
from shifu.runs import checkpoint as ckpt

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[1]
# arith tiny cut short (a whole run takes ~20 s of one core); later --set of a key wins
TINY = [
    "sft.max_steps=20",
    "sft.progress=false",
    "ppo.progress=false",
    "ppo.iterations=2",
    "ppo.eval.every=0",
    "ppo.batch_size=16",
    "ppo.minibatch_size=8",
]


def _quickstart(out: Path, *sets: str) -> list[str]:
    return [
        "quickstart",
        "--task",
        "arith",
        "--out",
        str(out),
        *(x for s in [*TINY, *sets] for x in ("--set", s)),
    ]


def _tree(d: Path) -> dict[str, bytes | None]:
    """Every path under ``d``, with a file's bytes (None: a directory)."""
    return {str(p.relative_to(d)): None if p.is_dir() else p.read_bytes() for p in sorted(d.rglob("*"))}


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_directory_that_is_not_a_pipeline_run_is_refused_untouched(tmp_path, capsys):
    """--out . in a project folder: a user's file in any place a stage writes (or anywhere in --out)
    makes the pipeline refuse before it writes anything, not even its lock file."""
    for rel in ("data/x", "sft/x", "rm/x", "ppo/x", "soup/x", "x"):
        out = tmp_path / rel.replace("/", "-") / "project"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text("mine")
        before = _tree(out)
        assert cli_main(_quickstart(out)) == 2, rel
        err = capsys.readouterr().err
        top = rel.split("/")[0] + ("/" if "/" in rel else "")
        assert (
            f"refusing to run the quickstart in '{out}': it is not empty: it holds {top}, and is not" in err
        )
        assert "Nothing in it was changed. Choose a new --out" in err and "Traceback" not in err
        assert _tree(out) == before, rel
    out = tmp_path / "study"
    (out / "shared" / "data").mkdir(parents=True)
    (out / "shared" / "data" / "x").write_text("mine")
    before = _tree(out)
    argv = [
        "study",
        "frontier",
        "--task",
        "arith",
        "--budget",
        "ci",
        "--only",
        "ppo:beta=0.3",
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 2
    assert (
        f"refusing to run the study in '{out}': it is not empty: it holds shared/" in capsys.readouterr().err
    )
    assert _tree(out) == before


@pytest.mark.slow
def test_user_files_inside_a_pipeline_run_are_never_deleted(tmp_path, capsys):
    """In a pipeline's own run directory: a stage that would run again (data, sft without a checkpoint,
    ppo with one) refuses while its directory holds a file shifu did not write; a stage directory shifu did
    not make (rm/, soup/) is refused; a top-level result the user changed is never overwritten. Every
    refusal changes nothing, and a run that needs none of those places leaves them as they are."""
    from shifu.pipelines.quickstart import PLANS
    from shifu.pipelines.stages import Stages

    out = tmp_path / "run"
    assert cli_main(_quickstart(out)) == 0
    capsys.readouterr()
    (out / "notes.txt").write_text("mine")
    for stage, name in (("data", "prepare"), ("sft", "sft"), ("ppo", "ppo")):
        marker = (out / stage / "DONE").read_text()
        (out / stage / "DONE").unlink()  # unfinished: the stage runs again
        (out / stage / "x").write_text("mine")
        before = _tree(out)
        assert cli_main(_quickstart(out)) == 2, stage
        err = capsys.readouterr().err
        assert (
            f"stage {name} would start again in '{out / stage}', which holds x: not written by shifu" in err
        )
        assert _tree(out) == before, stage
        (out / stage / "x").unlink()
        (out / stage / "DONE").write_text(marker)
    assert ckpt.latest_checkpoint(out / "ppo") is not None and ckpt.latest_checkpoint(out / "sft") is None

    for stage in ("rm", "soup"):
        (out / stage).mkdir()
        (out / stage / "x").write_text("mine")
    with pytest.raises(ShifuError, match=f"stage rm: '{out / 'rm'}' holds x, but shifu did not make it"):
        Stages(out, 0, "quickstart").rm(PLANS[("imdb", "tiny")]["rm"], out / "sft" / "final")  # imdb's stage
    before = _tree(out / "soup")
    assert cli_main(_quickstart(out, "soup.members=2")) == 2  # trains ppo-2, then meets soup/
    assert f"stage soup: '{out / 'soup'}' holds x, but shifu did not make it" in capsys.readouterr().err
    assert _tree(out / "soup") == before

    summary = out / "summary.json"
    for path, mine in ((summary, '{"mine": 1}'), (out / "report" / "gold_vs_kl.png", "my plot")):
        theirs = path.read_bytes()
        path.write_text(mine)
        assert cli_main(_quickstart(out)) == 2
        err = capsys.readouterr().err
        assert f"'{path}' would be overwritten, but it was changed since the pipeline wrote it" in err
        assert path.read_text() == mine
        path.write_bytes(theirs)

    assert cli_main(_quickstart(out)) == 0  # nothing in the way: the run goes on (evaluation again)
    for rel in ("notes.txt", "rm/x", "soup/x"):
        assert (out / rel).read_text() == "mine", rel
    assert json.loads(summary.read_text())["task"] == "arith"
    from shifu.pipelines.run_dirs import claim_stage

    for stage in ("data", "sft", "ppo", "ppo-2"):
        claim_stage(out / stage, stage)  # all a real run leaves in a stage directory is shifu's


def test_quickstart_into_a_finished_sft_run_is_refused(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "rev-sft"
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    argv = [
        "sft",
        "--out",
        str(run),
        f"model.path={tiny_model_dir}",
        f"data.train={data}",
        "max_steps=2",
        "batch_size=8",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli_main(argv) == 0
    before = _tree(run)
    assert b"eval/sft/loss" in before["summary.json"]
    assert cli_main(_quickstart(run)) == 2
    err = capsys.readouterr().err
    assert f"refusing to run the quickstart in '{run}': it is a shifu trainer's run directory, holding" in err
    assert "no .shifu-pipeline" in err and "Choose a new --out" in err
    assert _tree(run) == before  # its summary.json, and everything else


# ------------------------------------------------------------------------ real processes, one directory


def _start(out: Path, log: Path, *sets: str, **env: str) -> subprocess.Popen:
    environ = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", **env}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "shifu", *_quickstart(out, *sets)],
            env=environ,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def _wait_for(cond, proc: subprocess.Popen, log: Path, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


GATED = ["sft.max_steps=60", "sft.save_every=10", "ppo.reward.function=pipeline_gate:exact_match_after_gate"]
OFFSETS = {  # when the second process starts: what the first has made by then
    "right away": lambda out: True,
    "sft/ appears": lambda out: (out / "sft").is_dir(),  # SFT starting, no checkpoint: the restart path
    "sft checkpoint": lambda out: (out / "sft" / ckpt.CKPT_DIR / "latest").exists(),  # the resume path
}


@pytest.mark.slow
@pytest.mark.parametrize("offset", list(OFFSETS))
def test_a_second_pipeline_on_a_live_directory_is_refused(offset, tmp_path, capsys):
    out, gate = tmp_path / "a", tmp_path / "gate"
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = _start(out, logs[0], *GATED, SHIFU_TEST_GATE=str(gate))
    procs = [first]
    try:
        _wait_for(lambda: OFFSETS[offset](out), first, logs[0], offset)
        procs.append(_start(out, logs[1], *GATED))
        while all(p.poll() is None for p in procs):  # one of them is refused
            time.sleep(0.05)
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner, err = procs[1 - loser], logs[loser].read_text()
        assert procs[loser].returncode == 2 and "Traceback" not in err, err
        assert offset == "right away" or winner is first  # (started together, either may take the lock)
        live = f"pid {winner.pid} on {socket.gethostname()}, since "
        assert f"output directory '{out}' is in use by a running shifu process ({live}" in err
        assert "shifu quickstart --task arith" in err and f"kill -TERM {winner.pid}" in err
        if offset == "sft checkpoint":  # a trainer's own --overwrite / --resume of the live pipeline's stage
            data = out / "data"
            for flag in ("--overwrite", "--resume"):
                argv = [
                    "sft",
                    "--out",
                    str(out / "sft"),
                    flag,
                    f"model.path={data / 'base'}",
                    f"data.train={data / 'sft_train.jsonl'}",
                    "progress=false",
                ]
                capsys.readouterr()
                assert cli_main(argv) == 2, flag
                err = capsys.readouterr().err
                assert (
                    f"inside '{out}', the run directory of a running shifu pipeline (pid {first.pid} on"
                    in err
                )
        gate.touch()
        assert winner.wait(timeout=600) == 0, logs[1 - loser].read_text()[-3000:]
        assert "Traceback" not in logs[1 - loser].read_text()
        assert json.loads((out / "summary.json").read_text())["task"] == "arith"
        assert _steps(out / "sft") == [
            0,
            20,
            40,
            60,
            60,
        ]  # one SFT run (evaluated at 0 and 60), never restarted
    finally:
        gate.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_a_killed_pipelines_lock_is_taken_over(tmp_path, capsys):
    """SIGKILL in the middle of SFT (no checkpoint): its lock file still names it, but the kernel dropped
    the lock; the next run takes it over, says so, refuses a user's file where its results go, and once
    that is moved starts SFT again (deleting only what shifu wrote there) and finishes."""
    out, log = tmp_path / "a", tmp_path / "killed.log"
    killed = _start(out, log, "sft.max_steps=100000", "sft.log_every=5")
    try:
        logged = out / "sft" / "metrics.jsonl"
        _wait_for(lambda: logged.exists() and len(_steps(out / "sft")) >= 3, killed, log, "SFT log rows")
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert json.loads((out / ckpt.LOCK_FILE).read_text())["pid"] == killed.pid
    assert ckpt.latest_checkpoint(out / "sft") is None
    (out / "samples_before.jsonl").write_text("mine")  # where the evaluation writes
    assert cli_main(_quickstart(out)) == 2
    err = capsys.readouterr().err
    assert f"shifu: '{out}' was locked by pid {killed.pid}" in err and "taking its lock over" in err
    assert f"'{out / 'samples_before.jsonl'}' would be overwritten, but it was not written by it" in err
    assert (out / "samples_before.jsonl").read_text() == "mine"
    assert _steps(out / "sft")[:3] == [0, 5, 10]  # the refusal changed nothing
    (out / "samples_before.jsonl").unlink()
    assert cli_main(_quickstart(out)) == 0
    assert f"'{out}' was locked" not in capsys.readouterr().err  # the refused run let go of it properly
    assert _steps(out / "sft") == [0, 20, 20]  # SFT started again: the killed run's rows are gone
    assert json.loads((out / "summary.json").read_text())["task"] == "arith"

"""Stop signals under torchrun (2 CPU processes, gloo, DDP ``shifu sft``, real launcher, real signals):

- **a signal to every process of the job** (Slurm's ``scancel`` signals every process of a job step,
  systemd every process of a service; torchrun starts each rank in a process group of its own, so a terminal's
  Ctrl-C or ``kill -- -PGID`` of the launcher's group reaches the launcher alone): each rank gets it twice,
  directly and forwarded by the launcher. Every rank still finishes its step, one checkpoint is written,
  every shifu process exits 0, ``shifu launch`` exits 128 + the signal (143 for SIGTERM, 130 for SIGINT),
  and ``--resume`` ends bit-identical to the uninterrupted run;
- **torchrun's shutdown timeout** (``shifu launch --shutdown-timeout``; shifu's default
  ``SHUTDOWN_TIMEOUT_S``): a checkpoint slower than the timeout is cut (the launcher kills the ranks, no
  checkpoint is left); within it, it completes.

``dist_scripts/slow_checkpoint.py`` makes each checkpoint take a given time (a slow disk).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_resume import metric_rows, weights_digest
from test_torchrun_faults import (  # noqa: F401 (data: a fixture)
    Launch,
    data,
    latest_step,
    logged_step,
    preempted_and_resumed,
    sft_argv,
)

from shifu.runs import checkpoint as ckpt

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
COMMON = ("max_steps=30", "save_every=7", "distributed.strategy=ddp", "distributed.timeout_s=60")


def to_every_process(run: Launch, sig: signal.Signals) -> None:
    """``sig`` to every process of the job, launcher first, as a scheduler signals a job step."""
    ranks = run.workers()
    assert len(ranks) == 2, ranks
    os.killpg(run.proc.pid, sig)  # the launcher's process group (the test gave it one of its own)
    for pid in ranks.values():
        os.killpg(os.getpgid(pid), sig)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, data, tmp_path_factory) -> Path:  # noqa: F811
    """The 2-process run that the stopped and resumed ones must equal."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run = Launch(tmp, "full", *sft_argv(tiny_model_dir, data, tmp / "full", *COMMON))
    assert run.wait() == 0, run.output()[-3000:]
    return tmp / "full"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_every_process_checkpoints_once_and_resume_is_bit_identical(
    tiny_model_dir,
    data,  # noqa: F811
    uninterrupted,
    tmp_path,
    sig,
):
    full, part, stopped = preempted_and_resumed(
        tmp_path,
        lambda out: sft_argv(tiny_model_dir, data, out, *COMMON),
        "sft",
        "step",
        30,
        stop=to_every_process,
        sig=sig,
        full=uninterrupted,
    )
    log = (tmp_path / "part.log").read_text()
    assert log.count(f"shifu: got {sig.name}; finishing this step") == 2, log[-3000:]  # once per rank
    assert weights_digest(part / "final") == weights_digest(full / "final")
    assert metric_rows(part) == metric_rows(full)
    print(f"{sig.name} to every process at step {stopped}: exit {128 + sig}, resumed to 30 bit-identical")


SLOW_S = 8  # each checkpoint's extra time on the slow disk


def slow_run(tmp: Path, name: str, model: Path, data: dict, *options: str) -> tuple[Path, Launch]:  # noqa: F811
    """A 2-process DDP sft under ``shifu launch [options]`` whose only checkpoint is the one a signal
    asks for, taking ``SLOW_S`` seconds more than it would."""
    out = tmp / name
    argv = sft_argv(model, data, out, "max_steps=100000", "save_every=0", *COMMON[2:])
    return out, Launch(
        tmp, name, *argv, launcher="shifu", options=options, script=("slow_checkpoint.py", str(SLOW_S))
    )


def test_a_slow_checkpoint_completes_within_the_shutdown_timeout(tiny_model_dir, data, tmp_path):  # noqa: F811
    """Two jobs side by side, SIGTERM to each launcher at step 2: under ``--shutdown-timeout 2`` the
    launcher kills rank 0 inside its 8 s checkpoint (none is left, only its ``.tmp`` directory); under
    shifu launch's default it completes and every process exits 0."""
    cut_out, cut = slow_run(tmp_path, "cut", tiny_model_dir, data, "--shutdown-timeout", "2")
    done_out, done = slow_run(tmp_path, "done", tiny_model_dir, data)
    for run, out in ((cut, cut_out), (done, done_out)):
        run.wait_for(lambda out=out: logged_step(out) >= 2, "step 2")
    t0 = time.monotonic()
    for run in (cut, done):
        os.kill(run.proc.pid, signal.SIGTERM)
    codes = {"cut": cut.wait(120), "done": done.wait(120)}
    log = done.output()
    print(
        f"SIGTERM, then an {SLOW_S} s checkpoint: both launchers exited after {time.monotonic() - t0:.1f} s"
    )
    assert codes == {"cut": 143, "done": 143}, (codes, cut.output()[-2000:], log[-2000:])
    # past the timeout: rank 0 killed inside its write (rank 1, waiting for it, is killed too or first
    # sees it gone), no checkpoint but the unfinished one
    assert 0 not in cut.exit_codes() and cut.exit_codes().get(1, 2) == 2, cut.output()[-3000:]
    assert "forcefully exiting via" in cut.output(), cut.output()[-3000:]
    assert latest_step(cut_out) == -1 and list((cut_out / "checkpoints").glob(".tmp-step-*"))
    # within it: the checkpoint of the step each rank stopped at, complete
    assert done.exit_codes() == {0: 0, 1: 0}, log[-3000:]
    assert "slow disk: .tmp-step-" in log, log[-3000:]
    said = [line for line in log.splitlines() if "shifu sft: stopped at step" in line]
    assert len(said) == 1, log[-3000:]
    stopped = int(said[0].split("stopped at step ")[1].split()[0])
    latest = ckpt.latest_checkpoint(done_out)
    assert latest is not None and latest.name == f"step-{stopped:08d}"
    assert ckpt.checkpoint_problem(latest) is None


def test_ctrl_c_twice_stops_every_rank_at_once(tiny_model_dir, data, tmp_path):  # noqa: F811
    """Ctrl-C, then Ctrl-C again while the ranks write their checkpoint (a slow one here, 30 s): torchrun
    answers the second with a SIGTERM to every rank, which is not the signal that started the stop, so the
    ranks end at once, without the checkpoint, and the launcher exits 130. (Waiting for the checkpoint
    would have given exit statuses 0 and a checkpoint.)"""
    out = tmp_path / "run"
    argv = sft_argv(tiny_model_dir, data, out, "max_steps=100000", "save_every=0", *COMMON[2:])
    run = Launch(tmp_path, "twice", *argv, launcher="shifu", script=("slow_checkpoint.py", "30"))
    run.wait_for(lambda: logged_step(out) >= 2, "step 2")
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal sends its foreground process group
    run.wait_for(lambda: "slow disk: .tmp-step-" in run.output(), "the checkpoint write")
    os.killpg(run.proc.pid, signal.SIGINT)
    code, log = run.wait(120), run.output()
    codes = run.exit_codes()  # rank 0 killed inside its write; rank 1 killed, or first sees it gone (2)
    assert code == 130 and 0 not in codes and codes.get(1, 2) == 2, (code, codes, log[-3000:])
    assert latest_step(out) == -1, log[-3000:]
    assert log.count("shifu: got SIGINT; finishing this step") == 2, log[-3000:]

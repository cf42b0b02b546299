"""Faults under torchrun (2 CPU processes, gloo), with the real launcher and real signals:

- SIGKILL of one rank (rank 0, which holds the directory's lock): the other exits at once with one message
  naming the last checkpoint and the command that continues (no hang, no traceback from shifu); ``--resume``
  continues, taking over the dead run's lock;
- a rank that stops answering (SIGSTOP): the other gives up after ``distributed.timeout_s``, with a message;
- SIGTERM to the launcher (a scheduler's preemption), launched with ``shifu launch``: every rank finishes
  its step, one checkpoint is written, every shifu process exits 0, the launcher exits 143 (128 + 15), and
  ``--resume`` ends bit-identical to an uninterrupted 2-process run (DDP here; FSDP2 and DeepSpeed in
  ``test_torchrun_resume.py``). Plain torchrun exits 1 there (torch elastic re-raises the signal it got).

Each process's exit status is recorded by ``dist_scripts/shifu_rc.py`` (torchrun reports none after a
signal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_jsonl
from test_resume import metric_rows, weights_digest

from shifu.runs import checkpoint as ckpt

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]


def env() -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1"}
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), e.get("PYTHONPATH", "")])
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


LAUNCHERS = {"torchrun": ["torch.distributed.run"], "shifu": ["shifu", "launch"]}


class Launch:
    """``torchrun --standalone --nproc_per_node 2 dist_scripts/shifu_rc.py RC_DIR ARGV...`` (or ``shifu
    launch`` with the same arguments), output in a log."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        *argv: str,
        launcher: str = "torchrun",
        options: tuple[str, ...] = (),
        script: tuple[str, ...] = ("shifu_rc.py",),
    ):
        """``options``: more of the launcher's own; ``script``: another ``dist_scripts`` script that takes
        RC_DIR ARGV... after its own arguments (``("slow_checkpoint.py", "8")``)."""
        self.rc_dir, self.log = tmp / f"{name}.rc", tmp / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            *LAUNCHERS[launcher],
            *options,
            "--standalone",
            "--nproc_per_node",
            "2",
            str(HERE / "dist_scripts" / script[0]),
            *script[1:],
            str(self.rc_dir),
            *argv,
        ]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env(), stdout=f, stderr=f, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, cond, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"torchrun ended before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {what} after {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"torchrun still running after {timeout} s:\n{self.output()[-4000:]}"
            ) from None

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def workers(self) -> dict[int, int]:
        """rank -> pid of the launcher's worker processes."""
        out = {}
        for d in Path("/proc").iterdir():
            try:
                if (
                    d.name.isdigit()
                    and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == self.proc.pid
                ):
                    environ = dict(
                        x.split("=", 1) for x in (d / "environ").read_text().split("\0") if "=" in x
                    )
                    out[int(environ["RANK"])] = int(d.name)
            except (OSError, KeyError, ValueError, IndexError):
                continue
        return out

    def exit_codes(self) -> dict[int, int]:
        """rank -> the exit status each shifu process returned (a process killed before it returned: absent)."""
        return {int(p.name.split("-")[1]): int(p.read_text()) for p in sorted(self.rc_dir.glob("rank-*"))}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("torchrun_faults")
    rows = [
        {
            "prompt": f"say {i}:",
            "response": " " + " ".join(WORDS[(i + j) % 7] for j in range(1 + (5 * i) % 9)),
        }
        for i in range(24)
    ]
    return {"train": write_jsonl(d / "train.jsonl", rows), "eval": write_jsonl(d / "eval.jsonl", rows[:6])}


def sft_argv(model: Path, data: dict, out: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data['train']}",
        f"data.eval={data['eval']}",
        "batch_size=4",
        "eval.batch_size=4",
        "optim.lr=1e-3",
        "optim.schedule=constant",
        "log_every=1",
        "eval.every=10",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def latest_step(run: Path) -> int:
    try:
        p = ckpt.latest_checkpoint(run)
    except ckpt.ShifuError:
        return -1
    return -1 if p is None else int(p.name.split("-")[1])


def logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    return max([json.loads(x)["step"] for x in lines if x.strip().endswith("}")], default=-1)


def test_sigkill_of_one_rank_stops_the_other_with_a_message_and_resume_continues(
    tiny_model_dir, data, tmp_path
):
    out, timeout = tmp_path / "run", 60
    run = Launch(
        tmp_path,
        "killed",
        *sft_argv(
            tiny_model_dir,
            data,
            out,
            "max_steps=100000",
            "save_every=3",
            "distributed.strategy=ddp",
            f"distributed.timeout_s={timeout}",
        ),
    )
    run.wait_for(lambda: latest_step(out) >= 3, "a checkpoint")
    os.kill(run.workers()[0], signal.SIGKILL)  # rank 0: the one holding the directory's lock
    t0 = time.monotonic()
    run.wait(timeout + 60)
    elapsed = time.monotonic() - t0
    log = run.output()
    print(f"rank 1 of a job whose rank 0 was SIGKILLed exited {elapsed:.1f} s later")
    assert elapsed < timeout, log[-3000:]
    assert "shifu sft: error: process 1 of 2 lost another process of this torchrun job" in log, log[-3000:]
    assert f"the last checkpoint is {out / 'checkpoints'}/step-" in log and "torchrun command --resume" in log
    assert "[rank1]: Traceback" not in log
    assert run.exit_codes() == {1: 2}  # rank 0 was killed before it could return
    # the corrected (here: the same) command with --resume continues from that checkpoint
    step = latest_step(out)
    again = Launch(
        tmp_path,
        "resumed",
        *sft_argv(
            tiny_model_dir,
            data,
            out,
            f"max_steps={step + 2}",
            "save_every=3",
            "distributed.strategy=ddp",
            f"distributed.timeout_s={timeout}",
            "--resume",
        ),
    )
    assert again.wait() == 0, again.output()[-3000:]
    assert again.exit_codes() == {0: 0, 1: 0}
    assert "no longer running; taking its lock over" in again.output()
    assert logged_step(out) == step + 2 and (out / "final" / "model.safetensors").exists()


def test_a_rank_that_stops_answering_is_given_up_after_the_timeout(tiny_model_dir, data, tmp_path):
    out, timeout = tmp_path / "run", 5
    run = Launch(
        tmp_path,
        "stopped",
        *sft_argv(
            tiny_model_dir,
            data,
            out,
            "max_steps=100000",
            "save_every=3",
            "distributed.strategy=ddp",
            f"distributed.timeout_s={timeout}",
        ),
    )
    run.wait_for(lambda: latest_step(out) >= 3, "a checkpoint")
    rank1 = run.workers()[1]
    os.kill(rank1, signal.SIGSTOP)  # alive, but silent: no connection is closed
    t0 = time.monotonic()
    try:
        run.wait_for(lambda: "process 0 of 2 lost another process" in run.output(), "rank 0's message", 120)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(rank1, signal.SIGCONT)
    run.wait(120)
    print(f"rank 0 gave up on a silent rank 1 after {elapsed:.1f} s (distributed.timeout_s={timeout})")
    assert timeout * 0.8 < elapsed < timeout + 20
    assert "timed out" in run.output().lower() and "[rank0]: Traceback" not in run.output()
    assert run.exit_codes().get(0) == 2


def to_the_launcher(run: Launch, sig: signal.Signals) -> None:
    """``sig`` to the launcher only, as a scheduler preempting the job sends it."""
    os.kill(run.proc.pid, sig)


def preempted_and_resumed(
    tmp_path: Path,
    argv,
    what: str,
    unit: str,
    end: int,
    stop=to_the_launcher,
    sig: signal.Signals = signal.SIGTERM,
    full: Path | None = None,
) -> tuple[Path, Path, int]:
    """The same 2-process command run uninterrupted (into ``full``, unless given one that ran) and,
    alongside, into ``part`` under ``shifu launch`` with ``stop(run, sig)`` (default: ``sig`` to the
    launcher) once ``unit`` 2 is logged, then ``--resume`` to the end. Checks that every shifu process exited
    0 after one checkpoint at the step it stopped and that the launcher exited 128 + ``sig``; returns (full,
    part, that step)."""
    whole = None
    if full is None:
        full = tmp_path / "full"
        whole = Launch(tmp_path, "full", *argv(full))
    part = tmp_path / "part"
    run = Launch(tmp_path, "part", *argv(part), launcher="shifu")
    run.wait_for(lambda: logged_step(part) >= 2, f"{unit} 2")
    stop(run, sig)
    code = run.wait(120)
    log = run.output()
    assert run.exit_codes() == {0: 0, 1: 0}, log[-3000:]  # every shifu process checkpointed and exited 0
    assert code == 128 + sig, (code, log[-3000:])  # what a scheduler reads: ended by that signal
    assert f"shifu launch: got {sig.name}" in log, log[-3000:]
    said = [line for line in log.splitlines() if f"shifu {what}: stopped at {unit}" in line]
    assert len(said) == 1 and "with a checkpoint" in said[0] and "--resume" in said[0], log[-3000:]
    stopped = int(said[0].split(f"stopped at {unit} ")[1].split()[0])
    assert 2 <= stopped < end and latest_step(part) == stopped, (stopped, latest_step(part))
    resumed = Launch(tmp_path, "resumed", *argv(part), "--resume")
    assert resumed.wait() == 0, resumed.output()[-3000:]
    assert whole is None or whole.wait() == 0, whole.output()[-3000:]
    assert resumed.exit_codes() == {0: 0, 1: 0}
    return full, part, stopped


def test_sigterm_to_the_launcher_checkpoints_and_ddp_resume_is_bit_identical(tiny_model_dir, data, tmp_path):
    common = ("max_steps=30", "save_every=7", "distributed.strategy=ddp", "distributed.timeout_s=60")
    full, part, stopped = preempted_and_resumed(
        tmp_path, lambda out: sft_argv(tiny_model_dir, data, out, *common), "sft", "step", 30
    )
    assert weights_digest(part / "final") == weights_digest(full / "final")
    assert metric_rows(part) == metric_rows(full)
    print(f"ddp: SIGTERM at step {stopped}, resumed to 30: final weights and metrics bit-identical")


def test_shifu_launch_exits_with_the_status_of_a_failed_process(tiny_model_dir, data, tmp_path):
    """A refused config fails every process with status 2; ``shifu launch`` exits 2 with them (torchrun: 1)."""
    out = tmp_path / "run"
    run = Launch(tmp_path, "refused", *sft_argv(tiny_model_dir, data, out, "optim.lr=-1"), launcher="shifu")
    code = run.wait(240)
    log = run.output()
    # the first process to refuse exits 2; the launcher then stops the other, which may not get to record its
    # own status (it refuses the same config, so what it records is 2 as well)
    codes = run.exit_codes()
    assert codes and set(codes.values()) == {2}, (codes, log[-3000:])
    assert code == 2 and "shifu launch: process" in log and "exited with status 2" in log, (code, log[-3000:])

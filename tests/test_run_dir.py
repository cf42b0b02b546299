"""No progress lost, no rerun blocked: checkpoint writes never delete the last good checkpoint before its
successor is in place, ``latest`` never names a missing directory (and if a hand-damaged directory makes it
do so, ``--resume`` falls back to the newest complete checkpoint and says so), and one run per directory
(a live run's directory is refused; the lock of a killed run is taken over).

The kills are real: forked children ``os._exit`` at the k-th file-system operation of a checkpoint write,
for every k, and real ``python -m shifu`` processes are SIGKILLed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl
from ppo_task import build_char_model, write_prompts
from safetensors.torch import load_file
from test_resume import metric_rows, weights_digest
from test_sft import corpus

from shifu.cli import main as cli
from shifu.errors import ShifuError
from shifu.runs import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8)


def _save(run: Path, step: int, m: torch.nn.Module, keep_last: int = 2) -> Path:
    return ckpt.save_checkpoint(run, step, {"m": m}, {"opt": {"x": torch.ones(2)}}, {"seed": step}, keep_last)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model-m.safetensors"))


def _same(a: dict, b: torch.nn.Module) -> bool:
    return all(torch.equal(a[k], v) for k, v in b.state_dict().items())


def _killed_at(run: Path, k: int, write) -> int:
    """Run ``write()`` in a forked child that dies (``os._exit(137)``, no clean-up) just before its k-th
    file-system operation of the checkpoint module; returns the child's exit code (0: fewer than k ops)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            calls = {"n": 0}

            def dying(fn):
                def op(*args, **kwargs):
                    calls["n"] += 1
                    if calls["n"] == k:
                        os._exit(137)
                    return fn(*args, **kwargs)

                return op

            ckpt.os.replace, ckpt.os.link = dying(os.replace), dying(os.link)
            ckpt.shutil.rmtree, ckpt.save_model = dying(shutil.rmtree), dying(ckpt.save_model)
            ckpt.torch.save, ckpt.os.fsync = dying(torch.save), dying(os.fsync)
            write()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.integration
@pytest.mark.parametrize("rewrite", [True, False], ids=["same step again", "next step"])
def test_a_kill_at_any_moment_of_a_checkpoint_write_leaves_a_complete_latest(tmp_path, rewrite, capfd):
    """Every operation of a write is a possible moment of death. After each one: ``latest`` names a
    complete checkpoint holding the old or the new weights (never none: the old code deleted step-N before
    the new step-N was renamed into place, so a kill there left ``latest`` naming nothing), nothing is
    printed about a fallback, and the next write succeeds and leaves no debris."""
    base, old, new = tmp_path / "base", _module(1), _module(2)
    _save(base, 1, _module(0))
    _save(base, 2, old)
    step = 2 if rewrite else 3
    outcomes, k = set(), 1
    while True:
        run = tmp_path / f"k{k}"
        shutil.copytree(base, run)
        code = _killed_at(run, k, lambda run=run: _save(run, step, new))
        latest = ckpt.latest_checkpoint(run)
        assert latest is not None and ckpt.checkpoint_problem(latest) is None, (k, latest)
        got = _weights(latest)
        outcome = "new" if _same(got, new) else "old"
        assert outcome == "new" or _same(got, old), k
        assert ckpt.read_state(latest)["step"] == (step if outcome == "new" else 2)
        ckpt.load_checkpoint(latest, {"m": _module(9)})
        outcomes.add(outcome)
        _save(run, step + 1, _module(3))  # the next write clears what the dead one left
        names = sorted(p.name for p in (run / ckpt.CKPT_DIR).iterdir())
        assert names[0] == "latest" and names[-1] == f"step-{step + 1:08d}" and len(names) == 3, (k, names)
        if code == 0:
            break
        assert code == 137
        k += 1
    assert outcomes == {"old", "new"} and k > 10, (outcomes, k)  # both sides of the swap were reached
    assert "newest complete checkpoint" not in capfd.readouterr().err


@pytest.mark.unit
def test_latest_naming_a_damaged_directory_falls_back_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    kept = [_module(i) for i in range(4)]
    for i, m in enumerate(kept[1:], start=1):
        _save(run, i, m, keep_last=3)
    root = run / ckpt.CKPT_DIR
    shutil.rmtree(root / "step-00000003")  # deleted by hand
    assert ckpt.latest_checkpoint(run) == root / "step-00000002"
    err = capsys.readouterr().err
    assert (
        f"{root / 'latest'} names 'step-00000003', but it does not exist; using {root / 'step-00000002'}"
        in err
    )
    f = root / "step-00000002" / "model-m.safetensors"
    f.write_bytes(f.read_bytes()[:-10])  # truncated by hand
    assert ckpt.latest_checkpoint(run) == root / "step-00000001"
    assert "using" in capsys.readouterr().err
    with pytest.raises(ShifuError, match=r"step-00000002.*truncated"):
        ckpt.load_checkpoint(root / "step-00000002", {"m": _module(9)})
    (root / "latest").unlink()  # the pointer deleted: the newest complete step is still found
    assert ckpt.latest_checkpoint(run) == root / "step-00000001"
    assert f"{root / 'latest'} is missing" in capsys.readouterr().err
    (root / "step-00000001" / "state.pt").write_bytes(b"")
    with pytest.raises(ShifuError, match=r"no other checkpoint in .* is complete.*--overwrite"):
        ckpt.latest_checkpoint(run)


@pytest.mark.unit
def test_a_checkpoint_with_a_damaged_state_file_is_named(tmp_path):
    path = _save(tmp_path / "run", 1, _module(1))
    (path / "state.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(
        ShifuError, match=r"cannot read the state of checkpoint '.*step-00000001'.*--overwrite"
    ):
        ckpt.load_checkpoint(path, {"m": _module(9)})


# ------------------------------------------------------------------ through the trainers
def _sft_argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data}",
        "batch_size=8",
        "optim.schedule=constant",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


@pytest.mark.integration
def test_resume_past_a_hand_deleted_checkpoint_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(_sft_argv(tiny_model_dir, data, full, "max_steps=4", "save_every=1", "keep_last=3")) == 0
    assert cli.main(_sft_argv(tiny_model_dir, data, part, "max_steps=3", "save_every=1", "keep_last=3")) == 0
    shutil.rmtree(part / ckpt.CKPT_DIR / "step-00000003")  # latest now names a missing directory
    capsys.readouterr()
    argv = _sft_argv(tiny_model_dir, data, part, "max_steps=4", "save_every=1", "keep_last=3", "--resume")
    assert cli.main(argv) == 0
    assert "names 'step-00000003', but it does not exist; using" in capsys.readouterr().err
    assert weights_digest(part / "final") == weights_digest(full / "final")
    after = [[r for r in metric_rows(run) if r["step"] >= 3] for run in (part, full)]
    assert after[0] == after[1] and after[0]


@pytest.fixture(scope="module")
def ppo_task(tmp_path_factory):
    d = tmp_path_factory.mktemp("run_dir_ppo")
    return {"model": build_char_model(d / "model"), "prompts": write_prompts(d / "prompts.jsonl")}


def _ppo_argv(task, out: Path, *extra: str) -> list[str]:
    return [
        "ppo",
        "--out",
        str(out),
        f"model.path={task['model']}",
        f"data.train={task['prompts']}",
        "reward.function=ppo_task:frac_a",
        "critic.init=sft",
        "batch_size=8",
        "minibatch_size=4",
        "generation.max_new_tokens=6",
        "eval.every=0",
        "iterations=2",
        "save_every=2",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


@pytest.mark.integration
def test_ppo_killed_while_its_closing_save_rewrites_the_last_step_resumes_exactly(ppo_task, tmp_path):
    """iterations a multiple of save_every: the closing save rewrites step-N. A kill in the middle of that
    rewrite (after step-N is renamed away, before the new one takes its place) used to leave ``latest``
    naming a missing directory, and --resume started over; now --resume continues from step-N."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(_ppo_argv(ppo_task, full)) == 0
    pid = os.fork()
    if pid == 0:  # the child dies right after the old step-2 is renamed away (inside the rewrite)
        code = 1
        try:
            real = os.replace

            def replace(src, dst):
                real(src, dst)
                if Path(src).name == "step-00000002" and ".trash" in Path(dst).name:
                    os._exit(137)

            ckpt.os.replace = replace
            code = cli.main(_ppo_argv(ppo_task, part))
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 137
    root = part / ckpt.CKPT_DIR
    assert not (root / "step-00000002").exists()  # the moment the old code left latest naming nothing
    assert ckpt.latest_checkpoint(part) == root / ckpt.PREV_DIR / "step-00000002"
    assert cli.main(_ppo_argv(ppo_task, part, "--resume")) == 0
    assert weights_digest(part / "final") == weights_digest(full / "final")
    assert metric_rows(part) == metric_rows(full)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]


# ------------------------------------------------------------------ one run per directory
def _env() -> dict[str, str]:
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    return env


def _wait_for(cond, proc: subprocess.Popen, log: Path, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


@pytest.mark.integration
def test_a_live_run_directory_is_refused_and_a_killed_runs_lock_is_taken_over(
    tiny_model_dir, tmp_path, capsys
):
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    run = tmp_path / "run"
    log = tmp_path / "live.log"
    with open(log, "w") as f:
        live = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shifu",
                *_sft_argv(tiny_model_dir, data, run, "max_steps=100000", "save_every=2"),
            ],
            env=_env(),
            stdout=f,
            stderr=f,
            cwd=ROOT,
        )
    try:
        _wait_for(lambda: ckpt.latest_checkpoint(run) is not None, live, log, "a first checkpoint")
        for flags in ([], ["--resume"], ["--overwrite"]):
            code = cli.main(_sft_argv(tiny_model_dir, data, run, "max_steps=100000", "save_every=2", *flags))
            err = capsys.readouterr().err
            assert code == 2 and "Traceback" not in err, err
            assert f"output directory '{run}' is in use by a running shifu process (pid {live.pid}" in err
            assert f"kill -TERM {live.pid}" in err and "choose another --out" in err
            assert (run / "metrics.jsonl").exists() and (run / ckpt.CKPT_DIR / "latest").exists()  # untouched
        assert live.poll() is None  # the live run never noticed
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    step = int(ckpt.latest_checkpoint(run).name.split("-")[1])
    argv = _sft_argv(tiny_model_dir, data, run, f"max_steps={step + 1}", "save_every=2", "--resume")
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert f"was locked by pid {live.pid}" in err and "no longer running; taking its lock over" in err
    assert ckpt.read_state(ckpt.latest_checkpoint(run))["step"] == step + 1
    # a run that ended (unlike a killed one) leaves no owner: the next command says nothing about a lock
    assert (run / ckpt.LOCK_FILE).read_text() == ""
    assert cli.main(_sft_argv(tiny_model_dir, data, run, "max_steps=1", "--overwrite")) == 0
    assert "lock" not in capsys.readouterr().err


@pytest.mark.unit
def test_one_process_may_reuse_its_own_directory(tmp_path):
    """The same process running twice in a directory (notebooks, the pipeline, tests) holds one lock."""
    d = ckpt.prepare_run_dir(tmp_path / "run")
    (d / "metrics.jsonl").write_text("")
    assert ckpt.prepare_run_dir(d, resume=True) == d
    assert ckpt.prepare_run_dir(d, overwrite=True) == d and (d / ckpt.LOCK_FILE).exists()
    assert not (d / "metrics.jsonl").exists()

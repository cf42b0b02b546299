"""Trainer command lines: flags and ``key.sub=value`` overrides in any order, e.g. overrides after --resume."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from test_sft import make_cfg as sft_cfg

from shifu.cli import main as cli
from shifu.runs.tracking import read_metrics


@pytest.mark.unit
@pytest.mark.parametrize("cmd", sorted(cli.TRAINERS))
def test_overrides_mix_with_flags_for_every_trainer(cmd):
    argv = ["a.b=1", "--out", "runs/x", "c=2", "--resume", "d.e=3", "--threads", "1", "f=x=y"]
    args = cli.parse_trainer_args(cmd, argv)
    assert args.overrides == ["a.b=1", "c=2", "d.e=3", "f=x=y"]
    assert args.out == "runs/x" and args.resume and args.threads == 1 and not args.overwrite
    # the usual order (flags first) and no overrides at all still parse
    assert cli.parse_trainer_args(cmd, ["--config", "c.yaml", "--resume", "x=1"]).overrides == ["x=1"]
    assert cli.parse_trainer_args(cmd, ["--out", "o"]).overrides == []


@pytest.mark.unit
def test_rm_ensemble_flag_between_overrides():
    args = cli.parse_trainer_args("rm", ["epochs=1", "--ensemble", "3", "batch_size=4"])
    assert args.ensemble == 3 and args.overrides == ["epochs=1", "batch_size=4"]


@pytest.mark.integration
def test_override_after_resume_is_applied(tiny_model_dir, tmp_path, capsys):
    """A real SFT run through ``shifu.cli.main.main``: overrides between flags, then one after ``--resume``."""
    data = sft_cfg(tiny_model_dir, tmp_path).data  # writes train/eval JSONL
    run = tmp_path / "run"
    common = [
        f"model.path={tiny_model_dir}",
        f"data.train={data.train}",
        f"data.eval={data.eval}",
        "save_every=2",
        "progress=false",
        "tensorboard=false",
    ]
    # overrides on both sides of --out and --threads: plain parse_args rejected the second group
    first = ["sft", "max_steps=2", "--out", str(run), *common[:3], "--threads", "1", *common[3:]]
    assert cli.main(first) == 0
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 2
    # the override placed after --resume: the run continues from step 2 to the new max_steps
    assert cli.main(["sft", *common[:2], "--out", str(run), *common[2:], "--resume", "max_steps=4"]) == 0
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 4
    assert yaml.safe_load((run / "config.yaml").read_text())["max_steps"] == 4
    capsys.readouterr()
    # a malformed override after --resume: exit 2, one line naming it, the run untouched
    assert cli.main(["sft", "--out", str(run), *common, "--resume", "max_steps"]) == 2
    err = capsys.readouterr().err
    assert "override 'max_steps' must look like key.sub=value" in err and "Traceback" not in err
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 4


@pytest.mark.integration
def test_malformed_override_after_resume_in_a_subprocess(tmp_path):
    out = tmp_path / "run"
    argv = ["ppo", "--out", str(out), "kl.target=3", "--resume", "iterations", "--threads", "1"]
    r = subprocess.run([sys.executable, "-m", "shifu", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "override 'iterations' must look like key.sub=value" in r.stderr
    assert "unrecognized arguments" not in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def _without_malloc_settings() -> dict[str, str]:
    """This environment without a malloc setting of the user's (which keep_freed_memory leaves alone)."""
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}


# a process that frees 64 MiB tensors and allocates three more of the same size: their minor page faults
_REUSE = """
import resource, sys, torch
from shifu.parallel.threads import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
for _ in range(24):  # 64 MiB, freed at once: the heap grows until a freed block fits (<= 14 seen), then stops
    torch.empty(16 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    torch.empty(16 << 20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_shifu_keeps_freed_memory_for_reuse_unless_told_not_to():
    """What the ``shifu`` command sets before any command: a freed large block is reused without the kernel
    zero-filling its pages again (glibc alone unmaps it: every page of every new 64 MiB tensor faults in)."""
    base = _without_malloc_settings()

    def faults(**env):
        r = subprocess.run(
            [sys.executable, "-c", _REUSE], capture_output=True, text=True, timeout=120, env={**base, **env}
        )
        assert r.returncode == 0, r.stderr
        return r.stderr.split()[-1], int(r.stdout.split()[-1])

    mode, kept = faults()
    assert mode == "kept" and kept < 1000, (mode, kept)
    mode, system = faults(SHIFU_MALLOC="system")
    assert mode == "system" and system > 3 * 16000 * 0.9, (mode, system)  # 3 x 16384 pages of 4 KiB
    assert faults(MALLOC_ARENA_MAX="2")[0] == "system"  # the user's own malloc setting is left alone


# 512 MiB in 8 MiB tensors allocated and freed on a thread that stays (as the agent gateway's sampling thread
# does), then the same on the main thread: resident MiB before and after the main thread's turn
_THREADS = """
import sys, threading, torch
from shifu.parallel.threads import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
def work():
    xs = [torch.ones(2 << 20) for _ in range(64)]
    del xs
done, end = threading.Event(), threading.Event()
def sampler():
    work(), done.set(), end.wait()
t = threading.Thread(target=sampler)
t.start(), done.wait()
before = rss()
work()
print(before, rss())
end.set(), t.join()
"""


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_memory_one_thread_freed_serves_another_thread():
    """Freed memory is kept in one heap for every thread: what a thread freed (the agent gateway's sampling) is
    reused by the main thread (the update) instead of the process holding both (glibc's arena per thread)."""
    env = _without_malloc_settings()
    r = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stderr.split()[-1] == "kept", r.stderr
    before, after = map(int, r.stdout.split())  # (an arena per thread: +512 MiB)
    assert before > 512 and after - before < 256, (before, after)


# shifu's malloc (kept), then, if asked, shifu serve --policy's (returned): resident MiB before 512 MiB in
# tensors of 1 to 8 MiB, while they live and after they are freed
_RETURNED = """
import sys, torch
from shifu.parallel.threads import keep_freed_memory, return_freed_memory
modes = [keep_freed_memory()] + ([return_freed_memory()] if sys.argv[1] == "serve" else [])
print(*modes, file=sys.stderr)
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
before = rss()
xs = [torch.ones((1 + i % 8) << 18) for i in range(114)]
held = rss()
del xs
print(before, held, rss())
"""


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_serving_hands_freed_large_blocks_back_to_the_kernel():
    """``shifu serve --policy`` replaces the freed memory kept for reuse by large blocks unmapped on free: the
    server's resident memory follows what it holds (kept: the 512 MiB stay with the process)."""
    base = _without_malloc_settings()

    def run(mode, **env):
        r = subprocess.run(
            [sys.executable, "-c", _RETURNED, mode],
            capture_output=True,
            text=True,
            timeout=120,
            env={**base, **env},
        )
        assert r.returncode == 0, r.stderr
        return r.stderr.split(), [int(x) for x in r.stdout.split()]

    modes, (before, held, after) = run("serve")
    assert modes == ["kept", "returned"] and held - before > 450 and after - before < 64, (
        before,
        held,
        after,
    )
    modes, (before, held, after) = run("kept")
    assert modes == ["kept"] and after - before > 450, (before, held, after)
    assert run("serve", SHIFU_MALLOC="system")[0] == ["system", "system"]  # as the user asked: left alone

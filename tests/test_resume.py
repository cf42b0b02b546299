"""Exact resume through the CLI: SIGKILL / crash mid-checkpoint / SIGTERM, then ``--resume``, equals a clean run.

Each trainer (sft, rm, ppo, dpo) runs once uninterrupted, then again as a chain of interrupted processes:

0. SIGKILL before the first checkpoint (``--resume`` then starts over);
1. ``--resume`` with a crash *inside* a checkpoint write (the process dies after half of a weights file is on disk);
2. ``--resume``, then SIGTERM mid-run (sft, rm, ppo; exit 0, a message naming ``--resume``, a checkpoint at the
   step it stopped) or SIGKILL (dpo) once a later checkpoint exists;
3. ``--resume``, SIGKILLed as soon as the next checkpoint write starts (``.tmp-step-*`` appears) or lands;
4. ``--resume`` to the end; 5. ``--resume`` of the finished run changes nothing.

The final weights (sha256 over every safetensors tensor of ``final/``, and ``critic/`` for PPO) and every
``metrics.jsonl`` row (minus ``time/*`` and ``perf/*``) must equal the uninterrupted run's, bit for bit.

Runs are child processes forked from the test process (``shifu.cli.main.main`` with the hooks of
``resume_scripts/run_shifu.py``): real processes, really SIGKILLed, without paying the torch/transformers
import for each of the ~15 runs. ``test_ppo_real_subprocess_sigterm_and_resume`` does the same through
``python -m shifu``-equivalent fresh interpreters.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from conftest import write_jsonl
from ppo_task import build_char_model, write_prompts
from safetensors import safe_open

from shifu.cli import main as cli
from shifu.runs import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "resume_scripts"))
import run_shifu  # noqa: E402

pytestmark = pytest.mark.integration

TIMEOUT = 300  # seconds any single run may take on a very busy machine


# ------------------------------------------------------------------ processes
class Run:
    """``shifu ARGV`` in a forked child; stdout+stderr go to ``log``."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.log, self.rc = log, None
        pid = os.fork()
        if pid == 0:  # child: never returns into pytest
            rc = 1
            try:
                f = open(log, "w", buffering=1)  # noqa: SIM115
                os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
                sys.stdout = sys.stderr = f
                faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)  # where it is, if it hangs
                os.environ.update(env or {})
                run_shifu.install_hooks()
                rc = cli.main(argv)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(rc)
        self.pid = pid

    def poll(self) -> int | None:
        if self.rc is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.rc = os.waitstatus_to_exitcode(status)
        return self.rc

    def wait(self) -> int:
        deadline = time.monotonic() + TIMEOUT
        while self.poll() is None:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGUSR1)  # its stacks into the log
                time.sleep(2)
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise AssertionError(f"run did not finish in {TIMEOUT} s:\n{self.output()}")
            time.sleep(0.01)
        return self.rc

    def signal_when(self, cond, sig: int) -> bool:
        """Send ``sig`` as soon as ``cond()`` holds; False if the run ended first."""
        deadline = time.monotonic() + TIMEOUT
        while self.poll() is None and time.monotonic() < deadline:
            if cond():
                os.kill(self.pid, sig)
                self.wait()
                return True
            time.sleep(0.005)
        self.wait()
        return False

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


# ------------------------------------------------------------------ what must be equal
def weights_digest(*dirs: Path) -> str:
    """sha256 over (file, tensor name, dtype, shape, bytes) of every safetensors tensor under ``dirs``."""
    h = hashlib.sha256()
    for d in dirs:
        files = sorted(d.glob("*.safetensors"))
        assert files, f"no safetensors in {d}"
        for f in files:
            with safe_open(str(f), "pt") as st:
                for name in sorted(st.keys()):
                    t = st.get_tensor(name).contiguous()
                    h.update(f"{f.name}/{name}/{t.dtype}/{tuple(t.shape)}".encode())
                    h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def metric_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def latest_step(run: Path) -> int:
    p = ckpt.latest_checkpoint(run)
    return -1 if p is None else int(p.name.split("-")[1])


def tmp_write_started(run: Path, after: int):
    """A checkpoint write newer than step ``after`` has begun (its .tmp dir exists) or has landed."""

    def cond() -> bool:
        root = run / ckpt.CKPT_DIR
        return latest_step(run) > after or any(
            int(p.name.rsplit("-", 1)[1]) > after for p in root.glob(".tmp-step-*")
        )

    return cond


def logged_step_at_least(run: Path, n: int):
    def cond() -> bool:
        try:
            rows = (run / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return False
        return any(json.loads(r).get("step", 0) >= n for r in rows if r.strip().endswith("}"))

    return cond


def interrupted_chain(
    argv: list[str], run: Path, logs: Path, crash_at: int, term: bool, env: dict | None = None
) -> list[str]:
    """Steps 1-4 of the module docstring on ``run``; returns a line per interruption (for the report)."""
    report = []
    # 0. SIGKILL before the first checkpoint: --resume finds none and starts over (old log lines dropped)
    r = Run(argv, logs / "0.log", env)
    assert r.signal_when(lambda: (run / "metrics.jsonl").exists(), signal.SIGKILL), "ended before SIGKILL"
    report.append(f"SIGKILL before any checkpoint (latest {latest_step(run)}) -> starts over")
    assert latest_step(run) == -1
    # 1. crash in the middle of writing checkpoint `crash_at`: the previous one stays the latest, loadable
    r = Run(
        [*argv, "--resume"], logs / "1.log", {**(env or {}), "SHIFU_TEST_CRASH_IN_CHECKPOINT": str(crash_at)}
    )
    assert r.wait() == 137, r.output()
    before = latest_step(run)
    assert 0 < before < crash_at, before
    assert (run / ckpt.CKPT_DIR / f".tmp-step-{crash_at:08d}").is_dir()  # the torn write is there...
    ckpt.load_checkpoint(ckpt.latest_checkpoint(run), {})  # ...and the previous checkpoint loads
    report.append(f"crash inside checkpoint {crash_at} -> resumed from {before}")
    # 2. resume; SIGTERM (graceful: exit 0 and a checkpoint where it stopped) or SIGKILL mid-run
    r = Run([*argv, "--resume"], logs / "2.log", env)
    if term:
        assert r.signal_when(logged_step_at_least(run, crash_at + 1), signal.SIGTERM), "ended before SIGTERM"
        assert r.rc == 0, r.output()
        assert "--resume" in r.output() and "stopped at" in r.output(), r.output()
        said = re.search(r"stopped at (?:step|iteration) (\d+) with a checkpoint", r.output())
        stopped = latest_step(run)
        assert said and stopped == int(said.group(1)) > crash_at, r.output()
        report.append(f"SIGTERM -> exit 0, checkpoint at {stopped}")
    else:
        assert r.signal_when(tmp_write_started(run, crash_at), signal.SIGKILL), "ended before SIGKILL"
        assert r.rc == -signal.SIGKILL
        stopped = latest_step(run)
        report.append(f"SIGKILL at the checkpoint after {crash_at} -> latest {stopped}")
    # 3. resume; SIGKILL as soon as the next checkpoint write begins (mid-write or just after)
    r = Run([*argv, "--resume"], logs / "3.log", env)
    assert r.signal_when(tmp_write_started(run, stopped), signal.SIGKILL), "ended before SIGKILL"
    assert r.rc == -signal.SIGKILL
    report.append(f"SIGKILL when the checkpoint after {stopped} started -> latest {latest_step(run)}")
    # 4. resume to the end
    r = Run([*argv, "--resume"], logs / "4.log", env)
    assert r.wait() == 0, r.output()
    assert not list((run / ckpt.CKPT_DIR).glob(".tmp-*")), "a stale partial checkpoint was left behind"
    # 5. --resume of a finished run (e.g. killed after its last checkpoint) changes no metrics or weights
    rows, digest = metric_rows(run), weights_digest(run / "final")
    r = Run([*argv, "--resume"], logs / "5.log", env)
    assert r.wait() == 0, r.output()
    assert metric_rows(run) == rows and weights_digest(run / "final") == digest
    return report


def check_equal(clean: Path, resumed: Path, *weight_dirs: str) -> None:
    a, b = metric_rows(clean), metric_rows(resumed)
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert x == y, (x, y)
    for d in weight_dirs:
        assert weights_digest(clean / d) == weights_digest(resumed / d), d


# ------------------------------------------------------------------ data
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_rm import pref_rows
    from test_sft import corpus

    d = tmp_path_factory.mktemp("resume_data")
    return {
        "sft_train": write_jsonl(d / "sft_train.jsonl", corpus(120)),
        "sft_eval": write_jsonl(d / "sft_eval.jsonl", corpus(16, seed=1)),
        "pref_train": write_jsonl(d / "pref_train.jsonl", pref_rows(96)),
        "pref_eval": write_jsonl(d / "pref_eval.jsonl", pref_rows(16, seed=1)),
        "char": build_char_model(d / "char"),
        "prompts": write_prompts(d / "prompts.jsonl"),
    }


def sft_argv(model, data, out) -> list[str]:
    return [
        "sft",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data['sft_train']}",
        f"data.eval={data['sft_eval']}",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "batch_size=8",
        "grad_accum=2",
        "max_steps=14",
        "log_every=3",  # log windows straddle checkpoints: the window must be checkpointed too
        "eval.every=4",
        "save_every=4",  # a SIGTERM between scheduled checkpoints writes its own
        "keep_last=2",
        "progress=false",
        "tensorboard=false",
    ]


def rm_argv(model, data, out) -> list[str]:
    return [
        "rm",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data['pref_train']}",
        f"data.eval={data['pref_eval']}",
        "optim.lr=1e-3",
        "batch_size=8",
        "max_steps=14",
        "log_every=3",
        "eval.every=4",
        "save_every=4",
        "progress=false",
        "tensorboard=false",
        "data.group_by_length=true",  # the length-grouped data order must continue where it was
        "freeze_layers=1",  # and an optimiser over part of the model
    ]


def dpo_argv(model, data, out) -> list[str]:
    return [
        "dpo",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data['pref_train']}",
        f"data.eval={data['pref_eval']}",
        "optim.lr=1e-3",
        "batch_size=8",
        "max_steps=12",
        "log_every=3",
        "eval.every=4",
        "save_every=2",
        "progress=false",
        "tensorboard=false",
    ]


def ppo_argv(data, out) -> list[str]:
    return [
        "ppo",
        "--out",
        str(out),
        f"model.path={data['char']}",
        f"data.train={data['prompts']}",
        "reward.function=ppo_task:frac_a",
        "eval.gold_function=ppo_task:frac_a",
        "critic.init=sft",
        "iterations=12",
        "batch_size=8",
        "minibatch_size=4",
        "ppo_epochs=2",
        "generation.max_new_tokens=6",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "kl.controller=adaptive",  # controller state must survive the restart
        "kl.target=2.0",
        "kl.horizon=64",
        "reward.normalize=true",  # and the running score moments
        "eval.every=3",
        "eval.num_prompts=8",
        "save_every=3",
        f"data.ptx={data['sft_train']}",  # the PPO-ptx data stream must continue where it was
        "ptx_coef=0.1",
    ]


def _clean_and_chain(argv_of, tmp_path, crash_at: int, term: bool, *weight_dirs: str) -> Path:
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    r = Run(argv_of(clean), tmp_path / "clean.log")
    assert r.wait() == 0, r.output()
    report = interrupted_chain(argv_of(resumed), resumed, tmp_path, crash_at, term)
    print("\n".join(report), file=sys.__stderr__)  # the kill points and what each left (shown with -s)
    check_equal(clean, resumed, *weight_dirs)
    return resumed


# ------------------------------------------------------------------ the tests
@pytest.mark.slow
def test_sft_killed_anywhere_resumes_bit_identically(tiny_model_dir, data, tmp_path):
    _clean_and_chain(lambda out: sft_argv(tiny_model_dir, data, out), tmp_path, 8, True, "final")


@pytest.mark.slow
def test_rm_killed_anywhere_resumes_bit_identically(tiny_model_dir, data, tmp_path):
    _clean_and_chain(lambda out: rm_argv(tiny_model_dir, data, out), tmp_path, 8, True, "final")


@pytest.mark.slow
def test_dpo_killed_anywhere_resumes_bit_identically(tiny_model_dir, data, tmp_path):
    _clean_and_chain(lambda out: dpo_argv(tiny_model_dir, data, out), tmp_path, 4, False, "final")


@pytest.mark.slow
def test_ppo_killed_anywhere_resumes_bit_identically(data, tmp_path, capsys):
    resumed = _clean_and_chain(lambda out: ppo_argv(data, out), tmp_path, 6, True, "final", "critic")
    clean = tmp_path / "clean"
    assert (clean / "samples.jsonl").read_text() == (resumed / "samples.jsonl").read_text()
    assert (clean / "best" / "model.safetensors").exists() and weights_digest(
        clean / "best"
    ) == weights_digest(resumed / "best")
    # a changed config is refused by key name (exit 2); a change declared safe (more iterations) is not
    capsys.readouterr()
    assert cli.main([*ppo_argv(data, resumed), "optim.lr=0.5", "kl.target=3.0", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and "kl.target" in err and "Traceback" not in err
    r = Run([*ppo_argv(data, resumed), "iterations=14", "--resume"], tmp_path / "more.log")
    assert r.wait() == 0, r.output()
    assert max(x["step"] for x in metric_rows(resumed)) == 14


@pytest.mark.slow
def test_ppo_with_an_environment_resumes_bit_identically(data, tmp_path):
    """Multi-turn episodes (thirdparty_env:Echo, one fresh instance per episode): the chain of interruptions
    ends with the weights, metrics (env/* included), evaluation transcripts and recorded episodes of the
    uninterrupted run."""
    env = [
        "env.factory=thirdparty_env:Echo",
        "generation.stop=[g,h,i,j,k,l]",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "traces.episodes=true",
    ]

    def argv(out):
        skip = ("reward.function", "eval.gold_function", "data.ptx", "ptx_coef")  # the environment rewards
        return [a for a in ppo_argv(data, out) if not a.startswith(skip)] + env

    resumed = _clean_and_chain(argv, tmp_path, 6, True, "final", "critic")
    clean = tmp_path / "clean"
    assert (clean / "samples.jsonl").read_text() == (resumed / "samples.jsonl").read_text()
    assert any("env/return" in r for r in metric_rows(resumed))
    # the recorded episodes too: what an interrupted run recorded after its checkpoint is dropped on resume
    episodes = "episodes/rank-0.jsonl"
    assert (clean / episodes).read_text() == (resumed / episodes).read_text() != ""


@pytest.mark.slow
def test_ppo_with_an_agent_resumes_bit_identically(data, tmp_path, monkeypatch):
    """An agent's episodes (examples/agents/echo_agent.py over the openai client, on the run's recording gateway):
    the chain of interruptions ends with the weights and metrics (agent/* included) of the uninterrupted run."""
    pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
    pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
    from test_agent import EXAMPLES, build_echo_task

    monkeypatch.syspath_prepend(str(EXAMPLES))  # (the forked runs inherit it)
    task = build_echo_task(tmp_path / "task")
    agent = [
        f"model.path={task['char']}",
        f"data.train={task['prompts']}",
        "agent.factory=echo_agent:solve",
        "agent.concurrency=3",
        "generation.max_total_tokens=24",
    ]

    def argv(out):
        skip = ("reward.function", "eval.gold_function", "data.ptx", "ptx_coef", "model.path", "data.train")
        return [a for a in ppo_argv(data, out) if not a.startswith(skip)] + agent

    resumed = _clean_and_chain(argv, tmp_path, 6, True, "final", "critic")
    assert any("agent/return" in r for r in metric_rows(resumed))


@pytest.mark.slow
def test_ppo_lora_actor_and_critic_resume_bit_identically_from_adapter_only_checkpoints(data, tmp_path):
    """LoRA actor and LoRA critic: a checkpoint holds the adapters, the critic's value head and the Adam
    state of those alone (not the frozen base, reloaded from model.path on resume), and the interrupted
    chain still ends bit-identical to the uninterrupted run (final/ and critic/ are merged full models)."""
    lora = ["lora.enabled=true", "lora.critic=true", "lora.r=4", "lora.alpha=8"]
    resumed = _clean_and_chain(
        lambda out: [*ppo_argv(data, out), *lora], tmp_path, 6, True, "final", "critic"
    )
    step = ckpt.latest_checkpoint(resumed)
    for name, allowed in (("actor", ("lora_",)), ("critic", ("lora_", "head.", "gain", "bias"))):
        with safe_open(str(step / f"model-{name}.safetensors"), "pt") as st:
            keys = list(st.keys())
        assert keys and all(any(a in k for a in allowed) for k in keys), (name, keys[:5])
    import torch

    state = torch.load(step / "state.pt", weights_only=True)
    n_moments = sum(v["exp_avg"].numel() for t in state.values() for v in t["optimizer"]["state"].values())
    assert 0 < n_moments < 5000  # adapters (2 x 1024) and the value head (33), not the 29k-parameter base
    full = tmp_path / "clean" / "final"  # ...while final/ and critic/ load as plain models
    from shifu.models.loading import load_causal_lm
    from shifu.models.scalar import ScalarModel

    assert sum(p.numel() for p in load_causal_lm(full).parameters()) > 25_000
    ScalarModel.from_pretrained(tmp_path / "clean" / "critic")


def test_a_stopped_ppo_run_names_best_as_the_model_to_use_meanwhile(data, tmp_path):
    """SIGTERM mid-run: the message says how to resume and that best/ is the model to use until then, with the
    iteration and the gold score that put it there (the best mean gold of samples.jsonl's evaluations)."""
    out = tmp_path / "run"
    argv = ppo_argv(data, out)
    for old, new in (
        ("iterations=12", "iterations=200"),
        ("eval.every=3", "eval.every=1"),
        ("save_every=3", "save_every=0"),
    ):
        argv[argv.index(old)] = new

    def evaluations() -> dict[int, list[float]]:
        golds: dict[int, list[float]] = {}
        path = out / "samples.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        for row in (json.loads(x) for x in lines if x.endswith("}")):
            golds.setdefault(row["iteration"], []).append(row["gold"])
        return golds

    r = Run(argv, tmp_path / "run.log")
    assert r.signal_when(lambda: len(evaluations()) >= 3, signal.SIGTERM), r.output()
    assert r.rc == 0, r.output()
    line = next(x for x in r.output().splitlines() if "stopped at iteration" in x)
    means = {it: sum(g) / len(g) for it, g in sorted(evaluations().items())}
    best = max(means, key=lambda it: (means[it], -it))  # the first evaluation with the highest mean
    assert f"--out {out} --resume. Until then, the model to use is {out / 'best'} (iteration {best}, " in line
    assert line.endswith(f"gold/score {means[best]:.4g}): the best evaluation so far"), line


@pytest.mark.slow
def test_ppo_real_subprocess_sigterm_and_resume(data, tmp_path):
    """SIGTERM and --resume in fresh interpreters (``run_shifu.py`` = ``python -m shifu`` + test hooks)."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        "SHIFU_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    script = [sys.executable, str(ROOT / "tests" / "resume_scripts" / "run_shifu.py")]
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    argv = ppo_argv(data, clean)
    argv[argv.index("iterations=12")] = "iterations=8"
    clean_run = Run(argv, tmp_path / "clean.log")  # the reference in a forked child: also shows the two agree
    assert clean_run.wait() == 0, clean_run.output()
    argv[argv.index(str(clean))] = str(resumed)
    with open(tmp_path / "term.log", "w") as log:
        p = subprocess.Popen([*script, *argv], env=env, stdout=log, stderr=subprocess.STDOUT)
        cond, deadline = logged_step_at_least(resumed, 3), time.monotonic() + TIMEOUT
        while p.poll() is None and not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.poll() is None, "the run ended before SIGTERM"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=TIMEOUT) == 0
    out = (tmp_path / "term.log").read_text()
    assert "--resume" in out and latest_step(resumed) < 8
    again = subprocess.run(
        [*script, *argv, "--resume"], env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert again.returncode == 0, again.stderr
    check_equal(clean, resumed, "final", "critic")

"""Surviving faults: protected output directories, torn and failed checkpoint writes, NaN/Inf values, and
an audit of everything that loads files (safetensors, ``weights_only``, safe YAML, no remote code, offline).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ppo_task import build_char_model, write_prompts
from test_dpo import config as dpo_cfg
from test_rm import make_cfg as rm_cfg
from test_sft import make_cfg as sft_cfg

from shifu.cli import main as cli
from shifu.config.loader import load_config
from shifu.errors import ShifuError
from shifu.models.scalar import ScalarModel
from shifu.runs import checkpoint as ckpt
from shifu.runs.tracking import read_metrics
from shifu.trainers import dpo, ppo, reward, sft

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "shifu"


# ------------------------------------------------------------------ output directories
def sft_cli(model_dir, tmp_path: Path, out: Path, *flags: str) -> list[str]:
    cfg = sft_cfg(model_dir, tmp_path)  # writes the data files
    return [
        "sft",
        "--out",
        str(out),
        f"model.path={model_dir}",
        f"data.train={cfg.data.train}",
        f"data.eval={cfg.data.eval}",
        "max_steps=2",
        "progress=false",
        "tensorboard=false",
        *flags,
    ]


@pytest.mark.integration
def test_output_directories_are_protected(tiny_model_dir, tmp_path, capsys):
    mine = tmp_path / "my_files"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    # a fresh run into a non-empty directory: refused, exit 2, the message says what to do
    assert cli.main(sft_cli(tiny_model_dir, tmp_path, mine)) == 2
    err = capsys.readouterr().err
    assert f"'{mine}' is not empty" in err and "--resume" in err and "--overwrite" in err
    # --overwrite / --resume never touch a directory that is not a shifu run
    for flag in ("--overwrite", "--resume"):
        assert cli.main(sft_cli(tiny_model_dir, tmp_path, mine, flag)) == 2
        assert "does not look like a shifu run" in capsys.readouterr().err
        assert (mine / "thesis.tex").read_text() == "years of work"
    # a shifu run directory: refused without a flag, replaced with --overwrite
    run = tmp_path / "run"
    assert cli.main(sft_cli(tiny_model_dir, tmp_path, run)) == 0
    (run / "stale.txt").write_text("from the old run")
    assert cli.main(sft_cli(tiny_model_dir, tmp_path, run)) == 2
    assert cli.main(sft_cli(tiny_model_dir, tmp_path, run, "--overwrite")) == 0
    assert not (run / "stale.txt").exists() and (run / "final" / "config.json").exists()
    # an output path that cannot be a directory: exit 2 naming it
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert cli.main(sft_cli(tiny_model_dir, tmp_path, blocker / "run")) == 2
    assert f"'{blocker / 'run'}'" in capsys.readouterr().err


# ------------------------------------------------------------------ checkpoint writes
def _module(seed: int, n: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(n, n)


def _save(run: Path, step: int, m: torch.nn.Module) -> Path:
    return ckpt.save_checkpoint(run, step, {"m": m}, {"opt": {"x": torch.ones(2)}}, {"k": step}, keep_last=2)


def _loads_as(run: Path, step: int, m: torch.nn.Module) -> None:
    path = ckpt.latest_checkpoint(run)
    assert path is not None and path.name == f"step-{step:08d}"
    fresh = _module(99)
    tensors, js = ckpt.load_checkpoint(path, {"m": fresh})
    assert js["k"] == step and torch.equal(tensors["opt"]["x"], torch.ones(2))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values()))


@pytest.mark.integration
def test_crash_in_the_middle_of_a_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "resume_scripts"))
    import run_shifu

    run, first = tmp_path / "run", _module(1)
    _save(run, 1, first)
    pid = os.fork()
    if pid == 0:  # the child dies (os._exit(137)) halfway through writing checkpoint 2
        try:
            os.environ["SHIFU_TEST_CRASH_IN_CHECKPOINT"] = "2"
            run_shifu.install_hooks()
            _save(run, 2, _module(2))
        finally:
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 137
    torn = run / ckpt.CKPT_DIR / ".tmp-step-00000002"
    assert (torn / "model-m.safetensors").stat().st_size > 0 and not (torn / "state.json").exists()
    _loads_as(run, 1, first)
    second = _module(2)
    _save(run, 2, second)  # the next write succeeds and clears the torn one
    _loads_as(run, 2, second)
    assert not torn.exists()


@pytest.mark.unit
def test_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    run, first = tmp_path / "run", _module(1)
    _save(run, 1, first)
    big = _module(2, n=512)  # ~1 MB of weights
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    # files may not grow past 64 KiB: writes fail with EFBIG, as on a full disk (works as root too)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, old_limit[1]))
    try:
        with pytest.raises(ShifuError, match=r"could not write checkpoint '.*step-00000002'.*File too large"):
            _save(run, 2, big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    _loads_as(run, 1, first)
    assert not list((run / ckpt.CKPT_DIR).glob(".tmp-*"))


@pytest.mark.unit
def test_unwritable_checkpoint_directory_names_the_path(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ckpt.CKPT_DIR).write_text("a file where the checkpoint directory should be")
    with pytest.raises(ShifuError, match=re.escape(str(run / ckpt.CKPT_DIR))):
        _save(run, 1, _module(1))


# ------------------------------------------------------------------ non-finite values: SFT
def _nan_at(monkeypatch, calls_with_nan):
    real, n = sft.sft_nll_sum, {"calls": 0}

    def nll(*args, **kwargs):
        out, tokens = real(*args, **kwargs)
        n["calls"] += 1
        return (out * float("nan") if calls_with_nan(n["calls"]) else out), tokens

    monkeypatch.setattr(sft, "sft_nll_sum", nll)


@pytest.mark.integration
def test_sft_skips_a_nan_loss_step_and_counts_it(tiny_model_dir, tmp_path, monkeypatch):
    # calls: 1-2 the step-0 held-out loss (20 rows / 16), then one per step (grad_accum=1)
    _nan_at(monkeypatch, lambda c: c == 2 + 3)  # step 3's loss is NaN
    cfg = sft_cfg(tiny_model_dir, tmp_path, max_steps=6, save_every=6, log_every=2)
    sft.train(cfg)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "sft/loss" in r]
    assert [r["sft/skipped_steps"] for r in rows] == [0, 1, 1]
    assert all(isinstance(r["sft/loss"], float) for r in rows)  # the window mean ignores the skipped step
    state = torch.load(
        ckpt.latest_checkpoint(tmp_path / "run") / "state.pt", weights_only=True, map_location="cpu"
    )
    assert {int(s["step"]) for s in state["policy"]["optimizer"]["state"].values()} == {
        5
    }  # 6 steps, 1 skipped
    final = sft.load_causal_lm(tmp_path / "run" / "final")
    assert all(torch.isfinite(p).all() for p in final.parameters())


@pytest.mark.integration
def test_sft_stops_after_consecutive_nan_steps_keeping_the_last_good_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    _nan_at(monkeypatch, lambda c: c >= 2 + 5)  # every step from step 5 on
    argv = sft_cli(tiny_model_dir, tmp_path, tmp_path / "run", "max_steps=20", "save_every=2")
    argv += ["max_nonfinite_steps=3"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "3 consecutive steps" in err and "max_nonfinite_steps=3" in err and "step-00000006" in err
    path = ckpt.latest_checkpoint(tmp_path / "run")
    assert path.name == "step-00000006"  # step 6 was skipped: weights = step 4's, checkpoint intact
    model = sft.load_causal_lm(tiny_model_dir)
    ckpt.load_checkpoint(path, {"policy": model})
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not (tmp_path / "run" / "final").exists()


# ------------------------------------------------------------------ non-finite values: rm and DPO
def _nan_loss_at(monkeypatch, module, name: str, steps_with_nan) -> None:
    """``module.name`` (a ``(loss, stats)`` function) returns a NaN loss on its k-th call with gradients on
    when ``steps_with_nan(k)``; held-out passes (under no_grad) are not counted. One call per training step
    (grad_accum=1), so k is the step."""
    real, n = getattr(module, name), {"calls": 0}

    def loss_fn(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        if not torch.is_grad_enabled():
            return loss, stats
        n["calls"] += 1
        return (loss * float("nan") if steps_with_nan(n["calls"]) else loss), stats

    monkeypatch.setattr(module, name, loss_fn)


def _checkpoint_steps(run: Path) -> set[int]:
    """The Adam step counts in the latest checkpoint of ``run``."""
    state = torch.load(ckpt.latest_checkpoint(run) / "state.pt", weights_only=True, map_location="cpu")
    (trained,) = state.values()  # one optimiser: the reward model's or the DPO policy's
    return {int(s["step"]) for s in trained["optimizer"]["state"].values()}


def _window_rows(run: Path, name: str) -> list[dict]:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if f"{name}/loss" in r]
    # the window mean ignores the skipped step: never NaN (written as null)
    assert all(isinstance(r[f"{name}/loss"], float) and math.isfinite(r[f"{name}/loss"]) for r in rows)
    return rows


@pytest.mark.integration
def test_rm_skips_a_nan_loss_step_and_counts_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    _nan_loss_at(monkeypatch, reward, "bradley_terry_loss", lambda k: k == 3)
    reward.train(rm_cfg(tiny_model_dir, tmp_path, max_steps=6, save_every=6, log_every=2))
    run = tmp_path / "run"
    assert "shifu rm: step 3: non-finite loss or gradient, step skipped" in capsys.readouterr().err
    assert [r["rm/skipped_steps"] for r in _window_rows(run, "rm")] == [0, 1, 1]
    assert _checkpoint_steps(run) == {5}  # 6 steps, 1 skipped: Adam never saw it
    final = ScalarModel.from_pretrained(run / "final")
    assert all(torch.isfinite(t).all() for t in final.state_dict().values())


@pytest.mark.integration
def test_rm_stops_after_consecutive_nan_steps_keeping_the_last_good_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch
):
    _nan_loss_at(monkeypatch, reward, "bradley_terry_loss", lambda k: k >= 5)  # every step from step 5 on
    cfg = rm_cfg(tiny_model_dir, tmp_path, max_steps=20, save_every=2, max_nonfinite_steps=3)
    message = r"3 consecutive steps \(up to step 7\).*max_nonfinite_steps=3.*step-00000006.*--resume"
    with pytest.raises(ShifuError, match=message):
        reward.train(cfg)
    run = tmp_path / "run"
    assert ckpt.latest_checkpoint(run).name == "step-00000006"
    # steps 5 and 6 were skipped: the step-6 checkpoint holds step 4's weights, all finite
    four, six = (run / ckpt.CKPT_DIR / f"step-0000000{i}" / "model-rm.safetensors" for i in (4, 6))
    assert _finite(six) and _same(four, six)
    assert not (run / "final").exists()
    # the counts are checkpointed: resumed at step 6 (2 skipped in a row), one more NaN step stops it
    with pytest.raises(ShifuError, match=message):
        reward.train(cfg, resume=True)


@pytest.mark.integration
def test_dpo_skips_a_nan_loss_step_and_counts_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    _nan_loss_at(monkeypatch, dpo, "dpo_loss", lambda k: k == 3)
    dpo.train(dpo_cfg(tmp_path, tiny_model_dir, "run", max_steps=6, save_every=6, log_every=2))
    run = tmp_path / "run"
    assert "shifu dpo: step 3: non-finite loss or gradient, step skipped" in capsys.readouterr().err
    assert [r["dpo/skipped_steps"] for r in _window_rows(run, "dpo")] == [0, 1, 1]
    assert _checkpoint_steps(run) == {5}
    final = sft.load_causal_lm(run / "final")
    assert all(torch.isfinite(p).all() for p in final.parameters())


@pytest.mark.integration
def test_dpo_stops_after_consecutive_nan_steps_keeping_the_last_good_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    _nan_loss_at(monkeypatch, dpo, "dpo_loss", lambda k: k >= 5)
    argv = ["dpo", "--out", str(tmp_path / "run"), "max_steps=10", "save_every=2", "max_nonfinite_steps=3"]
    cfg = dpo_cfg(tmp_path, tiny_model_dir, "run", max_steps=10, save_every=2, max_nonfinite_steps=3)
    argv += [f"model.path={cfg.model.path}", f"data.train={cfg.data.train}", f"data.eval={cfg.data.eval}"]
    argv += ["data.max_len=48", "data.max_prompt_len=16", "optim.lr=3e-3", "optim.schedule=constant"]
    argv += ["batch_size=16", "log_every=5", "progress=false", "tensorboard=false", "device=cpu"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "3 consecutive steps (up to step 7)" in err and "max_nonfinite_steps=3" in err
    assert "step-00000006" in err
    run = tmp_path / "run"
    assert ckpt.latest_checkpoint(run).name == "step-00000006"
    four, six = (run / ckpt.CKPT_DIR / f"step-0000000{i}" / "model-policy.safetensors" for i in (4, 6))
    assert _finite(six) and _same(four, six)
    assert not (run / "final").exists()
    # fixed (no more NaN), --resume finishes; the total count continues from the checkpoint's 2
    monkeypatch.undo()
    assert cli.main(argv + ["--resume"]) == 0
    assert [r["dpo/skipped_steps"] for r in _window_rows(run, "dpo")] == [1, 2]
    assert _finite(run / "final" / "model.safetensors")


# rank 1 alone sees a NaN loss value at step 2 (its gradients stay finite): under torchrun every rank must
# skip that step, or rank 0 would take it and the replicas would part
_RM_RANK_NAN = """
import sys
import torch
from shifu.parallel import distributed as D
from shifu.config.loader import load_config
from shifu.trainers import reward

real, calls = reward.bradley_terry_loss, {"n": 0}


def loss_fn(*args, **kwargs):
    loss, stats = real(*args, **kwargs)
    if torch.is_grad_enabled():
        calls["n"] += 1
        if calls["n"] == 2 and (D.world_size() == 1 or D.rank() == 1):
            loss = loss + float("nan") * loss.detach()
    return loss, stats


reward.bradley_terry_loss = loss_fn
reward.train(load_config(reward.Config, overrides=sys.argv[1:]))
D.destroy()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_rm_under_torchrun_skips_a_step_that_is_nan_on_one_rank_only(tiny_model_dir, tmp_path):
    script = tmp_path / "rm_rank_nan.py"
    script.write_text(_RM_RANK_NAN)
    cfg = rm_cfg(tiny_model_dir, tmp_path)  # writes the data files
    args = [f"model.path={tiny_model_dir}", f"data.train={cfg.data.train}", f"data.eval={cfg.data.eval}"]
    args += ["batch_size=4", "max_steps=3", "log_every=1", "optim.schedule=constant", "optim.eps=1.0"]
    args += ["progress=false", "tensorboard=false", "distributed.timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("WORLD_SIZE", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    runs = {}
    for name, cmd in (
        ("one", [sys.executable, str(script)]),
        ("two", [*torchrun, str(script), "distributed.strategy=ddp"]),
    ):
        done = subprocess.run(
            [*cmd, f"out_dir={tmp_path / name}", *args], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        assert done.stderr.count("step 2: non-finite loss or gradient, step skipped") == 1  # rank 0 says it
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["rm/skipped_steps"] for r in rows if "rm/loss" in r] == [0, 1, 1]
        final = ScalarModel.from_pretrained(tmp_path / name / "final")
        runs[name] = {k: v.clone() for k, v in final.state_dict().items()}
    init = ScalarModel.from_backbone(str(tiny_model_dir), seed=0).state_dict()
    diff = max(float((runs["two"][k] - runs["one"][k]).abs().max()) for k in init)
    moved = max(float((runs["one"][k] - init[k]).abs().max()) for k in init)
    assert moved > 0 and diff / moved < 1e-3  # 2 ranks == 1 process, both with step 2 skipped


# ------------------------------------------------------------------ non-finite values: PPO
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults_ppo")
    return {"model": build_char_model(d / "model"), "prompts": write_prompts(d / "prompts.jsonl")}


def ppo_cfg(task, out, *extra):
    base = [
        f"out_dir={out}",
        f"model.path={task['model']}",
        f"data.train={task['prompts']}",
        "reward.function=ppo_task:frac_a",
        "critic.init=sft",
        "iterations=3",
        "batch_size=8",
        "minibatch_size=4",
        "ppo_epochs=1",
        "generation.max_new_tokens=6",
        "optim.lr=1e-2",
        "eval.every=0",
        "eval.num_prompts=4",
        "save_every=1",
    ]
    return load_config(ppo.Config, None, base + list(extra))


def _finite(path: Path) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(str(path)).values())


def _same(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.integration
def test_ppo_drops_nan_scores_and_skips_a_nan_loss_step(task, tmp_path, monkeypatch):
    from shifu import core

    real, calls = core.ppo_policy_loss, {"n": 0}

    def loss_nan_once(*args, **kwargs):
        calls["n"] += 1
        loss, st = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 3 else loss), st

    monkeypatch.setitem(core.POLICY_LOSSES, "ppo", loss_nan_once)
    out = tmp_path / "run"
    summary = ppo.train(ppo_cfg(task, out, "reward.function=ppo_task:nan_some"))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "optim/skipped_steps" in r]
    skipped = [r["optim/skipped_steps"] for r in rows]  # cumulative; dropped samples shrink minibatches
    assert skipped[0] == 0 and skipped[-1] == 1 and summary["skipped_steps"] == 1
    assert sum(r["rollout/dropped_nonfinite"] for r in rows) > 0  # 'b...' responses scored NaN
    assert all(isinstance(r["objective/score"], float) for r in rows)  # never NaN: the batch is clean
    assert _finite(out / "final" / "model.safetensors")


@pytest.mark.integration
def test_ppo_stops_after_consecutive_nan_steps_keeping_the_last_good_checkpoint(task, tmp_path, monkeypatch):
    from shifu import core

    real, calls = core.ppo_policy_loss, {"n": 0}

    def nan_from_iteration_3(*args, **kwargs):
        calls["n"] += 1  # 2 optimiser steps per iteration
        loss, st = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] > 4 else loss), st

    monkeypatch.setitem(core.POLICY_LOSSES, "ppo", nan_from_iteration_3)
    out = tmp_path / "run"
    cfg = ppo_cfg(task, out, "iterations=10", "max_nonfinite_steps=4")
    with pytest.raises(ShifuError, match=r"4 consecutive steps \(up to iteration 4\).*step-00000003"):
        ppo.train(cfg)
    # iteration 3's two steps were skipped: its checkpoint holds iteration 2's weights, and nothing later
    # was written (iteration 4 ended the run before its checkpoint)
    assert ckpt.latest_checkpoint(out).name == "step-00000003"
    from safetensors.torch import load_file

    two, three = (
        load_file(str(out / ckpt.CKPT_DIR / f"step-0000000{i}" / "model-actor.safetensors")) for i in (2, 3)
    )
    assert all(torch.equal(two[k], three[k]) for k in two) and _finite(
        out / ckpt.CKPT_DIR / "step-00000003" / "model-actor.safetensors"
    )
    assert not (out / "final").exists()


# ------------------------------------------------------------------ safe loading audit
def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted(SRC.rglob("*.py"))]


def _calls(text: str, name: str) -> list[str]:
    """The argument text of every call ``name(...)`` in ``text`` (balanced parentheses)."""
    out = []
    for m in re.finditer(re.escape(name) + r"\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        out.append(text[m.end() : i - 1])
    return out


@pytest.mark.unit
def test_every_torch_load_is_weights_only_and_no_pickle_or_unsafe_yaml():
    loads = 0
    for path, text in _sources():
        for args in _calls(text, "torch.load"):
            loads += 1
            assert "weights_only=True" in args, f"{path}: torch.load({args}) without weights_only=True"
        for bad in ("yaml.load(", "yaml.unsafe_load", "yaml.Loader", "pickle.load", "torch.jit.load"):
            assert bad not in text, f"{path} uses {bad}"
    assert loads >= 1  # the checkpoint loader is found, so the scan is looking at the right files


@pytest.mark.integration
def test_remote_code_is_off_unless_asked_and_hub_is_offline():
    from shifu.trainers import dpo, reward

    hub_loads = 0
    for path, text in _sources():
        assert "trust_remote_code=True" not in text, path
        # transformers loaders (an Auto class, or the one passed to models._load_checked): local only
        for m in re.finditer(r"(Auto\w+|auto_cls)\.from_pretrained\(", text):
            args = _calls(text[m.start() :], m.group(1) + ".from_pretrained")[0]
            hub_loads += 1
            assert "local_files_only=True" in args, f"{path}: {m.group(1)}.from_pretrained({args})"
    assert hub_loads >= 3
    assert sft.Config().model.trust_remote_code is False
    assert reward.Config().model.trust_remote_code is False
    assert ppo.Config().model.trust_remote_code is False and dpo.Config().model.trust_remote_code is False
    # `import shifu` (run before any shifu module can import transformers) switches the hub off
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = "import shifu, huggingface_hub.constants as c, json; print(json.dumps(c.HF_HUB_OFFLINE))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) is True


_CALLS = {"n": 0}


def nan_first_batch(prompts, responses, rows):
    """A judge that fails on its whole first batch (every score NaN), then scores like ppo_task:frac_a."""
    _CALLS["n"] += 1
    if _CALLS["n"] == 1:
        return [float("nan")] * len(responses)
    return [r.count("a") / max(1, len(r)) for r in responses]


@pytest.mark.integration
def test_ppo_survives_a_batch_whose_scores_are_all_nan(task, tmp_path):
    _CALLS["n"] = 0
    out = tmp_path / "run"
    cfg = ppo_cfg(task, out, "reward.function=test_faults:nan_first_batch", "kl.controller=adaptive")
    summary = ppo.train(cfg)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/dropped_nonfinite" in r]
    assert rows[0]["rollout/dropped_nonfinite"] == 8 and rows[1]["rollout/dropped_nonfinite"] == 0
    assert isinstance(rows[-1]["objective/score"], float) and math.isfinite(summary["kl_coef"])
    assert summary["skipped_steps"] == 0 and _finite(out / "final" / "model.safetensors")


# ------------------------------------------------------------------ signals
@pytest.mark.unit
def test_graceful_stop_only_sets_a_flag_and_says_so_on_the_raw_stderr(capfd):
    from shifu.trainers.common import GracefulStop

    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # would end pytest without the handler
        for _ in range(100):  # Python runs the handler between bytecodes
            if stop.requested:
                break
    assert stop.requested
    # written with os.write (a print could collide with a progress-bar write already in progress)
    assert "got SIGTERM; finishing this step and writing a checkpoint" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def _raise_and_wait(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(100):  # Python runs the handler between bytecodes
        pass


@pytest.mark.unit
def test_under_torchrun_the_first_signal_again_is_the_same_request(monkeypatch, capfd):
    """A signal sent to every process of a torchrun job reaches a rank twice (directly and forwarded by the
    launcher): the second must not end the rank before its checkpoint. Another signal still does, and
    outside torchrun a second signal stops at once, as before."""
    from shifu.trainers.common import GracefulStop

    # Python's own SIGINT handler, whatever a test before this one in the same worker left installed
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _signals_again_under_torchrun(monkeypatch, capfd, GracefulStop)
    finally:
        signal.signal(signal.SIGINT, old)


def _signals_again_under_torchrun(monkeypatch, capfd, GracefulStop) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # what torchrun sets in each rank's environment
    with GracefulStop() as stop:
        _raise_and_wait(signal.SIGINT)
        _raise_and_wait(signal.SIGINT)  # the launcher's copy: no KeyboardInterrupt
        assert stop.requested and stop.first == signal.SIGINT
    assert capfd.readouterr().err.count("got SIGINT; finishing this step") == 1
    with pytest.raises(KeyboardInterrupt), GracefulStop() as stop:
        _raise_and_wait(signal.SIGTERM)
        assert stop.requested
        _raise_and_wait(signal.SIGINT)  # another signal (torchrun's answer to a second Ctrl-C is SIGTERM)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(KeyboardInterrupt), GracefulStop() as stop:
        _raise_and_wait(signal.SIGINT)
        assert stop.requested
        _raise_and_wait(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.unit
def test_shifu_launch_waits_long_enough_for_a_checkpoint_unless_told_otherwise(monkeypatch):
    from shifu.parallel import launch

    for var in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    args = launch.parse_args(["--standalone", "--nproc_per_node", "2", "sft", "--out", "run"])
    assert args.shutdown_timeout == launch.SHUTDOWN_TIMEOUT_S >= 300  # torchrun's own default: 30 s
    assert args.module and args.training_script == "shifu" and args.training_script_args[0] == "sft"
    assert launch.parse_args(["--shutdown-timeout", "45", "sft"]).shutdown_timeout == 45
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")  # torch reads it when no option is given
    assert launch.parse_args(["sft"]).shutdown_timeout is None

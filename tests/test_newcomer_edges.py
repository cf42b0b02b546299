"""What a newcomer runs into on their own task: config errors that say where and what was meant, ``--set`` on a
trainer, ``--resume`` from the run's own config, reward functions next to the working directory, and a stop
signal that still checkpoints when whatever read the console has gone."""

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
from test_sft import corpus

from shifu.cli import main as cli
from shifu.config.imports import load_callable
from shifu.config.loader import load_config, read_yaml
from shifu.errors import ConfigError
from shifu.runs import checkpoint as ckpt
from shifu.trainers import ppo, sft

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


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


def test_a_yaml_error_deep_in_a_config_file_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "ppo.yaml"
    lines = [
        "model:",
        "  path: runs/sft/final",
        "optim:",
        "  lr: 1e-5",
        "kl:",
        "  init_coef: 0.05",
        "  target: [6",
    ]
    path.write_text("\n".join(lines + ["iterations: 10", ""]))
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    assert f"config file '{path}', line 8" in str(e.value), str(e.value)


def test_an_unknown_key_says_what_was_meant():
    with pytest.raises(ConfigError, match=r"unknown config key 'iteration'\. Did you mean 'iterations'\?"):
        load_config(ppo.Config, overrides=["iteration=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'lr'\. 'lr' is 'optim\.lr'"):
        load_config(sft.Config, overrides=["lr=3e-4"])
    with pytest.raises(ConfigError, match=r"Did you mean 'kl\.init_coef'\?"):
        load_config(ppo.Config, overrides=["kl.init_coeff=0.1"])


def test_a_trainer_takes_set_like_the_pipelines(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    run = tmp_path / "run"
    assert (
        cli.main(_sft_argv(tiny_model_dir, data, run, "--set", "max_steps=3", "--set", "save_every=3")) == 0
    )
    assert ckpt.read_state(ckpt.latest_checkpoint(run))["step"] == 3


def test_resume_reads_the_runs_own_config(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("max_steps=4", "save_every=1", "optim.lr=1e-3")
    assert cli.main(_sft_argv(tiny_model_dir, data, full, *common)) == 0
    assert cli.main(_sft_argv(tiny_model_dir, data, part, "max_steps=2", *common[1:])) == 0
    capsys.readouterr()
    # only the run directory and what changes: model, data and the learning rate come from part/config.yaml
    assert cli.main(["sft", "--out", str(part), "--resume", "max_steps=4"]) == 0
    assert ckpt.read_state(ckpt.latest_checkpoint(part))["step"] == 4
    a = (full / "final" / "model.safetensors").read_bytes()
    assert a == (part / "final" / "model.safetensors").read_bytes()
    # a change that is not safe on resume is still refused, and nothing is written
    before = sorted(p.name for p in (part / ckpt.CKPT_DIR).iterdir())
    assert cli.main(["sft", "--out", str(part), "--resume", "max_steps=6", "optim.lr=5e-3"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert sorted(p.name for p in (part / ckpt.CKPT_DIR).iterdir()) == before


def test_a_reward_function_next_to_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "mytask").mkdir()
    (tmp_path / "mytask" / "__init__.py").write_text("")
    (tmp_path / "mytask" / "rewards.py").write_text(
        "def fn(prompts, responses, rows):\n    return [1.0] * len(responses)\n"
    )
    monkeypatch.chdir(tmp_path)
    # as under the `shifu` console script: the working directory is not on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), ".")])
    monkeypatch.delitem(sys.modules, "mytask", raising=False)
    fn = load_callable("mytask.rewards:fn", "reward.function")
    assert fn(["a"], ["b"], [{}]) == [1.0]
    with pytest.raises(ConfigError, match=r"run shifu from the directory that holds nosuch/"):
        load_callable("nosuch.rewards:fn", "reward.function")


def test_ctrl_c_with_the_console_reader_gone_still_checkpoints(tiny_model_dir, tmp_path):
    """``shifu sft ... 2>&1 | tee log`` and Ctrl-C: tee dies with the same signal, shifu's next write to the
    pipe fails; the run must still finish its step, write its checkpoint and exit 0."""
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    run = tmp_path / "run"
    argv = _sft_argv(tiny_model_dir, data, run, "max_steps=100000", "save_every=1000", "log_every=1")
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shifu", *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").stat().st_size == 0:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run logged nothing"
            time.sleep(0.05)
        proc.stdout.close()  # the reader (tee) is gone: every later write to the pipe fails
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and ckpt.read_state(latest)["step"] >= 1


def test_a_reward_function_is_a_drop_in_with_the_default_critic(tmp_path, capsys):
    """The default critic.init=reward starts the critic from the reward model; with a reward function there is
    none, and the run starts it from the SFT model instead (said on stderr, recorded in config.yaml)."""
    import yaml
    from ppo_task import build_char_model, write_prompts

    model, prompts = build_char_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl")
    argv = [
        "ppo",
        "--out",
        str(tmp_path / "run"),
        f"model.path={model}",
        f"data.train={prompts}",
        "reward.function=ppo_task:frac_a",
        "iterations=2",
        "batch_size=8",
        "minibatch_size=8",
        "generation.max_new_tokens=4",
        "save_every=0",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    assert "critic.init=reward fell back to critic.init=sft" in capsys.readouterr().err
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["critic"]["init"] == "sft" and (tmp_path / "run" / "critic").is_dir()


def test_resume_below_the_step_reached_is_refused_and_changes_nothing(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", corpus(40))
    run = tmp_path / "run"
    assert cli.main(_sft_argv(tiny_model_dir, data, run, "max_steps=4", "save_every=2")) == 0
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert cli.main(["sft", "--out", str(run), "--resume", "max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "with max_steps giving 2: its checkpoint step-00000004 is already past that" in err, err
    assert "Give max_steps of at least 4" in err
    assert {p: p.read_bytes() for p in files} == files  # config.yaml, summary.json, final/: as they were


def _hacked_ppo_argv(tmp_path, *extra: str) -> list[str]:
    from ppo_task import build_char_model, write_prompts

    model, prompts = build_char_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl")
    return [
        "ppo",
        "--out",
        str(tmp_path / "run"),
        f"model.path={model}",
        f"data.train={prompts}",
        "reward.function=ppo_task:frac_a",
        "eval.gold_function=ppo_task:no_a",
        "critic.init=sft",
        "iterations=12",
        "batch_size=16",
        "minibatch_size=8",
        "generation.max_new_tokens=6",
        "optim.lr=1e-2",
        "optim.schedule=constant",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.02",
        "eval.every=2",
        "eval.num_prompts=32",
        "save_every=0",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def test_a_run_whose_judge_falls_while_the_reward_rises_keeps_best_by_the_judge_and_warns(tmp_path, capsys):
    """The reward (share of 'a') and the held-out judge (share of other characters) disagree: best/ follows
    the judge, and the run ends with a warning naming both curves."""
    import json

    assert cli.main(_hacked_ppo_argv(tmp_path, "guard.divergence_patience=0")) == 0
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    golds = {e["iteration"]: e["gold/score"] for e in summary["evals"]}
    assert summary["best_iteration"] == max(golds, key=golds.get) and summary["best"] == max(golds.values())
    assert golds[12] < max(golds.values()) - 0.05, golds  # the judge fell: the policy was hacking the reward
    assert "warning: shifu ppo: reward hacking? held-out gold/score fell from" in err, err
    assert f"best/ holds iteration {summary['best_iteration']}" in err


def test_with_a_judge_the_guard_watches_it_by_default(tmp_path, capsys):
    assert cli.main(_hacked_ppo_argv(tmp_path)) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["guard"] is not None and "gold/score fell while eval/score rose" in summary["guard"]
    assert summary["iterations"] < 12
    assert "restoring best/" in capsys.readouterr().err


def test_a_reward_model_that_learned_length_is_flagged(tiny_model_dir, tmp_path, capsys):
    """Pairs whose chosen response is always the longer one: the reward model learns length, and says so."""
    import random

    from shifu.trainers import reward

    def rows(n: int, seed: int) -> list[dict]:
        rng, words = random.Random(seed), ["the", "movie", "film", "plot", "cat", "dog", "story"]
        out = []
        for i in range(n):
            short = [rng.choice(words) for _ in range(rng.randint(1, 3))]
            out.append(
                {
                    "prompt": f"review {i % 7}:",
                    "chosen": " " + " ".join(short + short + short),
                    "rejected": " " + " ".join(short),
                }
            )
        return out

    over = {
        "out_dir": str(tmp_path / "run"),
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "train": str(write_jsonl(tmp_path / "train.jsonl", rows(160, 0))),
            "eval": str(write_jsonl(tmp_path / "eval.jsonl", rows(40, 1))),
        },
        "optim": {"lr": 1e-3},
        "batch_size": 16,
        "max_steps": 30,
        "progress": False,
        "tensorboard": False,
    }
    summary = reward.train(load_config(reward.Config, overrides=over))
    err = capsys.readouterr().err
    assert summary["eval/rm/len_corr"] >= 0.5, summary
    assert "warning: shifu rm: held-out scores correlate with response length" in err and "longer" in err


def test_ppo_and_dpo_take_a_run_directory_and_refuse_a_reward_model(tiny_model_dir, tmp_path, capsys):
    import shutil

    from shifu.models.scalar import ScalarModel

    run = tmp_path / "rev-sft"  # a trainer's run directory: the policy is its final/
    shutil.copytree(tiny_model_dir, run / "final")
    rm = tmp_path / "rev-rm"
    ScalarModel.from_backbone(tiny_model_dir, seed=0).save_pretrained(rm / "final")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in corpus(32)])
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": "tell me:", "chosen": " cat", "rejected": " dog"}] * 32
    )
    ppo_argv = [
        "ppo",
        "--out",
        str(tmp_path / "ppo"),
        f"data.train={prompts}",
        "reward.function=ppo_task:frac_a",
        "critic.init=sft",
        "iterations=1",
        "batch_size=8",
        "minibatch_size=8",
        "generation.max_new_tokens=4",
        "eval.every=0",
        "eval.num_prompts=8",
        "save_every=0",
        "progress=false",
        "tensorboard=false",
    ]
    dpo_argv = [
        "dpo",
        "--out",
        str(tmp_path / "dpo"),
        f"data.train={pairs}",
        "max_steps=1",
        "batch_size=8",
        "progress=false",
        "tensorboard=false",
    ]
    for argv in (ppo_argv, dpo_argv):
        assert cli.main([*argv, f"model.path={rm}/final"]) == 2
        err = capsys.readouterr().err
        assert "is a reward model (shifu rm), not a policy: pass it as reward.model_path" in err, err
        assert not Path(argv[2]).exists()  # refused before anything was written
        assert cli.main([*argv, f"model.path={run}"]) == 0
        recorded = read_yaml(Path(argv[2]) / "config.yaml")
        assert recorded["model"]["path"] == str(run / "final")


def test_init_model_starts_a_newcomer_on_their_own_text(tmp_path, capsys):
    """No model at hand: ``shifu init-model`` fits a tokenizer to the user's rows and builds a small GPT-2 that
    shifu sft then trains (its held-out loss falls)."""
    from shifu.runs.tracking import read_metrics

    rows = [
        {"prompt": f"Q: what does the {w} say?", "response": f" A: the {w} says {s}."}
        for w, s in [("cow", "moo"), ("cat", "meow"), ("dog", "woof"), ("duck", "quack")] * 30
    ]
    data = write_jsonl(tmp_path / "mine.jsonl", rows)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert cli.main(["init-model", str(data), "--out", str(tmp_path / "busy")]) == 2  # never overwrites
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert cli.main(["init-model", str(data), "--out", str(tmp_path / "m"), "--vocab-size", "300"]) == 0
    assert "parameters, a" in capsys.readouterr().err
    run = tmp_path / "run"
    argv = [
        "sft",
        "--out",
        str(run),
        f"model.path={tmp_path / 'm'}",
        f"data.train={data}",
        "max_steps=40",
        "batch_size=16",
        "eval.every=10",
        "optim.lr=3e-3",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    losses = [r["eval/sft/loss"] for r in read_metrics(run / "metrics.jsonl") if "eval/sft/loss" in r]
    assert losses[-1] < 0.5 * losses[0], losses

"""``shifu ppo`` with ``reward.url``: a real ``shifu serve`` on loopback gives the same metrics and weights as
the in-process reward, bit for bit; a service that dies mid-run stops the run with a checkpoint, and
``--resume`` once the service is back ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ppo_task import build_char_model, write_prompts
from safetensors.torch import load_file

from shifu.config.loader import load_config
from shifu.errors import ShifuError
from shifu.models.scalar import ScalarModel
from shifu.runs import checkpoint as ckpt
from shifu.trainers import ppo

pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
from test_serve import free_port, running  # noqa: E402

from shifu.serve.app import create_app  # noqa: E402
from shifu.serve.served import load_served  # noqa: E402

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
IGNORED = ("time/", "perf/")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_ppo")
    model = build_char_model(d / "model")
    rm = ScalarModel.from_backbone(model, seed=3)  # a causal reward model on the policy's tokenizer
    rm.gain.fill_(2.0)
    rm.save_pretrained(d / "rm")
    return {"model": model, "rm": d / "rm", "prompts": write_prompts(d / "prompts.jsonl")}


def cfg(task, out: Path, *reward: str):
    return load_config(
        ppo.Config,
        None,
        [
            f"out_dir={out}",
            f"model.path={task['model']}",
            f"data.train={task['prompts']}",
            "critic.init=sft",
            "iterations=6",
            "batch_size=16",
            "minibatch_size=8",
            "generation.max_new_tokens=6",
            "optim.lr=1e-2",
            "critic.optim.lr=1e-2",
            "eval.every=0",
            "save_every=2",
            "progress=false",
            "tensorboard=false",
            "reward.retries=1",
            "reward.timeout_s=20",
            *reward,
        ],
    )


def same_run(a: Path, b: Path) -> None:
    """Identical metrics (timings aside) and final weights of the actor and the critic."""

    def rows(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(IGNORED)} for x in lines]

    assert rows(a) == rows(b)
    for name in ("final/model.safetensors", "critic/model.safetensors"):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


def test_remote_reward_model_equals_in_process_bit_for_bit(task, tmp_path):
    ppo.train(cfg(task, tmp_path / "local", f"reward.model_path={task['rm']}"))
    # --exact: each request (micro_batch_size rows of token ids) is scored as one forward, as in process
    with running(create_app(load_served(str(task["rm"])), exact=True)) as url:
        ppo.train(cfg(task, tmp_path / "remote", f"reward.url={url}"))
    same_run(tmp_path / "local", tmp_path / "remote")


def serve(source: str, port: int) -> subprocess.Popen:
    """``shifu serve SOURCE`` in its own process on 127.0.0.1:PORT, once it listens."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env |= {"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shifu", "serve", source, "--port", str(port), "--exact"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "shifu serve:" in line, proc.stderr.read() if proc.poll() is not None else line
    return proc


def test_a_service_that_dies_stops_the_run_with_a_checkpoint_and_resume_continues(task, tmp_path):
    ppo.train(cfg(task, tmp_path / "whole", "reward.function=ppo_task:frac_a"))
    port, run = free_port(), tmp_path / "run"
    url = f"http://127.0.0.1:{port}"
    service = serve("ppo_task:frac_a_then_dies", port)  # dies while scoring iteration 4's rollout
    try:
        with pytest.raises(ShifuError, match=rf"{url}.*checkpoint of iteration 3 is in .*--resume"):
            ppo.train(cfg(task, run, f"reward.url={url}"))
        assert service.wait(timeout=30) == 1
    finally:
        service.kill()
    assert ckpt.latest_checkpoint(run).name == "step-00000003" and not (run / "final").exists()
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == 3  # iteration 4 was never scored into the metrics
    service = serve("ppo_task:frac_a", port)  # the service is back, on the same address
    try:
        ppo.train(cfg(task, run, f"reward.url={url}"), resume=True)
    finally:
        service.kill()
    same_run(tmp_path / "whole", run)


def test_a_service_that_dies_in_an_evaluation_stops_with_a_checkpoint_and_resume_continues(task, tmp_path):
    """Iteration 3 has trained when its evaluation loses the service: the checkpoint holds iteration 3 and
    its unlogged metrics; --resume evaluates it again, and the run ends as an uninterrupted one."""
    every = "eval.every=3"
    ppo.train(cfg(task, tmp_path / "whole", "reward.function=ppo_task:frac_a", every))
    port, run = free_port(), tmp_path / "run"
    url = f"http://127.0.0.1:{port}"
    service = serve("ppo_task:frac_a_dies_in_eval", port)
    try:
        with pytest.raises(ShifuError, match=rf"{url}.*checkpoint of iteration 3 is in .*--resume"):
            ppo.train(cfg(task, run, f"reward.url={url}", every))
        assert service.wait(timeout=30) == 1
    finally:
        service.kill()
    assert ckpt.latest_checkpoint(run).name == "step-00000003" and not (run / "final").exists()
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == 2  # iteration 3 trained, but is logged only with its evaluation
    service = serve("ppo_task:frac_a", port)
    try:
        ppo.train(cfg(task, run, f"reward.url={url}", every), resume=True)
    finally:
        service.kill()
    same_run(tmp_path / "whole", run)
    samples = lambda r: (r / "samples.jsonl").read_text()  # noqa: E731
    assert samples(tmp_path / "whole") == samples(run)


def test_a_served_process_reward_trains_exactly_like_the_in_process_one(task, tmp_path):
    """A reward function returning process-reward steps ([[end, reward], ...]), served: the steps travel to
    the trainer, land on the same tokens, and the run equals the in-process one bit for bit."""
    ppo.train(cfg(task, tmp_path / "local", "reward.function=ppo_task:a_steps"))
    with running(create_app(load_served("ppo_task:a_steps"))) as url:
        ppo.train(cfg(task, tmp_path / "remote", f"reward.url={url}"))
    same_run(tmp_path / "local", tmp_path / "remote")
    rows = [json.loads(x) for x in (tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert any("objective/process_reward" in r for r in rows)


def test_the_study_hands_a_reward_service_to_its_ppo_runs(task):
    """`shifu study frontier --reward-url URL`: a PPO/REINFORCE run's config takes the service in place of
    the plan's reward function, and it validates."""
    from shifu.pipelines.stages import ppo_overrides
    from shifu.study.budgets import BUDGETS

    plan = BUDGETS[("arith", "ci")]["ppo"]
    files = {"prompts_train": str(task["prompts"]), "prompts_val": str(task["prompts"])}
    over = ppo_overrides(plan, task["model"], files, {"url": "http://127.0.0.1:9"}, seed=1)
    cfg = load_config(ppo.Config, None, {**over, "out_dir": "x"})
    assert cfg.reward.url == "http://127.0.0.1:9" and cfg.reward.function is None

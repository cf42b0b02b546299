"""The agent source under torchrun: 2 CPU ranks with DDP, FSDP2 and DeepSpeed ZeRO-2/3, each serving its share of
the episodes on its own gateway (shifu.rollout.agent; a sharded actor's whole copy, strategy.whole); episodes with
an environment under DeepSpeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_agent import EXAMPLES, build_echo_task  # noqa: E402

HERE = Path(__file__).resolve().parent
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "shifu",
]


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")]
    )
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


def rows_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.distributed
@pytest.mark.slow
def test_under_torchrun_each_ddp_rank_runs_its_share_on_its_own_gateway(tmp_path):
    """torchrun, 2 CPU ranks, DDP: each rank serves its 8 episodes per iteration on its own gateway with the
    unwrapped actor; the run trains, evaluates on both ranks (and ends with its paired evaluation) and writes
    final/ once."""
    echo_task = build_echo_task(tmp_path)
    out = tmp_path / "ddp"
    cmd = TORCHRUN + [
        "ppo",
        f"out_dir={out}",
        f"model.path={echo_task['char']}",
        f"data.train={echo_task['prompts']}",
        "agent.factory=echo_agent:solve",
        "distributed.strategy=ddp",
        "distributed.timeout_s=60",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=2",
        "batch_size=16",
        "minibatch_size=8",
        "eval.every=2",
        "eval.num_prompts=8",
        "critic.init=sft",
        "progress=false",
        "tensorboard=false",
    ]
    run(cmd)
    rows = rows_of(out)
    train = [r for r in rows if "agent/return" in r]
    assert len(train) == 2 and all(r["rollout/rows"] == 16 and r["agent/calls"] == 2 for r in train)
    assert [r for r in rows if "gold/score" in r] and (out / "final" / "model.safetensors").exists()
    summary = json.loads((out / "summary.json").read_text())  # the final paired evaluation, both ranks' share
    assert summary["gold_judge"] == "episode return of echo_agent:solve" and summary["eval_prompts"] >= 1
    assert "gold_gain" in summary and summary["source"]["kind"] == "agent"


def agent_run(task: dict, out: Path, *extra: str) -> list[dict]:
    """2 ranks x 8 episodes of echo_agent per iteration, 2 iterations; the training rows of metrics.jsonl."""
    run(
        TORCHRUN
        + [
            "ppo",
            f"out_dir={out}",
            f"model.path={task['char']}",
            f"data.train={task['prompts']}",
            "agent.factory=echo_agent:solve",
            "distributed.timeout_s=120",
            "generation.max_new_tokens=6",
            "generation.max_total_tokens=24",
            "iterations=2",
            "batch_size=16",
            "minibatch_size=8",
            "eval.every=0",
            "eval.num_prompts=4",
            "critic.init=sft",
            "optim.lr=1e-2",
            "progress=false",
            "tensorboard=false",
            *extra,
        ]
    )
    assert (out / "final" / "model.safetensors").exists()
    return [r for r in rows_of(out) if "agent/return" in r]


@pytest.fixture(scope="module")
def echo_ddp(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent_sharded")
    task = build_echo_task(d)
    return task, agent_run(task, d / "ddp", "distributed.strategy=ddp")


def zero_config(d: Path, stage: int) -> Path:
    path = d / f"zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return path


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "zero2", "zero3"])
def test_sharded_actors_serve_their_share_from_a_whole_copy_that_samples_as_ddp_does(
    echo_ddp, tmp_path, strategy
):
    """FSDP2, ZeRO-2 and ZeRO-3 on 2 CPU ranks: each rank gathers whole weights (a plain copy under FSDP2 and
    ZeRO-3) and serves its 8 episodes on its own gateway. The first rollout samples the same weights with the same
    per-rank seeds as DDP's, so its agent metrics equal DDP's exactly (a copy missing a weight, or sampling from
    one rank's shard, would not); the run trains on and writes final/."""
    task, ddp = echo_ddp
    extra = ["distributed.strategy=fsdp2"]
    if strategy != "fsdp2":
        pytest.importorskip("deepspeed", reason="optional: pip install 'shifu-rlhf[deepspeed]'")
        zero = zero_config(tmp_path, int(strategy[-1]))
        extra = ["distributed.strategy=deepspeed", f"distributed.deepspeed_config={zero}"]
    rows = agent_run(task, tmp_path / strategy, *extra)
    assert len(rows) == 2 and all(r["rollout/rows"] == 16 and r["agent/calls"] == 2 for r in rows)
    agent = {k: v for k, v in rows[0].items() if k.startswith("agent/")}
    assert agent == {k: v for k, v in ddp[0].items() if k.startswith("agent/")}


@pytest.mark.distributed
@pytest.mark.slow
def test_episodes_with_an_environment_train_under_deepspeed_zero3(tmp_path):
    """An environment's episodes under ZeRO-3 on 2 CPU ranks: the partitioned actor samples each turn in step
    with the other rank (HF forwards, every rank stepping until all are done), rollouts and the held-out
    evaluation run each rank's share, and the run writes one copy of every record."""
    pytest.importorskip("deepspeed", reason="optional: pip install 'shifu-rlhf[deepspeed]'")
    import ppo_task

    model, prompts = (
        ppo_task.build_char_model(tmp_path / "model"),
        ppo_task.write_prompts(tmp_path / "p.jsonl"),
    )
    out = tmp_path / "episodes"
    run(
        TORCHRUN
        + [
            "ppo",
            f"out_dir={out}",
            f"model.path={model}",
            f"data.train={prompts}",
            "env.factory=thirdparty_env:Echo",
            "critic.init=sft",
            "batch_size=8",
            "minibatch_size=4",
            "generation.stop=[g,h,i,j,k,l]",
            "generation.max_new_tokens=6",
            "generation.max_total_tokens=24",
            "iterations=2",
            "eval.every=1",
            "eval.num_prompts=6",
            "distributed.strategy=deepspeed",
            f"distributed.deepspeed_config={zero_config(tmp_path, 3)}",
            "distributed.timeout_s=120",
            "progress=false",
            "tensorboard=false",
        ]
    )
    metrics = rows_of(out)
    rolled = [r for r in metrics if "env/turns" in r]
    assert len(rolled) == 2 and all(r["rollout/rows"] == 8 and 1 <= r["env/turns"] <= 2 for r in rolled)
    evals = [r for r in metrics if "eval/env/return" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip()]
    per_eval = [sum(x["iteration"] == i for x in samples) for i in (0, 1, 2)]
    assert per_eval[0] > 1 and per_eval == [per_eval[0]] * 3, per_eval
    assert (out / "final" / "model.safetensors").exists()

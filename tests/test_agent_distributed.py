"""The agent source under torchrun: 2 CPU ranks with DDP, each serving its share of the episodes on its own
gateway (shifu.rollout.agent)."""

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


@pytest.mark.distributed
@pytest.mark.slow
def test_under_torchrun_each_ddp_rank_runs_its_share_on_its_own_gateway(tmp_path):
    """torchrun, 2 CPU ranks, DDP: each rank serves its 8 episodes per iteration on its own gateway with the
    unwrapped actor; the run trains, evaluates on both ranks (and ends with its paired evaluation) and writes
    final/ once."""
    echo_task = build_echo_task(tmp_path)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(here), str(here.parent), env.get("PYTHONPATH", "")]
    )
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "shifu",
    ]
    cmd += [
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
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "agent/return" in r]
    assert len(train) == 2 and all(r["rollout/rows"] == 16 and r["agent/calls"] == 2 for r in train)
    assert [r for r in rows if "gold/score" in r] and (out / "final" / "model.safetensors").exists()
    summary = json.loads((out / "summary.json").read_text())  # the final paired evaluation, both ranks' share
    assert summary["gold_judge"] == "episode return of echo_agent:solve" and summary["eval_prompts"] >= 1
    assert "gold_gain" in summary and summary["source"]["kind"] == "agent"

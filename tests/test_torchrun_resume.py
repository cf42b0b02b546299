"""SIGTERM to the torchrun launcher, then ``--resume``, with sharded checkpoints (2 CPU processes, gloo):
FSDP2 (``shifu sft``, DCP shards) and DeepSpeed ZeRO-2 (``shifu ppo``, the engines' own checkpoints, and
PPO's closing save rewriting the step it stopped at). The resumed run must end bit-identical to an
uninterrupted 2-process run: final weights (and the critic) and every metric row but time/perf.
The launch helpers and the DDP case are in ``test_torchrun_faults.py``."""

from __future__ import annotations

import json

import pytest
from ppo_task import build_char_model, write_prompts
from test_resume import metric_rows, weights_digest
from test_torchrun_faults import data, preempted_and_resumed, sft_argv  # noqa: F401 (data: a fixture)

from shifu.runs import checkpoint as ckpt

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_fsdp2_sigterm_and_resume_is_bit_identical(tiny_model_dir, data, tmp_path):  # noqa: F811
    common = ("max_steps=30", "save_every=7", "distributed.strategy=fsdp2", "distributed.timeout_s=60")
    full, part, stopped = preempted_and_resumed(
        tmp_path, lambda out: sft_argv(tiny_model_dir, data, out, *common), "sft", "step", 30
    )
    assert (part / "checkpoints" / "step-00000030" / "sharded" / "policy" / ".metadata").exists()
    assert weights_digest(part / "final") == weights_digest(full / "final")
    assert metric_rows(part) == metric_rows(full)
    print(f"fsdp2: SIGTERM at step {stopped}, resumed to 30: final weights and metrics bit-identical")


def test_deepspeed_sigterm_and_resume_is_bit_identical(tmp_path):
    pytest.importorskip("deepspeed", reason="optional: pip install 'shifu-rlhf[deepspeed]'")
    model, prompts = build_char_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl")
    zero2 = tmp_path / "zero2.json"
    zero2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))

    def argv(out):
        return [
            "ppo",
            "--out",
            str(out),
            f"model.path={model}",
            f"data.train={prompts}",
            "critic.init=sft",
            "reward.function=ppo_task:frac_a",
            "batch_size=8",
            "minibatch_size=4",
            "generation.max_new_tokens=6",
            "eval.every=3",
            "eval.num_prompts=4",
            "iterations=6",
            "save_every=4",
            "progress=false",
            "tensorboard=false",
            "distributed.strategy=deepspeed",
            f"distributed.deepspeed_config={zero2}",
            "distributed.timeout_s=120",
        ]

    full, part, stopped = preempted_and_resumed(tmp_path, argv, "ppo", "iteration", 6)
    assert (ckpt.latest_checkpoint(part) / "sharded" / "actor" / "shards").is_dir()
    for d in ("final", "critic"):
        assert weights_digest(part / d) == weights_digest(full / d), d
    assert metric_rows(part) == metric_rows(full)
    print(
        f"deepspeed ZeRO-2 ppo: SIGTERM at iteration {stopped}, resumed to 6: weights and metrics bit-identical"
    )

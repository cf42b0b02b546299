"""The reward-hacking guard under DeepSpeed (2 CPU processes, gloo, ``shifu launch``): when it stops a run,
``best/`` goes back into the actor and ``final/`` holds exactly ``best/``'s weights, with ZeRO-3's
partitioned weights (each weight gathered, overwritten from rank 0's copy, partitioned again) and with
ZeRO-2's whole ones. Here ``best/`` is the evaluation at iteration 0 and the guard's KL ceiling stops the
run at iteration 2, two updates later, so a restore that did nothing leaves the updated actor in
``final/``."""

from __future__ import annotations

import json

import pytest
import torch
from ppo_task import build_char_model, write_prompts
from safetensors.torch import load_file
from test_torchrun_faults import Launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("stage", [3, 2])
def test_the_guard_restores_best_under_deepspeed(tmp_path, stage):
    pytest.importorskip("deepspeed", reason="optional: pip install 'shifu-rlhf[deepspeed]'")
    model, prompts = build_char_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl")
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    out = tmp_path / "run"
    run = Launch(
        tmp_path,
        "guarded",
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
        "optim.lr=1e-2",
        "eval.every=3",  # best/ at iteration 0 only, before the guard stops the run
        "eval.num_prompts=4",
        "iterations=6",
        "save_every=0",
        # iteration 1 samples from the unchanged actor (KL ~1e-7); iteration 2 from the updated one
        "guard.kl_ceiling=0.01",
        "progress=false",
        "tensorboard=false",
        "distributed.strategy=deepspeed",
        f"distributed.deepspeed_config={zero}",
        "distributed.timeout_s=120",
        launcher="shifu",
    )
    code, log = run.wait(300), run.output()
    assert code == 0 and run.exit_codes() == {0: 0, 1: 0}, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "guard.kl_ceiling" in (summary["guard"] or ""), summary
    assert summary["best_iteration"] == 0 and summary["iterations"] == 2, summary
    assert log.count("restoring best/ (iteration 0) as final/") == 1, log[-3000:]  # said once, by rank 0
    best = load_file(str(out / "best" / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert best.keys() == final.keys()
    differ = [k for k in best if not torch.equal(best[k], final[k])]
    assert not differ, f"ZeRO-{stage}: final/ differs from best/ in {differ}"
    print(
        f"ZeRO-{stage}: the guard stopped at iteration 2; final/ == best/ (iteration 0), {len(best)} tensors"
    )

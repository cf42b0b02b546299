"""A reward service that dies while an asynchronous run samples in the background (``max_staleness=1``): the
iteration that was training finishes, the run stops with its checkpoint, and ``--resume`` trains every prompt
of the uninterrupted run exactly once, in the same iterations; the batch whose sampling failed is sampled again
by the weights of that moment, never lost or trained twice."""

from __future__ import annotations

import json

import pytest
from test_serve_ppo import cfg, serve, task  # noqa: F401 (the fixture)

from shifu.errors import ShifuError
from shifu.runs import checkpoint as ckpt
from shifu.trainers import ppo

pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
from test_serve import free_port  # noqa: E402

pytestmark = pytest.mark.integration


def lines(run) -> list[dict]:
    return [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]


def test_a_service_that_dies_under_background_sampling_loses_and_repeats_nothing(task, tmp_path):  # noqa: F811
    whole, run = tmp_path / "whole", tmp_path / "run"
    ppo.train(cfg(task, whole, "reward.function=ppo_task:frac_a", "max_staleness=1"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # scoring requests: batch 1, then batches 2, 3, 4 sampled while iterations 1, 2, 3 train; the 4th dies
    service = serve("ppo_task:frac_a_then_dies", port)
    try:
        with pytest.raises(ShifuError, match=rf"{url}.*checkpoint of iteration 3 is in .*--resume"):
            ppo.train(cfg(task, run, f"reward.url={url}", "max_staleness=1"))
        assert service.wait(timeout=30) == 1
    finally:
        service.kill()
    assert ckpt.latest_checkpoint(run).name == "step-00000003"  # iteration 3 trained before the stop
    assert {x["step"] for x in lines(run)} == {0, 1, 2}  # iterations 1-3
    service = serve("ppo_task:frac_a", port)
    try:
        ppo.train(cfg(task, run, f"reward.url={url}", "max_staleness=1"), resume=True)
    finally:
        service.kill()
    a, b = lines(whole), lines(run)
    assert [(x["step"], x["prompt_id"]) for x in a] == [(x["step"], x["prompt_id"]) for x in b]
    # batch 3 (iteration 4) was sampled again after the stop, by version 3 instead of 2; every other as before
    assert [x["version"] for x in b if x["step"] == 3] == [3] * 16
    assert [x for x in a if x["step"] != 3] == [x for x in b if x["step"] != 3]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(s for s in steps if s > 0) == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # iteration 3's metrics logged once, on resume

"""The benchmark's short mode runs end to end and prints the documented keys (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from shifu.bench.timing import main

pytestmark = pytest.mark.integration

KEYS = {
    "median_s_per_iter",
    "min_s_per_iter",
    "median_generation_s",
    "median_scoring_s",
    "median_train_s",
    "generated_tokens_per_s",
    "peak_rss_mib",
    "flops_per_iter",
    "matmul_peak_gflops",
    "mfu",
    "mfu_generation",
    "mfu_scoring",
    "mfu_train",
    "optimizer_steps_per_iter",
}


@pytest.mark.slow
def test_short_benchmark_prints_one_json_line_with_the_documented_keys(capsys):
    assert main(["--short"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert KEYS <= out.keys()
    # same work as TRL's mapping: 4 epochs x 4 minibatches of 8
    assert out["optimizer_steps_per_iter"] == 16
    assert out["iterations"] == 1 and out["flops_per_iter"] > 0

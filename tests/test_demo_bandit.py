"""`shifu demo bandit`: PPO-clip + KL penalty on the ten-armed bandit learns the best arm, with bounded KL.

With beta = 0.1 the KL-regularised optimum pi* ∝ exp(mu / beta) has p(best) 0.818 and KL 1.684 nats to
the uniform reference; without the penalty the policy heads for the deterministic arm, KL -> log 10 = 2.303.
Bound stated here: with the penalty the KL stays below 2.0 in every epoch (and finite).
"""

import contextlib
import io
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from shifu.demo import main, regularised_optimum

torch.set_num_threads(1)
LINE = re.compile(r"^epoch\s+(\d+)\s+kl ([-\d.]+)\s+p\(best\) ([\d.]+)", re.M)
KL_BOUND = 2.0


def parse(stdout: str) -> list[tuple[int, float, float]]:
    return [(int(e), float(kl), float(p)) for e, kl, p in LINE.findall(stdout)]


def run_in_process(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_regularised_optimum_is_below_the_bound():
    pi = regularised_optimum(0.1)
    kl = float((pi * (pi * 10).log()).sum())
    assert 0.5 < pi[7] < 0.9 and kl < KL_BOUND < math.log(10)


def test_bandit_learns_the_best_arm_with_bounded_kl():
    stdout = run_in_process(["bandit", "--epochs", "60", "--seed", "0"])
    rows = parse(stdout)
    assert [r[0] for r in rows] == list(range(1, 61))
    assert rows[0][2] < 0.2  # starts near uniform (p = 0.1)
    assert rows[-1][2] > 0.5
    kls = [r[1] for r in rows]
    assert all(math.isfinite(k) and k < KL_BOUND for k in kls)
    # deterministic for a seed
    assert run_in_process(["bandit", "--epochs", "60", "--seed", "0"]) == stdout


def test_without_the_penalty_kl_exceeds_the_bound():
    """The bound above is the KL penalty's doing: with beta = 0 the same run goes past it."""
    rows = parse(run_in_process(["bandit", "--epochs", "60", "--seed", "0", "--kl-coef", "0"]))
    assert rows[-1][1] > KL_BOUND + 0.1 and rows[-1][2] > 0.9


def test_cli_subprocess():
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "shifu", "demo", "bandit", "--epochs", "30", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    rows = parse(result.stdout)
    assert len(rows) == 30
    assert rows[-1][2] > 0.5 and math.isfinite(rows[-1][1]) and rows[-1][1] < KL_BOUND


@pytest.mark.parametrize("argv", [["nope"], ["bandit", "--epochs", "0"], []])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        main(argv)
    assert exc.value.code == 2

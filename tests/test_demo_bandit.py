"""`shifu demo bandit`: PPO-clip, PPO-penalty and TRPO (+ KL penalty to a uniform reference) on the ten-armed
bandit learn the best arm with bounded KL; TRPO keeps every update inside its trust region.

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

from shifu.demo.bandit import main, regularised_optimum, run_bandit, trpo_step

torch.set_num_threads(1)
LINE = re.compile(r"^(\w+)\s+epoch\s+(\d+)\s+kl ([-\d.]+)\s+p\(best\) ([\d.]+)", re.M)
SUMMARY = re.compile(r"^(ppo|ppo_penalty|trpo)\s+([\d.]+)\s+([\d.]+)\s+(\d+)/(\d+)\s+([\d.]+)", re.M)
KL_BOUND = 2.0
DELTA = 0.01  # the default KL budget per update


def parse(stdout: str, method: str = "ppo") -> list[tuple[int, float, float]]:
    return [(int(e), float(kl), float(p)) for m, e, kl, p in LINE.findall(stdout) if m == method]


def run_in_process(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def quiet(**kw):
    return run_bandit(print_fn=lambda *_: None, **kw)


@pytest.mark.unit
def test_regularised_optimum_is_below_the_bound():
    pi = regularised_optimum(0.1)
    kl = float((pi * (pi * 10).log()).sum())
    assert 0.5 < pi[7] < 0.9 and kl < KL_BOUND < math.log(10)


@pytest.mark.unit
def test_bandit_learns_the_best_arm_with_bounded_kl():
    stdout = run_in_process(["bandit", "--method", "ppo", "--epochs", "60", "--seed", "0"])
    rows = parse(stdout)
    assert [r[0] for r in rows] == list(range(1, 61))
    assert rows[0][2] < 0.2  # starts near uniform (p = 0.1)
    assert rows[-1][2] > 0.5
    kls = [r[1] for r in rows]
    assert all(math.isfinite(k) and k < KL_BOUND for k in kls)
    # deterministic for a seed
    assert run_in_process(["bandit", "--method", "ppo", "--epochs", "60", "--seed", "0"]) == stdout


@pytest.mark.unit
def test_without_the_penalty_kl_exceeds_the_bound():
    """The bound above is the KL penalty's doing: with beta = 0 the same run goes past it."""
    argv = ["bandit", "--method", "ppo", "--epochs", "60", "--seed", "0", "--kl-coef", "0"]
    rows = parse(run_in_process(argv))
    assert rows[-1][1] > KL_BOUND + 0.1 and rows[-1][2] > 0.9


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trpo_stays_in_its_trust_region_and_learns_like_ppo(seed):
    """Every TRPO update has exact KL(pi_old || pi_new) <= delta, the constraint is active (some updates
    come near it), and p(best) ends comparable to PPO-clip's; PPO's clip alone goes past the same budget."""
    trpo = quiet(method="trpo", seed=seed, kl_budget=DELTA)
    ppo = quiet(method="ppo", seed=seed, kl_budget=DELTA)
    update_kls = [r["update_kl"] for r in trpo]
    assert all(0 <= k <= DELTA * (1 + 1e-6) for k in update_kls)
    assert max(update_kls) > 0.9 * DELTA
    assert sum(r["step"] > 0 for r in trpo) >= 50  # the line search accepts most steps

    def late_p_best(rows):
        return sum(r["p_best"] for r in rows[-10:]) / 10

    assert late_p_best(trpo) > 0.7
    assert abs(late_p_best(trpo) - late_p_best(ppo)) < 0.1
    assert max(r["update_kl"] for r in ppo) > DELTA
    assert all(r["kl"] < KL_BOUND for r in trpo)


@pytest.mark.unit
def test_trpo_takes_no_step_when_the_surrogate_cannot_improve():
    """Zero advantages: the gradient is 0, so no candidate improves the surrogate and the logits stay put."""
    logits = torch.tensor([0.5, -0.5, 0.0])
    new, frac = trpo_step(logits, lambda theta: (theta * 0).sum(), delta=0.01)
    assert frac == 0.0 and torch.equal(new, logits)
    # a linear surrogate: the step goes along F^-1 g and its KL stays within delta
    g = torch.tensor([1.0, -1.0, 0.0])
    new, frac = trpo_step(logits, lambda theta: theta @ g, delta=0.01)
    p_old = torch.softmax(logits, 0)
    kl = float((p_old * (torch.log_softmax(logits, 0) - torch.log_softmax(new, 0))).sum())
    assert frac > 0 and 0 < kl <= 0.01 * (1 + 1e-6) and float((new - logits) @ g) > 0


@pytest.mark.unit
def test_ppo_penalty_adapts_its_coefficient():
    rows = quiet(method="ppo_penalty", seed=0, kl_budget=DELTA)
    betas = [r["beta_pen"] for r in rows]
    assert betas[0] == 1.0 and len(set(betas)) > 3  # halved / doubled around the target
    assert sum(r["p_best"] for r in rows[-10:]) / 10 > 0.7


@pytest.mark.integration
def test_cli_subprocess_runs_every_method_and_prints_the_budget_table():
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "shifu", "demo", "bandit", "--epochs", "30", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    for method in ("ppo", "ppo_penalty", "trpo"):
        rows = parse(result.stdout, method)
        assert len(rows) == 30
        assert rows[-1][2] > 0.5 and math.isfinite(rows[-1][1]) and rows[-1][1] < KL_BOUND
    table = {
        m: (float(mean), float(mx), int(over), int(n))
        for m, mean, mx, over, n, _ in SUMMARY.findall(result.stdout)
    }
    assert set(table) == {"ppo", "ppo_penalty", "trpo"}
    assert table["trpo"][1] <= DELTA + 1e-4 and table["trpo"][2] == 0 and table["trpo"][3] == 30
    assert "budget 0.01" in result.stdout


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv",
    [
        ["nope"],
        ["bandit", "--epochs", "0"],
        [],
        ["bandit", "--method", "sgd"],
        ["bandit", "--kl-budget", "0"],
    ],
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        main(argv)
    assert exc.value.code == 2


@pytest.mark.unit
def test_unknown_method_in_python_raises():
    with pytest.raises(ValueError, match="unknown bandit method 'sgd'"):
        quiet(method="sgd")

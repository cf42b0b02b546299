"""KL estimators: hand values, and k1/k3 sample means converging to the analytic KL of two categoricals."""

import math

import pytest
import torch

from shifu.core import kl_estimate

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def test_hand_computed_values():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])  # log ratio log 2; r = pi_ref/pi = 1/2
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx((0.5 - 1) + math.log(2))
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_estimators_converge_to_the_analytic_kl():
    """Sample means of k1 and k3 at tokens drawn from pi approach KL(pi || pi_ref) (within 2%)."""
    pi = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = (pi * (pi / ref).log()).sum().item()
    gen = torch.Generator().manual_seed(0)
    samples = torch.multinomial(pi, 400_000, replacement=True, generator=gen)
    lp, ref_lp = pi.log()[samples], ref.log()[samples]
    for estimator in ("k1", "k3"):
        assert kl_estimate(lp, ref_lp, estimator).mean().item() == pytest.approx(exact, rel=0.02)
    assert (kl_estimate(lp, ref_lp, "k3") >= 0).all()  # k3 is non-negative per sample, k1 is not
    assert (kl_estimate(lp, ref_lp, "k1") < 0).any()


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")

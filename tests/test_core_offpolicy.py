"""Truncated importance sampling against rollout/trainer log-prob mismatch: hand values, padding, and the
weights applied through the advantages weighing each token's loss."""

import math

import pytest
import torch

from shifu.core import POLICY_LOSSES, rollout_mismatch, truncated_is_weights

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

L = math.log
# trainer/rollout ratios 2, 1, 0.5 on the real tokens; the last position of row 1 is padding
OLD = torch.tensor([[L(0.5), L(0.9)], [L(0.2), 50.0]])
ROLLOUT = torch.tensor([[L(0.25), L(0.9)], [L(0.4), float("nan")]])
MASK = torch.tensor([[True, True], [True, False]])


def test_truncated_is_weights_hand_computed():
    w = truncated_is_weights(OLD, ROLLOUT, MASK, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0], [0.5, 0.0]]))
    assert not w.requires_grad
    old = OLD.clone().requires_grad_(True)
    assert not truncated_is_weights(old, ROLLOUT, MASK).requires_grad  # a weight, never differentiated
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(OLD, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="must have one shape"):
        truncated_is_weights(OLD[:, :1], ROLLOUT, MASK)


def test_rollout_mismatch_hand_computed():
    stats = rollout_mismatch(OLD, ROLLOUT, MASK, cap=1.5)
    assert stats["abs_log_ratio"].item() == pytest.approx(2 * L(2) / 3)
    assert stats["max_abs_log_ratio"].item() == pytest.approx(L(2))
    # k3 of KL(pi_rollout || pi_old) at the engine's tokens: e^d - 1 - d with d = log pi_old - log pi_rollout
    k3 = (2 - 1 - L(2)) + 0.0 + (0.5 - 1 + L(2))
    assert stats["k3"].item() == pytest.approx(k3 / 3)
    assert stats["is_weight_mean"].item() == pytest.approx((1.5 + 1.0 + 0.5) / 3)
    assert stats["is_truncfrac"].item() == pytest.approx(1 / 3)
    assert all(v.dim() == 0 and torch.isfinite(v) for v in stats.values())
    assert set(rollout_mismatch(OLD, ROLLOUT, MASK)) == {"abs_log_ratio", "max_abs_log_ratio", "k3"}
    # identical distributions: no mismatch, weights 1
    same = rollout_mismatch(OLD, OLD, MASK, cap=2.0)
    assert (
        same["abs_log_ratio"].item() == 0.0
        and same["k3"].item() == 0.0
        and same["is_weight_mean"].item() == 1.0
    )
    empty = rollout_mismatch(OLD, ROLLOUT, torch.zeros_like(MASK), cap=2.0)
    assert all(v.item() == 0.0 for v in empty.values())


def test_padding_never_reaches_the_weights_or_the_statistics():
    old, rollout = OLD.clone(), ROLLOUT.clone()
    old[~MASK], rollout[~MASK] = float("inf"), -float("inf")
    assert torch.equal(truncated_is_weights(old, rollout, MASK), truncated_is_weights(OLD, ROLLOUT, MASK))
    dirty, clean = (
        rollout_mismatch(old, rollout, MASK, cap=2.0),
        rollout_mismatch(OLD, ROLLOUT, MASK, cap=2.0),
    )
    assert all(torch.equal(dirty[k], clean[k]) for k in clean)


@pytest.mark.parametrize("name", ["ppo", "gspo", "reinforce"])
def test_weighted_advantages_weigh_each_rows_loss(name):
    """Multiplying the advantages by w >= 0 multiplies each token's loss by w (one token per row here, so
    the batch loss is the mean over rows of w_i times that row's loss on its own)."""
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(5, 1, generator=gen)
    old = lp + 0.5 * torch.randn(5, 1, generator=gen)
    adv = torch.randn(5, 1, generator=gen)
    mask = torch.ones(5, 1, dtype=torch.bool)
    w = truncated_is_weights(old, old - torch.randn(5, 1, generator=gen), mask, cap=2.0)
    options = {"clip_low": 0.2, "clip_high": 0.2} if name == "gspo" else {}
    weighted, _ = POLICY_LOSSES[name](lp, old, adv * w, mask, **options)
    rows = [
        POLICY_LOSSES[name](lp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], **options)[0]
        for i in range(5)
    ]
    torch.testing.assert_close(weighted, (torch.stack(rows) * w[:, 0]).mean())

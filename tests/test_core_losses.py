"""PPO policy/value/penalty, Bradley-Terry and DPO losses: hand values, aggregation, masking, gradients."""

import math

import pytest
import torch

from shifu.core import bradley_terry_loss, dpo_loss, ppo_penalty_loss, ppo_policy_loss, ppo_value_loss

torch.set_num_threads(1)

L = math.log


def test_policy_loss_hand_computed():
    # ratios 1.5 (A=+1: clipped to 1.2), 0.5 (A=-1: clipped to 0.8 -> loss 0.8), 1.0 (A=2: loss -2)
    lp = torch.tensor([[L(1.5), L(0.5), 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ppo_policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    k3 = (1.5 - 1 - L(1.5)) + (0.5 - 1 - L(0.5))  # (ratio - 1) - log ratio
    assert stats["approx_kl"].item() == pytest.approx(k3 / 3)
    assert all(not s.requires_grad and s.dim() == 0 for s in stats.values())


def test_asymmetric_and_dual_clip():
    lp = torch.tensor([[L(5.0), L(1.5)]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # token 0: A<0, ratio 5: max(5, clip 1.28)*1 = 5; token 1: clip_high 0.28 -> min(1.5, 1.28) -> -1.28
    loss, _ = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((5.0 - 1.28) / 2)
    # dual clip c=3 bounds the A<0 token's loss at -c*A = 3
    loss, stats = ppo_policy_loss(lp, old, adv, mask, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.28) / 2)
    assert stats["dual_clipfrac"].item() == pytest.approx(0.5)
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            ppo_policy_loss(lp, old, adv, mask, dual_clip=bad)


def random_batch(seed, b=6, r=5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=gen)
    mask = torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(b, r, generator=gen) * 3
    lp = old + 0.4 * torch.randn(b, r, generator=gen)
    adv = torch.randn(b, r, generator=gen)
    return lp, old, adv, mask


def test_token_mean_vs_seq_mean():
    """Convention: token_mean weighs every real token equally; seq_mean every row with a token equally."""
    lp = torch.zeros(2, 3)
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    token, _ = ppo_policy_loss(lp, old, adv, mask, aggregation="token_mean")
    seq, _ = ppo_policy_loss(lp, old, adv, mask, aggregation="seq_mean")
    assert token.item() == pytest.approx(-(3 + 4) / 4)
    assert seq.item() == pytest.approx(-(1 + 4) / 2)
    # a row without real tokens does not count in seq_mean
    mask_empty_row = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    seq3, _ = ppo_policy_loss(
        *(torch.cat([t, torch.ones(1, 3)]) for t in (lp, old, adv)), mask_empty_row, aggregation="seq_mean"
    )
    assert seq3.item() == pytest.approx(seq.item())
    with pytest.raises(ValueError, match="aggregation"):
        ppo_policy_loss(lp, old, adv, mask, aggregation="sum")


def test_empty_mask_loss_is_zero():
    lp, old, adv, mask = random_batch(0)
    loss, stats = ppo_policy_loss(lp, old, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0 and stats["clipfrac"].item() == 0.0


@pytest.mark.parametrize("which", ["policy", "value", "penalty"])
def test_token_mean_with_num_tokens_is_split_invariant(which):
    """Two micro-batches (or ranks) normalised by the global token count sum to the whole batch's loss."""
    lp, old, adv, mask = random_batch(1)
    old_v = torch.randn_like(lp)

    def loss_of(rows, **kw):
        if which == "policy":
            return ppo_policy_loss(lp[rows], old[rows], adv[rows], mask[rows], **kw)[0]
        if which == "value":
            return ppo_value_loss(lp[rows], old_v[rows], adv[rows], mask[rows], clip=0.2, **kw)[0]
        return ppo_penalty_loss(lp[rows], old[rows], adv[rows], mask[rows], beta=0.3, **kw)[0]

    whole = loss_of(slice(None))
    n = mask.sum()
    halves = loss_of(slice(0, 2), num_tokens=n) + loss_of(slice(2, None), num_tokens=n)
    torch.testing.assert_close(halves, whole)
    # without the global count the mean of the two halves differs (unequal token counts)
    assert not torch.allclose(0.5 * (loss_of(slice(0, 2)) + loss_of(slice(2, None))), whole)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_padding_changes_nothing_and_gets_zero_gradient(aggregation):
    lp, old, adv, mask = random_batch(2)
    returns = torch.randn_like(lp)
    poisoned = [t.clone() for t in (lp, old, adv, returns)]
    for t in poisoned:
        t[~mask] = 1e4  # huge, but finite: exp(1e4) = inf would still be masked

    def run(lp, old, adv, returns):
        x = lp.clone().requires_grad_(True)
        p_loss, p_stats = ppo_policy_loss(x, old, adv, mask, dual_clip=3.0, aggregation=aggregation)
        v = lp.clone().requires_grad_(True)
        v_loss, v_stats = ppo_value_loss(v, old, returns, mask, aggregation=aggregation)
        k = lp.clone().requires_grad_(True)
        k_loss, k_stats = ppo_penalty_loss(k, old, adv, mask, beta=0.5, aggregation=aggregation)
        (p_loss + v_loss + k_loss).backward()
        for g in (x.grad, v.grad, k.grad):
            assert (g[~mask] == 0).all()  # exactly zero on padding
            assert (g[mask] != 0).any()
        return [p_loss, v_loss, k_loss, *p_stats.values(), *v_stats.values(), *k_stats.values()]

    clean = run(lp, old, adv, returns)
    dirty = run(*poisoned)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.0, 2.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # token 0: unclipped 1, clipped V=0.7 -> 0.49 -> max 1; token 1: 1 both; token 2: 0
    loss, stats = ppo_value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 0) / 3)
    assert stats["clipfrac"].item() == 0.0
    # V moved towards the return beyond the clip: V=2, V_old=1, G=2.1 -> clipped V 1.2, (1.2-2.1)^2 = 0.81 > 0.01
    one = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = ppo_value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[2.1]]), one)
    assert loss.item() == pytest.approx(0.5 * 0.81)
    assert stats["clipfrac"].item() == 1.0
    loss, stats = ppo_value_loss(
        torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[2.1]]), one, clip=None
    )
    assert loss.item() == pytest.approx(0.5 * 0.01, rel=1e-5)
    assert stats["clipfrac"].item() == 0.0


def test_penalty_loss_hand_computed():
    """Loss = -(ratio*A - beta*KL(pi_old || pi)), KL by k3 = (ratio - 1) - log ratio."""
    lp = torch.tensor([[L(2.0), 0.0]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = ppo_penalty_loss(lp, old, adv, mask, beta=0.5)
    k3 = (2.0 - 1) - L(2.0)
    assert loss.item() == pytest.approx((-(2.0 - 0.5 * k3) - (-1.0)) / 2)
    assert stats["kl"].item() == pytest.approx(k3 / 2)
    assert stats["ratio_mean"].item() == pytest.approx(1.5)


def test_bradley_terry_hand_computed():
    chosen = torch.tensor([2.0, 0.0])
    rejected = torch.tensor([1.0, 0.5])
    loss, stats = bradley_terry_loss(chosen, rejected)
    sp = lambda z: math.log1p(math.exp(-z))  # -log sigmoid(z)  # noqa: E731
    assert loss.item() == pytest.approx((sp(1.0) + sp(-0.5)) / 2)
    assert stats["accuracy"].item() == 0.5
    assert stats["margin"].item() == pytest.approx(0.25)
    loss, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0]), center_coef=0.1)
    assert loss.item() == pytest.approx((sp(0.0) + sp(-0.5)) / 2 + 0.1 * (9.0 + 0.25) / 2)


def test_dpo_hand_computed():
    pc, pr = torch.tensor([-10.0]), torch.tensor([-12.0])
    rc, rr = torch.tensor([-11.0]), torch.tensor([-11.0])
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # implicit rewards 0.5*(+1) = 0.5 and 0.5*(-1) = -0.5; loss -log sigmoid(1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)))
    assert stats["chosen_reward"].item() == pytest.approx(0.5)
    assert stats["rejected_reward"].item() == pytest.approx(-0.5)
    assert stats["margin"].item() == pytest.approx(1.0)
    assert stats["accuracy"].item() == 1.0

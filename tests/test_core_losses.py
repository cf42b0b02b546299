"""PPO policy/value/penalty, Bradley-Terry and DPO losses: hand values, aggregation, masking, gradients."""

import inspect
import math

import pytest
import torch

from shifu.core import (
    POLICY_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    exact_kl,
    exact_kl_loss,
    gspo_policy_loss,
    kl_loss,
    ppo_penalty_loss,
    ppo_policy_loss,
    ppo_value_loss,
)

pytestmark = pytest.mark.unit

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


@pytest.mark.parametrize("which", ["policy", "value", "penalty", "gspo", "kl"])
def test_token_mean_with_num_tokens_is_split_invariant(which):
    """Two micro-batches (or ranks) normalised by the global token count sum to the whole batch's loss."""
    lp, old, adv, mask = random_batch(1)
    old_v = torch.randn_like(lp)

    def loss_of(rows, **kw):
        if which == "policy":
            return ppo_policy_loss(lp[rows], old[rows], adv[rows], mask[rows], **kw)[0]
        if which == "value":
            return ppo_value_loss(lp[rows], old_v[rows], adv[rows], mask[rows], clip=0.2, **kw)[0]
        if which == "gspo":
            return gspo_policy_loss(lp[rows], old[rows], adv[rows], mask[rows], clip_high=0.1, **kw)[0]
        if which == "kl":
            return kl_loss(lp[rows], old[rows], mask[rows], **kw)[0]
        return ppo_penalty_loss(lp[rows], old[rows], adv[rows], mask[rows], beta=0.3, **kw)[0]

    whole = loss_of(slice(None))
    n = mask.sum()
    halves = loss_of(slice(0, 2), num_tokens=n) + loss_of(slice(2, None), num_tokens=n)
    torch.testing.assert_close(halves, whole)
    # without the global count the mean of the two halves differs (unequal token counts)
    assert not torch.allclose(0.5 * (loss_of(slice(0, 2)) + loss_of(slice(2, None))), whole)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "token_sum_norm"])
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
        s = lp.clone().requires_grad_(True)
        s_loss, s_stats = gspo_policy_loss(
            s, old, adv, mask, clip_low=0.2, clip_high=0.2, aggregation=aggregation
        )
        r = lp.clone().requires_grad_(True)
        r_loss, r_stats = kl_loss(r, old, mask, aggregation=aggregation)
        (p_loss + v_loss + k_loss + s_loss + r_loss).backward()
        for g in (x.grad, v.grad, k.grad, s.grad, r.grad):
            assert (g[~mask] == 0).all()  # exactly zero on padding
            assert (g[mask] != 0).any()
        losses = [p_loss, v_loss, k_loss, s_loss, r_loss]
        return losses + [t for st in (p_stats, v_stats, k_stats, s_stats, r_stats) for t in st.values()]

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


def test_token_sum_norm_divides_by_a_constant():
    """Dr. GRPO: sum over real tokens / (rows * L_max); every token weighs the same whatever the lengths."""
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation="token_sum_norm")
    assert loss.item() == pytest.approx(-(3 + 4) / (2 * 3))  # default divisor B * R
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation="token_sum_norm", num_tokens=2 * 8)
    assert loss.item() == pytest.approx(-(3 + 4) / 16)  # rows * max_new_tokens
    # split invariance with the constant divisor: the two rows alone sum to the batch
    halves = sum(
        ppo_policy_loss(
            lp[i : i + 1],
            lp[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            aggregation="token_sum_norm",
            num_tokens=16,
        )[0]
        for i in range(2)
    )
    torch.testing.assert_close(halves, loss)
    # a token's gradient does not depend on the length of its own response (token_mean's does, via the count)
    x = lp.clone().requires_grad_(True)
    ppo_policy_loss(x, lp, adv, mask, aggregation="token_sum_norm", num_tokens=16)[0].backward()
    torch.testing.assert_close(x.grad, -torch.where(mask, adv, 0.0) / 16)


def test_every_policy_loss_has_the_one_signature():
    """The four tensors, then the same keywords for every loss (only the clip range's defaults differ:
    GSPO's are the paper's sequence-level ones)."""
    shape = {
        name: [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]
        for name, fn in POLICY_LOSSES.items()
    }
    assert all(s == shape["ppo"] for s in shape.values()), shape
    assert [n for n, k in shape["ppo"] if k is inspect.Parameter.POSITIONAL_OR_KEYWORD] == [
        "log_probs",
        "old_log_probs",
        "advantages",
        "response_mask",
    ]
    with pytest.raises(ValueError, match="beta"):
        POLICY_LOSSES["ppo_penalty"](*random_batch(3))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_takes_the_shared_signature_and_aggregations(name):
    lp, old, adv, mask = random_batch(3)
    options = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "beta": 0.1}  # what the trainer passes
    for aggregation, kw in [
        ("token_mean", {"num_tokens": 40}),
        ("seq_mean", {}),
        ("token_sum_norm", {"num_tokens": 60}),
    ]:
        loss, stats = POLICY_LOSSES[name](lp, old, adv, mask, aggregation=aggregation, **kw, **options)
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert {"approx_kl", "clipfrac", "ratio_mean"} <= set(stats)
        assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_gspo_hand_computed():
    """Row 0: token log-ratios ln 2, 0 -> s = exp(ln 2 / 2) = sqrt 2, A = +1: clipped to 1.2 on both tokens.
    Row 1: one token, ratio 0.9, A = -1: inside [0.8, 1.2], loss 0.9. Row 2 is padding only."""
    lp = torch.tensor([[L(2.0), 0.0], [L(0.9), 5.0], [7.0, 7.0]])
    old = torch.zeros(3, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [3.0, 3.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    loss, stats = gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 1.2 + 0.9) / 3)
    loss, _ = gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, aggregation="seq_mean")
    assert loss.item() == pytest.approx((-1.2 + 0.9) / 2)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)  # the two tokens of the clipped row
    assert stats["ratio_mean"].item() == pytest.approx((math.sqrt(2) + 0.9) / 2)
    assert stats["approx_kl"].item() == pytest.approx(((2 - 1 - L(2)) + 0 + (0.9 - 1 - L(0.9))) / 3)
    # with the paper's default range (3e-4, 4e-4) the 0.9 sequence is clipped too: 0.9997 * 1
    loss, stats = gspo_policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.0004 * 2 + 0.9997) / 3)
    assert stats["clipfrac"].item() == 1.0


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_gspo_gradient_is_the_sequence_level_objective(aggregation):
    """With one advantage per row, GSPO-token's gradient equals that of GSPO's sequence objective
    -min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t log ratio), spread by the row's weight."""
    lp, old, _, mask = random_batch(4)
    row_adv = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(5))
    adv = row_adv.unsqueeze(1).expand_as(lp).contiguous()
    x = lp.clone().requires_grad_(True)
    gspo_policy_loss(x, old, adv, mask, clip_low=0.1, clip_high=0.1, aggregation=aggregation)[0].backward()

    y = lp.clone().requires_grad_(True)
    lengths = mask.sum(1).double()
    s = torch.exp(torch.where(mask, y - old, 0.0).sum(1) / lengths)
    per_seq = -torch.minimum(s * row_adv, s.clamp(0.9, 1.1) * row_adv)
    weights = 1 / len(lengths) if aggregation == "seq_mean" else lengths / lengths.sum()
    (per_seq * weights).sum().backward()
    torch.testing.assert_close(x.grad, y.grad.float())
    assert (x.grad[~mask] == 0).all()


def test_kl_loss_hand_computed_value_and_gradient():
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1 and d k3 / d log pi = 1 - pi_ref/pi (GRPO's KL term)."""
    lp = torch.tensor([[L(0.5), L(0.5)]], requires_grad=True)
    ref = torch.tensor([[L(0.25), 123.0]])
    mask = torch.tensor([[True, False]])
    loss, stats = kl_loss(lp, ref, mask)
    assert loss.item() == pytest.approx(0.5 - L(0.5) - 1)
    assert stats["kl"].item() == pytest.approx(0.5 - L(0.5) - 1)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[1 - 0.5, 0.0]]))
    # equal log-probs: zero loss and zero gradient; k1 option gives the log ratio
    zero, _ = kl_loss(lp.detach(), lp.detach(), mask)
    assert zero.item() == 0.0
    k1, _ = kl_loss(lp, ref, mask, estimator="k1")
    assert k1.item() == pytest.approx(L(2.0))


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_loss_expected_gradient_is_the_gradient_of_which_kl(estimator):
    """Over a categorical pi = softmax(theta), the expected gradient of the loss term at tokens sampled from
    pi (pi held fixed in the sampling) is: k2's, the gradient of KL(pi || pi_ref) (the KL the evaluation and
    the reward penalty measure); k3's, the gradient of KL(pi_ref || pi) (Zhang et al. 2025)."""
    theta = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.0], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp().detach()
    mask = torch.ones(1, 1, dtype=torch.bool)
    expected = sum(
        p[a]
        * torch.autograd.grad(
            kl_loss(logp[a].view(1, 1), ref[a].view(1, 1), mask, estimator=estimator)[0],
            theta,
            retain_graph=True,
        )[0]
        for a in range(4)
    )
    if estimator == "k2":
        kl = (logp.exp() * (logp - ref)).sum()  # KL(pi || pi_ref)
    else:
        kl = (ref.exp() * (ref - logp)).sum()  # KL(pi_ref || pi)
    (true,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected, true)


def test_exact_kl_loss_hand_computed_value_and_gradient():
    """kl.loss_estimator=full: sum_v pi_v log(pi_v / pi_ref_v) at each real position, aggregated like the
    policy loss; its gradient in the logits is the analytic one, pi_v (log(pi_v / pi_ref_v) - KL)."""
    theta = torch.tensor([[[0.0, 0.0], [0.4, -0.2]]], dtype=torch.float64, requires_grad=True)  # (1, 2, V=2)
    ref = torch.log(torch.tensor([[[0.75, 0.25], [0.5, 0.5]]], dtype=torch.float64))
    mask = torch.tensor([[True, False]])
    loss, stats = exact_kl_loss(torch.log_softmax(theta, -1), ref, mask)
    hand = 0.5 * L(0.5 / 0.75) + 0.5 * L(0.5 / 0.25)  # position 0 only: pi = (1/2, 1/2)
    assert loss.item() == pytest.approx(hand) and stats["kl"].item() == pytest.approx(hand)
    assert exact_kl(ref, ref).abs().max().item() == 0.0
    loss.backward()
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    log_ratio = p.log() - ref[0, 0]
    torch.testing.assert_close(theta.grad[0, 0], p * (log_ratio - hand))
    assert (theta.grad[0, 1] == 0).all()  # the masked position has no gradient
    with pytest.raises(ValueError, match="log_softmax"):
        exact_kl_loss(torch.zeros(1, 2), ref, mask)

"""shape_rewards and gae: where the score lands, the value after the last token, padding isolation."""

import pytest
import torch

from shifu.core import gae, shape_rewards

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def right_padded_mask(lengths, width):
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def test_score_lands_on_the_last_real_token():
    """Convention: -beta*kl on real tokens, the score added on the last real token, padding exactly 0."""
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
    mask = right_padded_mask([3, 1], 3)
    rewards = shape_rewards(torch.tensor([1.0, -2.0]), kl, mask, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, -0.15 + 1.0], [-0.2 - 2.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    # a 0-dim tensor coefficient gives the same
    torch.testing.assert_close(
        shape_rewards(torch.tensor([1.0, -2.0]), kl, mask, torch.tensor(0.5)), expected
    )
    # row sums: score - beta * sum(kl)
    torch.testing.assert_close(rewards.sum(1), torch.tensor([1.0 - 0.3, -2.0 - 0.2]))


def test_shape_rewards_ignores_padding_values():
    mask = right_padded_mask([2, 3], 4)
    kl = torch.rand(2, 4)
    poisoned = kl.clone()
    poisoned[~mask] = float("nan")
    scores = torch.tensor([0.3, 0.7])
    assert torch.equal(shape_rewards(scores, poisoned, mask, 0.1), shape_rewards(scores, kl, mask, 0.1))


def test_shape_rewards_rejects_an_empty_row():
    mask = right_padded_mask([2, 0], 3)
    with pytest.raises(ValueError, match=r"rows \[1\] have no real response token"):
        shape_rewards(torch.zeros(2), torch.zeros(2, 3), mask, 0.1)


def reference_gae(rewards, values, lengths, gamma, lam):
    """Plain Python loop over each row's real tokens; the value after the last token is 0."""
    adv = [[0.0] * len(rewards[0]) for _ in rewards]
    ret = [[0.0] * len(rewards[0]) for _ in rewards]
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
            ret[b][t] = running + values[b][t]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def test_gae_hand_computed():
    """One row, two real tokens, gamma=1, lam=0.5, V after the last token = 0."""
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 123.0]])
    mask = right_padded_mask([2], 3)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # delta_1 = 1 + 0 - 0.25 = 0.75 = A_1; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.5*0.75 = 0.125
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 1.0, 0.0]]))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.9), (0.9, 1.0), (1.0, 0.0)])
def test_gae_matches_reference_loop_on_random_right_padded_data(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 1, 4, 0, 5, 7]
    rewards = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    mask = right_padded_mask(lengths, 7)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_padding_never_influences_real_positions():
    gen = torch.Generator().manual_seed(1)
    mask = right_padded_mask([3, 5, 1], 5)
    rewards, values = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    adv, ret = gae(rewards, values, mask)
    huge_r, huge_v = rewards.clone(), values.clone()
    huge_r[~mask], huge_v[~mask] = 1e30, -1e30
    adv2, ret2 = gae(huge_r, huge_v, mask)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)

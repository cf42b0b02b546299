"""Critic-free estimators: group advantages (GRPO, Dr. GRPO, RLOO), DAPO's dynamic sampling, REINFORCE++'s
discounted returns, process rewards. Hand values, reference loops, layout errors, padding isolation."""

import math
import statistics

import pytest
import torch

from shifu.core import (
    discounted_returns,
    dynamic_sampling_mask,
    group_advantages,
    group_step_advantages,
    masked_whiten,
    place_step_rewards,
    sequence_returns,
    shape_rewards,
    shape_token_rewards,
    subtract_group_mean,
)

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

# two prompts, G = 3: rewards 1, 2, 3 (mean 2, std 1) and 0, 0, 4 (mean 4/3, std 4/sqrt 3)
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0], dtype=torch.float64)
S3 = math.sqrt(3)
HAND = {
    "grpo": [-1.0, 0.0, 1.0, -1 / S3, -1 / S3, 2 / S3],  # (r - mean) / std
    "dr_grpo": [-1.0, 0.0, 1.0, -4 / 3, -4 / 3, 8 / 3],  # r - mean
    "rloo": [1 - 2.5, 2 - 2.0, 3 - 1.5, 0 - 2.0, 0 - 2.0, 4 - 0.0],  # r - mean of the other two
    # best-of-G: w = (0, 0, 1) in both groups, mean 1/3, std 1/sqrt(3) -> sqrt(3) * (w - 1/3)
    "bon": [-1 / S3, -1 / S3, 2 / S3, -1 / S3, -1 / S3, 2 / S3],
}


def right_padded_mask(lengths, width):
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "bon"])
def test_group_advantages_hand_computed(method):
    adv = group_advantages(REWARDS, 3, method, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor(HAND[method], dtype=torch.float64))
    assert adv.shape == (6,) and adv.dtype == REWARDS.dtype


def test_best_of_g_shares_a_tie_for_the_best_and_pushes_only_it_up():
    # G = 4: one best (3 of 4 pushed down alike); two tied for the best (they split the push up)
    adv = group_advantages(torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 0.0, 3.0, 1.0]), 4, "bon", eps=0.0)
    torch.testing.assert_close(adv[:4], torch.tensor([-0.5, 1.5, -0.5, -0.5]))  # sqrt(4) * (w - 1/4)
    torch.testing.assert_close(adv[4:], torch.tensor([0.8660254, -0.8660254, 0.8660254, -0.8660254]))
    # only the rank of the best counts, not how far it is ahead
    far = group_advantages(torch.tensor([0.5, 200.0, 1.0, -1.0]), 4, "bon", eps=0.0)
    torch.testing.assert_close(far, adv[:4])


def test_grpo_eps_is_added_to_the_std():
    adv = group_advantages(REWARDS[:3], 3, "grpo", eps=1.0)  # std 1 -> divide by 2
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.0, 0.5], dtype=torch.float64))


def reference_group_advantages(rewards, g, method, eps):
    """One Python loop per group, statistics.stdev (n - 1) for GRPO, the others' mean for RLOO."""
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        mean = sum(group) / g
        for i, r in enumerate(group):
            if method == "grpo":
                out.append((r - mean) / (statistics.stdev(group) + eps))
            elif method == "dr_grpo":
                out.append(r - mean)
            elif method == "bon":  # 1/k on the k responses tied for the best, standardised
                w = [float(x == max(group)) / group.count(max(group)) for x in group]
                out.append((w[i] - sum(w) / g) / (statistics.stdev(w) + eps))
            else:
                out.append(r - sum(group[:i] + group[i + 1 :]) / (g - 1))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "bon"])
@pytest.mark.parametrize("g", [2, 4, 8])
def test_group_advantages_match_a_reference_loop(method, g):
    rewards = torch.randn(5 * g, generator=torch.Generator().manual_seed(g), dtype=torch.float64)
    adv = group_advantages(rewards, g, method, eps=1e-6)
    torch.testing.assert_close(adv, reference_group_advantages(rewards.tolist(), g, method, 1e-6))
    # every estimator is zero-mean within each group; RLOO is G/(G-1) times Dr. GRPO's
    torch.testing.assert_close(adv.view(-1, g).sum(1), torch.zeros(5, dtype=torch.float64))
    if method == "rloo":
        torch.testing.assert_close(adv, g / (g - 1) * group_advantages(rewards, g, "dr_grpo"))


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "bon"])
def test_equal_rewards_give_zero_advantage_never_nan(method):
    # float32 0.1: the rounded group mean differs from 0.1 in the last bit, the result must still be 0
    rewards = torch.tensor([0.1] * 7 + [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    adv = group_advantages(rewards, 7, method)
    assert torch.isfinite(adv).all()
    assert (adv[:7] == 0).all()
    assert (adv[7:] != 0).all()


@pytest.mark.parametrize(
    ("rewards", "g", "match"),
    [
        (torch.zeros(4), 1, "group_size must be >= 2"),
        (torch.zeros(5), 2, "not a positive multiple of group_size 2"),
        (torch.zeros(0), 2, "not a positive multiple"),
        (torch.zeros(2, 2), 2, "must be 1-D"),
    ],
)
def test_bad_group_layout_raises(rewards, g, match):
    for call in (
        lambda: group_advantages(rewards, g, "grpo"),
        lambda: subtract_group_mean(rewards, g),
        lambda: dynamic_sampling_mask(rewards, g),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_unknown_method_raises():
    with pytest.raises(
        ValueError, match="unknown group advantage method 'ppo'; valid: grpo, dr_grpo, rloo, bon"
    ):
        group_advantages(REWARDS, 3, "ppo")


def test_subtract_group_mean_hand_computed():
    torch.testing.assert_close(
        subtract_group_mean(REWARDS, 3), torch.tensor(HAND["dr_grpo"], dtype=torch.float64)
    )
    torch.testing.assert_close(
        subtract_group_mean(REWARDS, 2), REWARDS - torch.tensor([1.5, 1.5, 1.5, 1.5, 2, 2]).double()
    )


def test_dynamic_sampling_keeps_groups_with_different_rewards():
    """DAPO: all-correct and all-wrong groups are dropped (row mask, group count)."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.7])
    keep, dropped = dynamic_sampling_mask(rewards, 3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert keep.dtype == torch.bool and dropped.dim() == 0 and int(dropped) == 2
    keep, dropped = dynamic_sampling_mask(rewards, 3, atol=0.25)  # 0.5, 0.5, 0.7 counts as tied
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 6 and int(dropped) == 3
    # the kept rows are whole groups, so the group estimators still apply to them
    assert group_advantages(rewards[keep], 3, "grpo").shape == (3,)


def reference_discounted_returns(rewards, lengths, gamma):
    out = [[0.0] * len(rewards[0]) for _ in rewards]
    for b, n in enumerate(lengths):
        for t in range(n):
            out[b][t] = sum(gamma ** (s - t) * rewards[b][s] for s in range(t, n))
    return torch.tensor(out, dtype=torch.float64)


def test_discounted_returns_hand_computed():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, float("nan"), 7.0]])
    mask = right_padded_mask([3, 1], 3)
    # row 0: G_2 = 3, G_1 = 2 + 0.5 * 3 = 3.5, G_0 = 1 + 0.5 * 3.5 = 2.75; row 1: one real token
    expected = torch.tensor([[2.75, 3.5, 3.0], [5.0, 0.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.5), expected)


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5, 0.0])
def test_discounted_returns_match_a_reference_loop(gamma):
    lengths = [7, 1, 4, 0, 5, 7]
    rewards = torch.randn(6, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = right_padded_mask(lengths, 7)
    returns = discounted_returns(rewards, mask, gamma)
    torch.testing.assert_close(returns, reference_discounted_returns(rewards.tolist(), lengths, gamma))
    assert (returns[~mask] == 0).all()


def test_discounted_returns_padding_never_influences_real_positions():
    mask = right_padded_mask([3, 5, 1, 0], 5)
    rewards = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    poisoned = rewards.clone()
    poisoned[~mask] = float("nan")
    assert torch.equal(discounted_returns(rewards, mask, 0.9), discounted_returns(poisoned, mask, 0.9))


def test_reinforce_pp_returns_from_shaped_rewards():
    """REINFORCE++ (gamma 1): the first token's return is the whole-sequence return score - beta * sum kl,
    each later token drops the KL of the tokens before it; whitening over the batch gives the advantages."""
    scores = torch.tensor([1.0, -2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
    mask = right_padded_mask([3, 1], 3)
    returns = discounted_returns(shape_rewards(scores, kl, mask, 0.5), mask, gamma=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.75, 0.85], [-2.2, 0.0, 0.0]]))
    torch.testing.assert_close(returns[:, 0], sequence_returns(scores, kl, mask, 0.5))
    adv = masked_whiten(returns, mask)
    assert abs(float(adv[mask].mean())) < 1e-6 and (adv[~mask] == 0).all()
    # the baseline variant centres the scores within each group first
    centred = subtract_group_mean(torch.tensor([1.0, 3.0, 0.0, 0.0]), 2)
    assert centred.tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_shape_token_rewards_hand_computed():
    token_rewards = torch.tensor([[0.5, 0.0, 1.0], [2.0, float("nan"), 3.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, float("inf"), 9.0]])
    mask = right_padded_mask([3, 1], 3)
    expected = torch.tensor([[0.45, -0.1, 0.85], [1.8, 0.0, 0.0]])
    torch.testing.assert_close(shape_token_rewards(token_rewards, kl, mask, 0.5), expected)


def test_place_step_rewards_puts_each_step_on_its_last_token():
    mask = right_padded_mask([5, 2], 5)
    step_rewards = torch.tensor([[0.5, -1.0, 2.0], [3.0, float("nan"), float("nan")]])
    step_ends = torch.tensor([[1, 3, 4], [1, -1, -1]])  # row 1 has one step; -1 marks unused slots
    placed = place_step_rewards(step_rewards, step_ends, mask)
    torch.testing.assert_close(placed, torch.tensor([[0.0, 0.5, 0.0, -1.0, 2.0], [0.0, 3.0, 0.0, 0.0, 0.0]]))
    for ends, match in [
        ([[1, 3, 4], [2, -1, -1]], "ends on a padded position"),
        ([[1, 3, 5], [1, -1, -1]], "ends past the response"),
        ([[1, 1, 4], [1, -1, -1]], "same token"),
    ]:
        with pytest.raises(ValueError, match=match):
            place_step_rewards(step_rewards, torch.tensor(ends), mask)


# process supervision (DeepSeekMath sec. 4.1.3): G = 2, response 0 has steps ending at tokens 1 and 3 (rewards
# 0 + 1 and 0 + 2), response 1 (3 tokens) one step ending at token 2 that holds the 0.5 of its token 0.
STEP_REWARDS = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
STEP_ENDS = torch.tensor([[False, True, False, True], [False, False, True, False]])
STEP_MASK = right_padded_mask([4, 3], 4)
# the group's steps 1, 2, 0.5: mean 7/6, centred -1/6, 5/6, -2/3, unbiased std sqrt(21)/6; a token's advantage
# sums the centred steps from it on: response 0 tokens 0-1 -1/6 + 5/6, tokens 2-3 5/6; response 1 -2/3, pad 0
STEP_DR = torch.tensor([[2 / 3, 2 / 3, 5 / 6, 5 / 6], [-2 / 3, -2 / 3, -2 / 3, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo"])
def test_group_step_advantages_hand_computed(method):
    out = group_step_advantages(STEP_REWARDS, STEP_ENDS, STEP_MASK, 2, method, eps=0.0)
    expected = STEP_DR / (math.sqrt(21) / 6) if method == "grpo" else STEP_DR
    torch.testing.assert_close(out, expected)
    # credit lands up to the step: the first step's below-mean reward lowers tokens 0-1 of response 0 only
    assert out[0, 2] > out[0, 0] > 0 and (out[1, :3] < 0).all() and out[1, 3] == 0


def _step_reference(rewards, ends, mask, g, method, eps):
    """DeepSeekMath's process supervision written out as loops over python floats."""
    B, R = rewards.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for start in range(0, B, g):
        steps = []  # (row, end, reward)
        for i in range(start, start + g):
            acc = 0.0
            for t in range(R):
                if mask[i, t]:
                    acc += float(rewards[i, t])
                    if ends[i, t]:
                        steps.append((i, t, acc))
                        acc = 0.0
        values = [r for _, _, r in steps]
        if len(values) < 2 or max(values) == min(values):
            continue
        mean = statistics.fmean(values)
        std = statistics.stdev(values)
        for i, end, r in steps:
            norm = (r - mean) / (std + eps) if method == "grpo" else r - mean
            for t in range(end + 1):
                out[i, t] += norm
    return out


@pytest.mark.parametrize("method", ["grpo", "dr_grpo"])
def test_group_step_advantages_match_a_reference_loop(method):
    gen = torch.Generator().manual_seed(3)
    B, R, g = 6, 7, 3
    rewards = torch.randn(B, R, generator=gen, dtype=torch.float64)
    mask = right_padded_mask([7, 5, 1, 6, 7, 3], R)
    ends = (torch.rand(B, R, generator=gen) < 0.3) & mask
    ends[0] = False  # a response without a step: its rewards belong to no step, its advantage is 0
    out = group_step_advantages(rewards, ends, mask, g, method)
    torch.testing.assert_close(out, _step_reference(rewards, ends, mask, g, method, 1e-6))
    assert (out[0] == 0).all() and (out[~mask] == 0).all()


@pytest.mark.parametrize("method", ["grpo", "dr_grpo"])
def test_group_step_advantages_with_one_step_on_the_last_token_are_the_outcome_ones(method):
    mask = right_padded_mask([3, 5, 2, 4, 5, 1], 5)
    last = (mask.long().cumsum(1) == mask.sum(1, keepdim=True)) & mask
    token_rewards = torch.where(last, REWARDS.unsqueeze(1), torch.zeros((), dtype=REWARDS.dtype))
    out = group_step_advantages(token_rewards, last, mask, 3, method)
    torch.testing.assert_close(out, group_advantages(REWARDS, 3, method).unsqueeze(1) * mask)


def test_group_step_advantages_tied_steps_are_zero_and_bad_input_raises():
    mask = right_padded_mask([4, 3], 4)
    tied = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])  # every step earns 1
    out = group_step_advantages(tied, STEP_ENDS, mask, 2, "grpo")
    assert torch.equal(out, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="no per-step form"):
        group_step_advantages(tied, STEP_ENDS, mask, 2, "rloo")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_step_advantages(tied, STEP_ENDS, mask, 1, "grpo")
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_step_advantages(tied, STEP_ENDS, mask, 3, "grpo")
    with pytest.raises(ValueError, match=r"must all be \(B, R\)"):
        group_step_advantages(tied, STEP_ENDS[:, :3], mask, 2, "grpo")

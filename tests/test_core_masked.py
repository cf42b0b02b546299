"""Masked statistics: hand-computed values, the empty-mask convention, padding never reaching a result."""

import pytest
import torch

from shifu.core import masked_mean, masked_sum, masked_var, masked_whiten

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[True, True, False], [True, False, False]])


def test_hand_computed_sum_mean_var():
    assert masked_sum(X, M).item() == 7.0
    assert masked_mean(X, M).item() == pytest.approx(7 / 3)
    assert masked_sum(X, M, dim=1).tolist() == [3.0, 4.0]
    assert masked_mean(X, M, dim=1).tolist() == [1.5, 4.0]
    assert masked_mean(X, M, dim=0).tolist() == [2.5, 2.0, 0.0]  # all-False column -> 0
    # values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9
    assert masked_var(X, M).item() == pytest.approx(42 / 9 / 2)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(42 / 9 / 3)


def test_empty_mask_gives_zero_not_nan():
    """Convention: an all-False mask gives 0 for sum and mean (and biased var)."""
    empty = torch.zeros_like(M)
    assert masked_sum(X, empty).item() == 0.0
    assert masked_mean(X, empty).item() == 0.0
    assert masked_mean(X, empty, dim=1).tolist() == [0.0, 0.0]
    assert masked_var(X, empty, unbiased=False).item() == 0.0


def test_padding_never_reaches_a_result():
    poisoned = X.clone()
    poisoned[~M] = float("nan")
    poisoned[1, 2] = float("inf")
    assert masked_sum(poisoned, M).item() == masked_sum(X, M).item()
    assert masked_mean(poisoned, M, dim=1).tolist() == masked_mean(X, M, dim=1).tolist()
    assert masked_var(poisoned, M).item() == masked_var(X, M).item()
    assert torch.equal(masked_whiten(poisoned, M), masked_whiten(X, M))


def test_whiten_mean_zero_std_one_and_padding_zero():
    torch.manual_seed(0)
    x = torch.randn(4, 7) * 3 + 5
    mask = torch.rand(4, 7) > 0.3
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(w, mask).item() == pytest.approx(1.0, abs=1e-5)
    assert (w[~mask] == 0).all()


def test_whiten_without_shift_keeps_the_mean():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    w = masked_whiten(x, mask, shift_mean=False)
    # mean 2, unbiased std sqrt(2): (x - 2)/sqrt(2) + 2
    expected = torch.tensor([[2 - 1 / 2**0.5, 2 + 1 / 2**0.5, 0.0]])
    torch.testing.assert_close(w, expected)


def test_too_few_valid_elements_raise():
    one = torch.tensor([[True, False, False], [False, False, False]])
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(X, one)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, one)
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(X, M[:, :2])

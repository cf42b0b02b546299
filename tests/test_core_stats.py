"""RunningMoments (streaming, mergeable, serialisable) and explained_variance."""

import json

import pytest
import torch

from shifu.core import RunningMoments, explained_variance

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def test_running_moments_match_the_whole_data():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 1 for n in (5, 1, 17, 8)]
    rm = RunningMoments()
    first_mean, first_std = rm.update(batches[0])
    assert first_mean == pytest.approx(batches[0].mean().item())
    assert first_std == pytest.approx(batches[0].std().item())
    for b in batches[1:]:
        rm.update(b)
    everything = torch.cat(batches)
    assert rm.count == everything.numel()
    assert rm.mean == pytest.approx(everything.mean().item(), rel=1e-12)
    assert rm.var == pytest.approx(everything.var().item(), rel=1e-12)
    assert rm.std == pytest.approx(everything.std().item(), rel=1e-12)


def test_merge_equals_one_stream_and_state_round_trips():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(30, generator=gen), torch.randn(11, generator=gen) + 5
    rank0, rank1, single = RunningMoments(), RunningMoments(), RunningMoments()
    rank0.update(a)
    rank1.update(b)
    single.update(torch.cat([a, b]))
    rank0.merge(rank1)
    assert rank0.count == single.count
    assert rank0.mean == pytest.approx(single.mean, rel=1e-12)
    assert rank0.var == pytest.approx(single.var, rel=1e-12)
    restored = RunningMoments()
    restored.load_state_dict(json.loads(json.dumps(rank0.state_dict())))
    assert restored.state_dict() == rank0.state_dict()
    with pytest.raises(ValueError, match="empty"):
        restored.update(torch.zeros(0))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert explained_variance(returns, returns, mask).item() == 1.0
    constant = torch.full_like(returns, 2.0)  # predicts the mean: 0
    assert explained_variance(constant, returns, mask).item() == pytest.approx(0.0)
    # errors (1, 0, -1) around the mean... values (0, 2, 4): error (1, 0, -1), var 2/3 over var 2/3 -> 0
    assert explained_variance(torch.tensor([[0.0, 2.0, 4.0, 0.0]]), returns, mask).item() == pytest.approx(
        0.0
    )
    # padding values never count
    poisoned = returns.clone()
    poisoned[0, 3] = -1e6
    assert explained_variance(poisoned, returns, mask).item() == 1.0
    # undefined without variance in the returns
    assert torch.isnan(explained_variance(constant, constant, mask))


def test_mean_se_is_the_standard_error_of_the_mean():
    from shifu.core import mean_se

    # hand-computed: mean 2, sample std 1 (ddof=1), n = 3 -> se = 1/sqrt(3)
    assert mean_se([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1 / 3**0.5))
    assert mean_se([5.0]) == (5.0, None)  # one value has no spread
    with pytest.raises(ValueError):
        mean_se([])

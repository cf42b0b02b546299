"""KL controllers: hand-computed trajectories, JSON state round-trip, bad parameters."""

import json

import pytest

from shifu.core import (
    AdaptiveKLController,
    FixedKLController,
    PenaltyKLController,
    StepKLController,
    build_kl_controller,
)

pytestmark = pytest.mark.unit


def test_fixed_never_moves():
    c = FixedKLController(0.05)
    for kl in (0.0, 100.0):
        c.update(kl, 64)
    assert c.value == 0.05


def test_adaptive_hand_computed():
    """Ziegler et al.: e = clip(kl/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon."""
    c = AdaptiveKLController(init=0.1, target=6.0, horizon=10_000)
    c.update(12.0, 1000)  # e = +1 clipped to 0.2 -> *1.02
    assert c.value == pytest.approx(0.102)
    c.update(6.6, 1000)  # e = 0.1 -> *1.01
    assert c.value == pytest.approx(0.102 * 1.01)
    c.update(0.0, 1000)  # e = -1 clipped to -0.2 -> *0.98
    assert c.value == pytest.approx(0.102 * 1.01 * 0.98)
    assert isinstance(c.value, float)


def test_step_thermostat():
    c = StepKLController(init=1.0, target=2.0)
    c.update(3.0, 1)
    assert c.value == pytest.approx(1.2)
    c.update(1.0, 1)
    assert c.value == pytest.approx(0.96)
    c.update(2.0, 1)  # on target: unchanged
    assert c.value == pytest.approx(0.96)
    c = StepKLController(init=1.0, target=2.0, up=2.0, down=0.5)
    c.update(3.0, 1)
    assert c.value == 2.0


def test_penalty_ppo_paper_rule():
    c = PenaltyKLController(init=1.0, target=3.0)
    c.update(1.9, 1)  # < 3/1.5 = 2: halve
    assert c.value == 0.5
    c.update(4.6, 1)  # > 4.5: double
    assert c.value == 1.0
    c.update(2.1, 1)  # inside [2, 4.5]: keep
    c.update(4.4, 1)
    assert c.value == 1.0


@pytest.mark.parametrize("name", ["fixed", "adaptive", "step", "penalty"])
def test_state_round_trip_through_json(name):
    c = build_kl_controller(name, init=0.2, target=4.0, horizon=100)
    for kl in (9.0, 1.0, 5.0):
        c.update(kl, 16)
    state = json.loads(json.dumps(c.state_dict()))
    fresh = build_kl_controller(name, init=0.7, target=1.0, horizon=5)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == c.state_dict()
    # they stay in lock-step afterwards
    assert fresh.update(7.0, 16) == c.update(7.0, 16)


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)
    with pytest.raises(ValueError, match="target"):
        PenaltyKLController(0.1, target=-1.0)
    with pytest.raises(ValueError, match="up > 1"):
        StepKLController(0.1, target=1.0, up=0.9)
    with pytest.raises(ValueError, match="kl coefficient"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="valid: fixed, adaptive, step, penalty"):
        build_kl_controller("pid", 0.1, 1.0, 10)
    with pytest.raises(ValueError, match="needs a target"):
        build_kl_controller("adaptive", 0.1, None, 10)
    with pytest.raises(ValueError, match="cannot load"):
        FixedKLController(0.1).load_state_dict(StepKLController(0.1, 1.0).state_dict())

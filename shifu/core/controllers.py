"""Controllers of the KL coefficient beta.

They hold plain Python floats (``.value`` is a float, ``update`` takes the measured KL as a float,
``state_dict`` is JSON-able): this is host-side bookkeeping between iterations, not tensor math.
``current_kl`` is in the unit of the target, nats per response (``objective/kl``).
"""

from __future__ import annotations

import math
from typing import Any


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _non_negative(name: str, value: float) -> float:
    value = float(value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


class _KLController:
    kind = ""
    _fields: tuple[str, ...] = ()

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "value": self.value, **{f: getattr(self, f) for f in self._fields}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != self.kind:
            raise ValueError(f"state of a '{state.get('type')}' KL controller cannot load into '{self.kind}'")
        self.value = float(state["value"])
        for f in self._fields:
            setattr(self, f, state[f])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state_dict()})"


class FixedKLController(_KLController):
    """beta stays at ``value``."""

    kind = "fixed"

    def __init__(self, value: float):
        self.value = _non_negative("kl coefficient", value)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController(_KLController):
    """Ziegler et al. 2019 ("Fine-tuning language models from human preferences", sec. 2.2):
    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta *= 1 + e * n_steps / horizon``."""

    kind = "adaptive"
    _fields = ("target", "horizon")

    def __init__(self, init: float, target: float, horizon: int):
        self.value = _non_negative("kl coefficient", init)
        self.target = _positive("kl target", target)
        self.horizon = int(_positive("kl horizon", horizon))

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class StepKLController(_KLController):
    """Thermostat: ``beta *= up`` when KL > target, ``beta *= down`` when KL < target."""

    kind = "step"
    _fields = ("target", "up", "down")

    def __init__(self, init: float, target: float, up: float = 1.2, down: float = 0.8):
        self.value = _non_negative("kl coefficient", init)
        self.target = _positive("kl target", target)
        self.up, self.down = float(up), float(down)
        if not (self.up > 1 and 0 < self.down < 1):
            raise ValueError(f"step controller needs up > 1 and 0 < down < 1, got up={up}, down={down}")

    def update(self, current_kl: float, n_steps: int) -> float:
        if current_kl > self.target:
            self.value *= self.up
        elif current_kl < self.target:
            self.value *= self.down
        return self.value


class PenaltyKLController(_KLController):
    """PPO paper (Schulman et al. 2017, sec. 4): halve beta when d < target / 1.5, double it when
    d > 1.5 * target, otherwise keep it."""

    kind = "penalty"
    _fields = ("target",)

    def __init__(self, init: float, target: float):
        self.value = _non_negative("kl coefficient", init)
        self.target = _positive("kl target", target)

    def update(self, current_kl: float, n_steps: int) -> float:
        if current_kl < self.target / 1.5:
            self.value /= 2.0
        elif current_kl > self.target * 1.5:
            self.value *= 2.0
        return self.value


KL_CONTROLLERS = ("fixed", "adaptive", "step", "penalty")


def build_kl_controller(name: str, init: float, target: float | None, horizon: int) -> _KLController:
    """The controller called ``name`` (one of ``fixed``, ``adaptive``, ``step``, ``penalty``)."""
    if name not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller '{name}'; valid: {', '.join(KL_CONTROLLERS)}")
    if name == "fixed":
        return FixedKLController(init)
    if target is None:
        raise ValueError(f"the '{name}' KL controller needs a target (nats per response)")
    if name == "adaptive":
        return AdaptiveKLController(init, target, horizon)
    if name == "step":
        return StepKLController(init, target)
    return PenaltyKLController(init, target)

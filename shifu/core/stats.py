"""Streaming moments (for score normalisation), the explained variance of a critic, and the mean with its
standard error (every judged figure shifu reports)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .masked import masked_var


class RunningMoments:
    """Streaming mean and variance of every element seen, mergeable across ranks.

    Holds Python floats (count, mean, and M2 = sum of squared deviations) and so, unlike the rest of
    ``shifu.core``, reads tensors to the host in :meth:`update`. Updates use the parallel algorithm of
    Chan, Golub & LeVeque (1979): merging the moments of two sets gives the moments of their union,
    exact up to float64 rounding. ``var``/``std`` are the unbiased (n - 1) estimates, 0 with < 2 elements.
    """

    def __init__(self) -> None:
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def _combine(self, count: float, mean: float, m2: float) -> None:
        total = self.count + count
        if count == 0:
            return
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    def update(self, x: Tensor) -> tuple[float, float]:
        """Add every element of ``x``; returns the batch's own ``(mean, unbiased std)`` (std 0 for one element)."""
        if x.numel() == 0:
            raise ValueError("RunningMoments.update got an empty tensor")
        x = x.detach().to(torch.float64).flatten()
        n = x.numel()
        mean = x.mean().item()
        m2 = (x - mean).pow(2).sum().item()
        self._combine(float(n), mean, m2)
        return mean, math.sqrt(m2 / (n - 1)) if n > 1 else 0.0

    def merge(self, other: RunningMoments) -> RunningMoments:
        """Fold ``other``'s moments into this one (e.g. gathered from another rank); returns self."""
        self._combine(other.count, other.mean, other.m2)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over real tokens (0-dim tensor).

    1 is a perfect critic, 0 no better than a constant, negative worse. NaN when the returns have no
    variance (including an empty mask), because the quantity is undefined there.
    """
    var_returns = masked_var(returns, mask, unbiased=False)
    var_error = masked_var(returns - values, mask, unbiased=False)
    nan = torch.full((), float("nan"), dtype=var_returns.dtype, device=var_returns.device)
    return torch.where(var_returns > 0, 1 - var_error / var_returns, nan)


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and its standard error, ``std(ddof=1) / sqrt(n)`` (None for fewer than two
    values: one number has no spread to measure). A paired gain is ``mean_se([a - b for a, b in pairs])``."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_se of no values")
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n)

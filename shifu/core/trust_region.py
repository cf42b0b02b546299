"""Conjugate gradient, the linear solver of TRPO's natural-gradient step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def conjugate_gradient(fvp: Callable[[Tensor], Tensor], b: Tensor, iters: int = 10) -> Tensor:
    """Approximately solve ``F x = b`` for a symmetric positive-definite ``F`` given only ``v -> F v``.

    Hestenes & Stiefel 1952 (Nocedal & Wright, "Numerical optimization", alg. 5.2), starting at
    ``x = 0``: ``alpha = r.r / p.Fp``, ``x += alpha p``, ``r -= alpha Fp``, ``p = r + (r'.r' / r.r) p``.
    TRPO (Schulman et al. 2015, appendix C) solves ``F x = g`` this way, with ``fvp`` the Fisher-vector
    product (the Hessian of the KL times ``v``, by double backward), so ``F`` is never formed.

    ``b`` is a flat vector. Runs exactly ``iters`` steps, with no host synchronisation; in exact
    arithmetic ``iters = len(b)`` solves the system. A residual that reaches 0 stays 0 (the step sizes
    are 0 then, never NaN).
    """
    if b.dim() != 1:
        raise ValueError(f"conjugate_gradient works on a flat vector, got shape {tuple(b.shape)}")
    if iters < 1:
        raise ValueError(f"conjugate_gradient needs iters >= 1, got {iters}")
    zero = torch.zeros((), dtype=b.dtype, device=b.device)
    x = torch.zeros_like(b)
    r = b.clone()  # residual b - F x
    p = b.clone()  # search direction
    rr = r @ r
    for _ in range(iters):
        fp = fvp(p)
        p_fp = p @ fp
        alpha = torch.where(p_fp != 0, rr / torch.where(p_fp != 0, p_fp, 1.0), zero)
        x = x + alpha * p
        r = r - alpha * fp
        rr_new = r @ r
        beta = torch.where(rr != 0, rr_new / torch.where(rr != 0, rr, 1.0), zero)
        p = r + beta * p
        rr = rr_new
    return x

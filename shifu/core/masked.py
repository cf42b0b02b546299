"""Masked statistics over the real tokens of a padded batch.

Every function here selects with ``torch.where`` rather than multiplying by the mask, so padded
positions may hold anything (huge numbers, inf, NaN) without reaching a result. Masks are bool
(True = real token); other dtypes are read as ``mask != 0``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _as_bool(mask: Tensor, x: Tensor) -> Tensor:
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the tensor's shape {tuple(x.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is True (over all elements, or along ``dim``).

    An all-False mask gives 0.
    """
    mask = _as_bool(mask, x)
    selected = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim)


def last_true(mask: Tensor) -> Tensor:
    """Bool, True on the last True of each row of ``mask`` (..., R) (where a response's score goes: its last
    real token); a row without a True has none."""
    mask = mask.bool()
    return (mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)) & mask


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (over all elements, or along ``dim``).

    Convention: an all-False mask (or an all-False slice along ``dim``) gives 0, never NaN.
    """
    mask = _as_bool(mask, x)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the real elements of ``x`` (all dimensions pooled), a 0-dim tensor.

    ``unbiased=True`` divides by ``n - 1`` and raises ``ValueError`` when fewer than 2 elements are real
    (the check reads the count on the host). ``unbiased=False`` divides by ``n``; an empty mask gives 0.
    """
    mask = _as_bool(mask, x)
    count = mask.sum()
    if unbiased and bool(count < 2):
        raise ValueError(
            f"masked_var(unbiased=True) needs at least 2 real elements, got {int(count)}; "
            "check the mask or use unbiased=False"
        )
    centered = torch.where(mask, x - masked_mean(x, mask), torch.zeros((), dtype=x.dtype, device=x.device))
    denom = count - 1 if unbiased else count.clamp(min=1)
    return centered.pow(2).sum() / denom.to(x.dtype)


def _identity(t: Tensor) -> Tensor:
    return t


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    *,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the real elements (unbiased variance); padded positions are 0.

    ``shift_mean=False`` only rescales: the result keeps the original mean on the real elements
    (``(x - mean) / std + mean``). Raises ``ValueError`` when fewer than 2 elements are real.

    ``reduce`` turns a local sum into the sum over every process (a batch split across ranks is whitened
    with the statistics of the whole batch): the count, the sum and the sum of squared deviations each go
    through it once, so parallelism reaches this formula as numbers. ``None``: one process.
    """
    reduce = reduce or _identity
    mask = _as_bool(mask, x)
    count = reduce(mask.sum())
    if bool(count < 2):
        raise ValueError(
            f"masked_whiten needs at least 2 real elements to estimate a std, got {int(count)}; "
            "use a larger batch or skip whitening"
        )
    total = reduce(masked_sum(x, mask))
    mean = (total / count.clamp(min=1).to(total.dtype)).to(x.dtype)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    squares = reduce(torch.where(mask, x - mean, zero).pow(2).sum())
    var = (squares / (count - 1).to(squares.dtype)).to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, zero)

"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

Schulman, "Approximating KL Divergence" (2020), with ``r = pi_ref(x) / pi(x)``:
k1 = -log r (unbiased, can be negative), k2 = 1/2 (log r)^2 (biased, low variance),
k3 = (r - 1) - log r (unbiased and >= 0). :func:`exact_kl` is no estimate: the KL between the two
next-token distributions at a position, summed over the whole vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate (same shape as the inputs) of KL(pi || pi_ref) at tokens sampled from pi.

    ``log_probs`` are log pi of the sampled tokens, ``ref_log_probs`` log pi_ref of the same tokens.
    Averaging over samples estimates the KL; summing over a response's tokens estimates the
    sequence KL in nats. Padding is the caller's business (mask afterwards). To estimate
    KL(pi_old || pi) from tokens of pi_old, pass ``(old_log_probs, log_probs)``.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ"
        )
    log_ratio = log_probs - ref_log_probs  # log pi/pi_ref = -log r
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r
    raise ValueError(f"unknown KL estimator '{estimator}'; valid: {', '.join(KL_ESTIMATORS)}")


def exact_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """KL(pi(.|s_t) || pi_ref(.|s_t)) at each position, exactly: ``sum_v pi_v (log pi_v - log pi_ref_v)``.

    Inputs are the two log-softmaxes ``(..., V)`` over the vocabulary at the same positions (logits / T,
    each normalised); returns ``(...)``, >= 0 up to rounding. Differentiable in ``log_probs``: the gradient
    of every token's probability, not only the sampled one's (what k1/k2/k3 see). Summed over a response's
    positions (along the sampled prefix) its expectation is the sequence KL that k1 estimates.
    """
    if log_probs.shape != ref_log_probs.shape or log_probs.dim() < 2:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must be the same "
            "(..., V) log-softmaxes"
        )
    return (log_probs.exp() * (log_probs - ref_log_probs)).sum(-1)

"""Log-probabilities and entropy from logits, in chunks so that no second ``(B, T, V)`` tensor exists.

``logits[:, t]`` are the logits at the position that predicts ``tokens[:, t]`` (the caller slices
``[:, P-1 : P+R-1]`` of a model's output; see docs/architecture.md). Both functions work on views of
``logits`` (which may be non-contiguous), compute in float32 (bf16/fp16 chunks are upcast), and are
differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Elements of one (b, t, V) chunk: 2**22 floats = 16 MiB of float32 working memory per chunk.
DEFAULT_CHUNK_ELEMENTS = 2**22


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _map_chunks(fn: Callable[[Tensor, slice, slice], Tensor], logits: Tensor, chunk_elements: int) -> Tensor:
    """Apply ``fn(chunk (b,t,V), batch_slice, time_slice) -> (b,t)`` over views of ``logits`` (B,T,V)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    B, T, V = logits.shape
    rows = max(1, chunk_elements // max(V, 1))  # (b*t) rows per chunk
    b_step = max(1, min(B, rows))
    t_step = max(1, rows // b_step)
    if b_step >= B and t_step >= T:
        return fn(logits, slice(None), slice(None))
    out = []
    for b0 in range(0, B, b_step):
        bs = slice(b0, b0 + b_step)
        parts = [fn(logits[bs, t0 : t0 + t_step], bs, slice(t0, t0 + t_step)) for t0 in range(0, T, t_step)]
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=0)


def log_probs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> Tensor:
    """Log-probabilities ``(B, T)`` of ``tokens`` ``(B, T)`` under ``softmax(logits / temperature)``.

    ``log p(y) = z_y / tau - logsumexp(z / tau)``: one gather plus one logsumexp per chunk of at most
    ``chunk_elements`` logits, so only a chunk-sized temporary (the divided and upcast chunk, and
    logsumexp's own workspace) exists beside ``logits``. Differentiable.
    """
    _check_temperature(temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must be logits.shape[:2] = {tuple(logits.shape[:2])}"
        )
    index = tokens.long().unsqueeze(-1)

    def chunk_log_probs(chunk: Tensor, bs: slice, ts: slice) -> Tensor:
        z = chunk.float()
        if temperature != 1.0:
            z = z / temperature
        return z.gather(-1, index[bs, ts]).squeeze(-1) - torch.logsumexp(z, dim=-1)

    return _map_chunks(chunk_log_probs, logits, chunk_elements)


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> Tensor:
    """Entropy ``(B, T)`` in nats of ``softmax(logits / temperature)`` at each position.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, chunked like :func:`log_probs_from_logits`. Differentiable.
    """
    _check_temperature(temperature)

    def chunk_entropy(chunk: Tensor, bs: slice, ts: slice) -> Tensor:
        z = chunk.float()
        if temperature != 1.0:
            z = z / temperature
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)

    return _map_chunks(chunk_entropy, logits, chunk_elements)

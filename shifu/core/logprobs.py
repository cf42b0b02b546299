"""Log-probabilities and entropy from logits, in chunks so that no second ``(B, T, V)`` tensor exists.

``logits[:, t]`` are the logits at the position that predicts ``tokens[:, t]`` (the caller slices
``[:, P-1 : P+R-1]`` of a model's output; see docs/reference/architecture.md). Both functions read views of
``logits`` (which may be non-contiguous), compute in float32 (bf16/fp16 chunks are upcast) and return
float32 ``(B, T)``. They are differentiable through hand-written backward passes that recompute the softmax
chunk by chunk: autograd saves only ``logits`` itself (which the model's graph holds anyway) instead of
a divided or upcast copy per chunk, and the only ``(B, T, V)`` tensor created is the gradient.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

# Elements of one (b, t, V) chunk: 2**22 floats = 16 MiB of float32 working memory per temporary.
DEFAULT_CHUNK_ELEMENTS = 2**22


def _chunks(logits: Tensor, chunk_elements: int) -> Iterator[tuple[slice, slice]]:
    """(batch, time) slices covering ``logits`` (B, T, V) with at most ~``chunk_elements`` logits each."""
    B, T, V = logits.shape
    rows = max(1, chunk_elements // max(V, 1))  # (b * t) rows per chunk
    b_step = max(1, min(B, rows))
    t_step = max(1, rows // b_step)
    for b0 in range(0, B, b_step):
        for t0 in range(0, T, t_step):
            yield slice(b0, b0 + b_step), slice(t0, t0 + t_step)


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    z = chunk.float()
    return z / temperature if temperature != 1.0 else z


def _backward_chunks(logits: Tensor, chunk_elements: int) -> tuple[list[tuple[slice, slice]], Tensor | None]:
    """The chunks of a backward pass and the (B, T, V) gradient buffer they are written into; None when a
    single float32 chunk covers ``logits``: that chunk's gradient (a fresh tensor) is the gradient, so no
    second buffer and copy are made."""
    chunks = list(_chunks(logits, chunk_elements))
    if len(chunks) == 1 and logits.dtype == torch.float32:
        return chunks, None
    return chunks, torch.empty_like(logits, memory_format=torch.contiguous_format)


def _check(logits: Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class _TokenLogProbs(torch.autograd.Function):
    """log p(y) = u_y - logsumexp(u), u = z / tau; d/dz_v = (1[v = y] - softmax(u)_v) / tau."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, temperature: float, chunk_elements: int) -> Tensor:
        out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        for bs, ts in _chunks(logits, chunk_elements):
            u = _scaled(logits[bs, ts], temperature)
            out[bs, ts] = u.gather(-1, index[bs, ts]).squeeze(-1) - torch.logsumexp(u, dim=-1)
        ctx.save_for_backward(logits, index)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, index = ctx.saved_tensors
        chunks, grad = _backward_chunks(logits, ctx.chunk_elements)
        for bs, ts in chunks:
            g = torch.softmax(_scaled(logits[bs, ts], ctx.temperature), dim=-1).neg_()
            g.scatter_add_(-1, index[bs, ts], torch.ones_like(index[bs, ts], dtype=g.dtype))
            g.mul_(grad_out[bs, ts].unsqueeze(-1) / ctx.temperature)
            if grad is None:
                return g, None, None, None
            grad[bs, ts] = g
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(u) - sum_v p_v u_v, p = softmax(u), u = z / tau; dH/dz_v = -p_v (log p_v + H) / tau."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_elements: int) -> Tensor:
        out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        for bs, ts in _chunks(logits, chunk_elements):
            u = _scaled(logits[bs, ts], temperature)
            out[bs, ts] = torch.logsumexp(u, dim=-1) - (torch.softmax(u, dim=-1) * u).sum(-1)
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, entropy = ctx.saved_tensors
        chunks, grad = _backward_chunks(logits, ctx.chunk_elements)
        for bs, ts in chunks:
            log_p = torch.log_softmax(_scaled(logits[bs, ts], ctx.temperature), dim=-1)
            g = log_p.add(entropy[bs, ts].unsqueeze(-1)).mul_(log_p.exp()).neg_()
            g.mul_(grad_out[bs, ts].unsqueeze(-1) / ctx.temperature)
            if grad is None:
                return g, None, None
            grad[bs, ts] = g
        return grad, None, None


class _TokenLogProbsEntropy(torch.autograd.Function):
    """Both at once, sharing one normaliser per chunk: ``lse = logsumexp(u)``, ``log p(y) = u_y - lse``,
    ``H = lse - sum_v e_v u_v / sum_v e_v`` with ``e = exp(u - max u)``. Backward, with ``log p = u - lse``:
    ``d/du_v = g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H)``, divided by ``tau`` for ``z``."""

    @staticmethod
    def forward(ctx, logits, index, temperature, chunk_elements, entropy_grad):
        ctx.set_materialize_grads(False)
        lp = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for bs, ts in _chunks(logits, chunk_elements):
            u = _scaled(logits[bs, ts], temperature)
            m = u.amax(-1, keepdim=True)
            e = (u - m).exp_()
            s = e.sum(-1, keepdim=True)
            norm = s.log().add_(m)  # (b, t, 1) logsumexp
            lse[bs, ts] = norm.squeeze(-1)
            lp[bs, ts] = (u.gather(-1, index[bs, ts]) - norm).squeeze(-1)
            ent[bs, ts] = norm.squeeze(-1) - e.mul_(u).sum(-1).div_(s.squeeze(-1))
        ctx.save_for_backward(logits, index, lse, ent)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lp, grad_ent):
        logits, index, lse, ent = ctx.saved_tensors
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None
        chunks, grad = _backward_chunks(logits, ctx.chunk_elements)
        for bs, ts in chunks:
            log_p = _scaled(logits[bs, ts], ctx.temperature) - lse[bs, ts].unsqueeze(-1)
            g_lp = None if grad_lp is None else grad_lp[bs, ts].unsqueeze(-1)
            if grad_ent is None:  # -p g_lp, in place
                g = log_p.exp_().mul_(g_lp).neg_()
            else:  # -p (g_H (log p + H) + g_lp)
                p = log_p.exp()
                g = log_p.add_(ent[bs, ts].unsqueeze(-1)).mul_(grad_ent[bs, ts].unsqueeze(-1))
                if g_lp is not None:
                    g.add_(g_lp)
                g = g.mul_(p).neg_()
            if g_lp is not None:
                g.scatter_add_(-1, index[bs, ts], g_lp)
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            if grad is None:
                return g, None, None, None, None
            grad[bs, ts] = g
        return grad, None, None, None, None


def log_probs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> Tensor:
    """Log-probabilities ``(B, T)`` of ``tokens`` ``(B, T)`` under ``softmax(logits / temperature)``.

    ``log p(y) = z_y / tau - logsumexp(z / tau)``: one gather and one logsumexp per chunk of at most
    ``chunk_elements`` logits, so beside ``logits`` only chunk-sized temporaries exist (forward and
    backward). Differentiable once (no double backward).
    """
    _check(logits, temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must be logits.shape[:2] = {tuple(logits.shape[:2])}"
        )
    return _TokenLogProbs.apply(logits, tokens.long().unsqueeze(-1), float(temperature), int(chunk_elements))


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> Tensor:
    """Entropy ``(B, T)`` in nats of ``softmax(logits / temperature)`` at each position.

    ``H = logsumexp(u) - sum_v softmax(u)_v u_v`` with ``u = z / tau``, chunked like
    :func:`log_probs_from_logits`. Differentiable once.
    """
    _check(logits, temperature)
    return _Entropy.apply(logits, float(temperature), int(chunk_elements))


def log_probs_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`log_probs_from_logits` and :func:`entropy_from_logits` in one pass over the logits (one
    ``logsumexp`` per chunk serves both; about 0.6x the time of the two calls). With
    ``entropy_grad=False`` the entropy is returned outside the autograd graph (a logged-only entropy
    adds nothing to the backward pass)."""
    _check(logits, temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must be logits.shape[:2] = {tuple(logits.shape[:2])}"
        )
    return _TokenLogProbsEntropy.apply(
        logits, tokens.long().unsqueeze(-1), float(temperature), int(chunk_elements), bool(entropy_grad)
    )

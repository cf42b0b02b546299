"""Log-probabilities and entropy from logits, in chunks so that no second ``(B, T, V)`` tensor exists; and
from the final hidden states, with the output layer applied in chunks so that no ``(B, T, V)`` tensor exists.

``logits[:, t]`` are the logits at the position that predicts ``tokens[:, t]`` (the caller slices
``[:, P-1 : P+R-1]`` of a model's output; see docs/reference/architecture.md). The ``*_from_logits``
functions read views of ``logits`` (which may be non-contiguous), compute in float32 (bf16/fp16 chunks are
upcast) and return float32 ``(B, T)``. They are differentiable through hand-written backward passes that
recompute the softmax chunk by chunk: autograd saves only ``logits`` itself (which the model's graph holds
anyway) instead of a divided or upcast copy per chunk, and the only ``(B, T, V)`` tensor created is the
gradient.

The ``*_from_hidden`` functions take what the output layer reads instead, ``hidden`` ``(B, T, d)``, and its
``weight`` ``(V, d)`` (and ``bias``): each chunk's logits ``F.linear(hidden, weight, bias)`` are made,
upcast, reduced to ``(b, t)`` numbers and dropped, in the forward pass and again in the backward pass, so the
vocabulary-wide tensor never exists whole, not even as a gradient (the weight's gradient, ``(V, d)``, is
the largest tensor made).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn import functional as F

# Elements of one (b, t, V) chunk: 2**22 floats = 16 MiB of float32 working memory per temporary.
DEFAULT_CHUNK_ELEMENTS = 2**22


def _chunks(shape: tuple[int, ...], chunk_elements: int) -> Iterator[tuple[slice, slice]]:
    """(batch, time) slices covering a (B, T, V) ``shape`` with at most ~``chunk_elements`` logits each."""
    B, T, V = shape
    rows = max(1, chunk_elements // max(V, 1))  # (b * t) rows per chunk
    b_step = max(1, min(B, rows))
    t_step = max(1, rows // b_step)
    for b0 in range(0, B, b_step):
        for t0 in range(0, T, t_step):
            yield slice(b0, b0 + b_step), slice(t0, t0 + t_step)


def _head(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` of a chunk ``x`` (b, t, d) of the hidden states, as one 2-D product: a chunk
    of several rows and part of their positions is not contiguous, and F.linear would broadcast the weight
    into a batched product instead (the same values, measured 1.5x slower at SmolLM2's output layer)."""
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    z = chunk.float()
    return z / temperature if temperature != 1.0 else z


# ---------------------------------------------------------------------------------------------------------
# One chunk's arithmetic, shared by the logits and the hidden-state functions. ``u`` (b, t, V) float32 is
# ``logits / tau``; ``index`` (b, t, 1) the tokens; gradients are with respect to the logits ``z``.
# ---------------------------------------------------------------------------------------------------------
def _log_probs(u: Tensor, index: Tensor) -> Tensor:
    """log p(y) = u_y - logsumexp(u)."""
    return u.gather(-1, index).squeeze(-1) - torch.logsumexp(u, dim=-1)


def _log_probs_grad(u: Tensor, index: Tensor, grad_out: Tensor, temperature: float) -> Tensor:
    """d/dz_v of ``grad_out * log p(y)``: ``grad_out (1[v = y] - softmax(u)_v) / tau``."""
    g = torch.softmax(u, dim=-1).neg_()
    g.scatter_add_(-1, index, torch.ones_like(index, dtype=g.dtype))
    return g.mul_(grad_out.unsqueeze(-1) / temperature)


def _joint(u: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(log p(y), H, lse)`` sharing one normaliser: ``lse = logsumexp(u)``, ``log p(y) = u_y - lse``,
    ``H = lse - sum_v e_v u_v / sum_v e_v`` with ``e = exp(u - max u)``."""
    m = u.amax(-1, keepdim=True)
    e = (u - m).exp_()
    s = e.sum(-1, keepdim=True)
    norm = s.log().add_(m)  # (b, t, 1) logsumexp
    lp = (u.gather(-1, index) - norm).squeeze(-1)
    ent = norm.squeeze(-1) - e.mul_(u).sum(-1).div_(s.squeeze(-1))
    return lp, ent, norm.squeeze(-1)


def _joint_grad(
    u: Tensor,
    index: Tensor,
    lse: Tensor,
    ent: Tensor,
    grad_lp: Tensor | None,
    grad_ent: Tensor | None,
    temperature: float,
) -> Tensor:
    """With ``log p = u - lse``: ``d/du_v = g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H)``, divided by
    ``tau`` for ``z``."""
    log_p = u - lse.unsqueeze(-1)
    g_lp = None if grad_lp is None else grad_lp.unsqueeze(-1)
    if grad_ent is None:  # -p g_lp, in place
        g = log_p.exp_().mul_(g_lp).neg_()
    else:  # -p (g_H (log p + H) + g_lp)
        p = log_p.exp()
        g = log_p.add_(ent.unsqueeze(-1)).mul_(grad_ent.unsqueeze(-1))
        if g_lp is not None:
            g.add_(g_lp)
        g = g.mul_(p).neg_()
    if g_lp is not None:
        g.scatter_add_(-1, index, g_lp)
    if temperature != 1.0:
        g.div_(temperature)
    return g


def _backward_chunks(logits: Tensor, chunk_elements: int) -> tuple[list[tuple[slice, slice]], Tensor | None]:
    """The chunks of a backward pass and the (B, T, V) gradient buffer they are written into; None when a
    single float32 chunk covers ``logits``: that chunk's gradient (a fresh tensor) is the gradient, so no
    second buffer and copy are made."""
    chunks = list(_chunks(logits.shape, chunk_elements))
    if len(chunks) == 1 and logits.dtype == torch.float32:
        return chunks, None
    return chunks, torch.empty_like(logits, memory_format=torch.contiguous_format)


def _check(logits: Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_tokens(tokens: Tensor, shape: tuple[int, ...], name: str) -> None:
    if tokens.shape != shape:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} must be {name}.shape[:2] = {tuple(shape)}")


class _TokenLogProbs(torch.autograd.Function):
    """log p(y) = u_y - logsumexp(u), u = z / tau; d/dz_v = (1[v = y] - softmax(u)_v) / tau."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, temperature: float, chunk_elements: int) -> Tensor:
        out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        for bs, ts in _chunks(logits.shape, chunk_elements):
            out[bs, ts] = _log_probs(_scaled(logits[bs, ts], temperature), index[bs, ts])
        ctx.save_for_backward(logits, index)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, index = ctx.saved_tensors
        chunks, grad = _backward_chunks(logits, ctx.chunk_elements)
        for bs, ts in chunks:
            u = _scaled(logits[bs, ts], ctx.temperature)
            g = _log_probs_grad(u, index[bs, ts], grad_out[bs, ts], ctx.temperature)
            if grad is None:
                return g, None, None, None
            grad[bs, ts] = g
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(u) - sum_v p_v u_v, p = softmax(u), u = z / tau; dH/dz_v = -p_v (log p_v + H) / tau."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_elements: int) -> Tensor:
        out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        for bs, ts in _chunks(logits.shape, chunk_elements):
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
    """Both at once, sharing one normaliser per chunk (:func:`_joint`, :func:`_joint_grad`)."""

    @staticmethod
    def forward(ctx, logits, index, temperature, chunk_elements, entropy_grad):
        ctx.set_materialize_grads(False)
        lp = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for bs, ts in _chunks(logits.shape, chunk_elements):
            lp[bs, ts], ent[bs, ts], lse[bs, ts] = _joint(_scaled(logits[bs, ts], temperature), index[bs, ts])
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
            g = _joint_grad(
                _scaled(logits[bs, ts], ctx.temperature),
                index[bs, ts],
                lse[bs, ts],
                ent[bs, ts],
                None if grad_lp is None else grad_lp[bs, ts],
                None if grad_ent is None else grad_ent[bs, ts],
                ctx.temperature,
            )
            if grad is None:
                return g, None, None, None, None
            grad[bs, ts] = g
        return grad, None, None, None, None


def _head_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: autocast's where it is on (it casts both
    operands of a linear layer), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _HeadTokenStats(torch.autograd.Function):
    """Log-probs (and, with ``with_entropy``, entropies) under ``softmax(F.linear(hidden, weight, bias) / tau)``,
    the logits made one chunk at a time in the forward pass and again in the backward pass.

    Per chunk the forward is :func:`_log_probs` or :func:`_joint` of the chunk's logits and the backward the
    matching gradient ``g`` with respect to them (in the logits' dtype, as the upcast's backward would give),
    then the output layer's: ``d hidden = g W``, ``d W += g^T hidden``, ``d bias += sum g``, each only
    where asked for. Autograd saves ``hidden`` (which the output layer's own backward would save), the
    weight, and ``(B, T)`` normalisers."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, temperature, chunk_elements, with_entropy, entropy_grad):
        ctx.set_materialize_grads(False)
        dtype = _head_dtype(hidden, weight)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        shape = (*hidden.shape[:2], weight.shape[0])
        lp = torch.empty(shape[:2], dtype=torch.float32, device=hidden.device)
        ent, lse = (torch.empty_like(lp), torch.empty_like(lp)) if with_entropy else (None, None)
        with torch.autocast(hidden.device.type, enabled=False):  # the operands are cast already
            for bs, ts in _chunks(shape, chunk_elements):
                u = _scaled(_head(hidden[bs, ts].to(dtype), w, b), temperature)
                if with_entropy:
                    lp[bs, ts], ent[bs, ts], lse[bs, ts] = _joint(u, index[bs, ts])
                else:
                    lp[bs, ts] = _log_probs(u, index[bs, ts])
        ctx.save_for_backward(hidden, weight, bias, index, lse, ent)
        ctx.dtype, ctx.shape, ctx.temperature, ctx.chunk_elements = dtype, shape, temperature, chunk_elements
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lp, grad_ent):
        if grad_lp is None and grad_ent is None:
            return (None,) * 8
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return (*_head_backward(ctx, grad_lp, grad_ent), None, None, None, None, None)


def _head_backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
    """:class:`_HeadTokenStats`'s gradients for ``(hidden, weight, bias)``, chunk by chunk (None where not
    asked for)."""
    hidden, weight, bias, index, lse, ent = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    dtype, tau = ctx.dtype, ctx.temperature
    w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_bias = torch.zeros_like(bias) if need_bias else None
    for bs, ts in _chunks(ctx.shape, ctx.chunk_elements):
        x = hidden[bs, ts].to(dtype)
        u = _scaled(_head(x, w, b), tau)
        g_lp = None if grad_lp is None else grad_lp[bs, ts]
        if ent is None:
            g = _log_probs_grad(u, index[bs, ts], g_lp, tau)
        else:
            g_ent = None if grad_ent is None else grad_ent[bs, ts]
            g = _joint_grad(u, index[bs, ts], lse[bs, ts], ent[bs, ts], g_lp, g_ent, tau)
        g = g.to(dtype)  # (b, t, V): the gradient of the chunk's logits, in their dtype
        if need_hidden:
            grad_hidden[bs, ts] = g @ w
        if need_weight:
            _add_product(grad_weight, g.flatten(0, 1).t(), x.flatten(0, 1))
        if need_bias:
            grad_bias += g.sum((0, 1))
    return grad_hidden, grad_weight, grad_bias


def _add_product(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` in place (no temporary) where the dtypes agree, else through ``a @ b``."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += a @ b


def _check_head(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float
) -> None:
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (B, T, d) and weight (V, d), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_tokens(tokens, hidden.shape[:2], "hidden")


def _one_chunk(hidden: Tensor, weight: Tensor, chunk_elements: int) -> bool:
    B, T = hidden.shape[:2]
    return chunk_elements // max(weight.shape[0], 1) >= B * T


def log_probs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> Tensor:
    """Log-probabilities ``(B, T)`` of ``tokens`` ``(B, T)`` under ``softmax(logits / temperature)``.

    ``log p(y) = z_y / tau - logsumexp(z / tau)``: one gather and one logsumexp per chunk of at most
    ``chunk_elements`` logits, so beside ``logits`` only chunk-sized temporaries exist (forward and
    backward). Differentiable once (no double backward).
    """
    _check(logits, temperature)
    _check_tokens(tokens, logits.shape[:2], "logits")
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
    _check_tokens(tokens, logits.shape[:2], "logits")
    return _TokenLogProbsEntropy.apply(
        logits, tokens.long().unsqueeze(-1), float(temperature), int(chunk_elements), bool(entropy_grad)
    )


def log_probs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """:func:`log_probs_from_logits` of ``logits = F.linear(hidden, weight, bias)`` without the logits:
    ``hidden`` ``(B, T, d)`` is what an output layer of weight ``(V, d)`` reads at the positions that predict
    ``tokens`` ``(B, T)``. Each chunk of at most ``chunk_elements`` logits is made from its rows of
    ``hidden`` and dropped, in the forward and again in the backward pass (gradients for ``hidden``,
    ``weight`` and ``bias``, each where it requires one); under autocast the layer computes in autocast's
    dtype, as it would as a module. The values equal the logits function's on the layer's output; when one
    chunk covers everything it *is* that (the layer, then :func:`log_probs_from_logits`).
    """
    _check_head(hidden, weight, bias, tokens, temperature)
    if _one_chunk(hidden, weight, chunk_elements):
        return log_probs_from_logits(F.linear(hidden, weight, bias), tokens, temperature, chunk_elements)
    index = tokens.long().unsqueeze(-1)
    args = (float(temperature), int(chunk_elements), False, True)
    return _HeadTokenStats.apply(hidden, weight, bias, index, *args)[0]


def log_probs_and_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`log_probs_and_entropy` of ``logits = F.linear(hidden, weight, bias)`` without the logits,
    chunked as :func:`log_probs_from_hidden`."""
    _check_head(hidden, weight, bias, tokens, temperature)
    if _one_chunk(hidden, weight, chunk_elements):
        logits = F.linear(hidden, weight, bias)
        return log_probs_and_entropy(logits, tokens, temperature, chunk_elements, entropy_grad)
    index = tokens.long().unsqueeze(-1)
    args = (float(temperature), int(chunk_elements), True, bool(entropy_grad))
    return _HeadTokenStats.apply(hidden, weight, bias, index, *args)

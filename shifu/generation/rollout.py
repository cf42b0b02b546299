"""The sampler and the scoring forwards: :func:`sample` (one response per left-padded prompt, to EOS, a stop or
a budget), :func:`policy_forward` and :func:`critic_forward` (log-probs, entropy, values of a sequence's tokens).

Conventions (docs/reference/architecture.md): prompts are left-padded ``(B, P)``, what follows right-padded
``(B, R)``; a row is ``cat(prompt, rest)`` with position ids ``cumsum(attention_mask) - 1``. The log-prob / value
of token ``t`` of the rest is read at sequence position ``P - 1 + t``. A sampled response's mask is True from its
first token to its first EOS (included) or stop; everything after is ``pad_token_id``. What trains and what is
only read in a multi-turn trajectory is the rollout's business (:mod:`shifu.rollout.batch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from shifu.errors import ShifuError
from shifu.generation.decode import decoder
from shifu.generation.kv_cache import CallPrefixes
from shifu.generation.lm_head import token_log_probs
from shifu.models.padding import position_ids_from_mask
from shifu.models.positions import position_limit


@dataclasses.dataclass
class SamplingParams:
    """How responses are sampled. Order: ``logits / temperature``, then top-k, then top-p."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False
    stop_at_eos: bool = True


Generators = torch.Generator | list[torch.Generator] | None  # one for the batch, or one per row


def sample_next(
    logits: Tensor,
    params: SamplingParams,
    generator: Generators = None,
    probs: Tensor | None = None,
) -> Tensor:
    """(B,) next tokens from (B, V) logits: argmax when greedy, else softmax(logits/T) restricted by top-k
    then top-p (the smallest set of most likely tokens whose mass reaches p; the most likely always kept).
    ``probs``: softmax(logits/T) when the caller has it already (used only without top-k/top-p).
    ``generator``: one for the batch (B uniforms per step), or a list of B, one per row (row b's uniform is its
    own generator's next draw, whatever the other rows are)."""
    if params.greedy:
        return logits.argmax(-1)
    idx = None
    truncated = (0 < params.top_k < logits.shape[-1]) or params.top_p < 1.0
    if probs is None or truncated:
        scaled = logits.float() / params.temperature
        if 0 < params.top_k < scaled.shape[-1]:
            scaled, idx = scaled.topk(params.top_k, dim=-1)  # sorted descending
        elif params.top_p < 1.0:
            scaled, idx = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        # drop a token when the mass strictly before it already reaches p; the first is kept always, also for
        # a p so small that it rounds to 0 in the probabilities' precision
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill((before >= params.top_p) & (before > 0), 0.0)
    # inverse-CDF sampling: one uniform per row against the running mass (torch.multinomial draws one
    # exponential per vocabulary entry, ~20x slower at V = 4096 on CPU). With 0 <= u < total,
    # searchsorted(right=True) returns the first i with cdf[i] > u, so a zero-probability token (cdf flat)
    # is never chosen.
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = _uniforms(total.shape, generator, probs) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    choice = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return choice if idx is None else idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


def _mark_ends(buf: Tensor, t: int, eos_seen_at: Tensor, at_eos: bool, eos_token_id: int, stop) -> None:
    """Set ``eos_seen_at`` (B,) to ``t`` on the rows that end at step ``t``'s token (EOS when ``at_eos``, or
    marked by ``stop``) and had not ended before."""
    if not (at_eos or stop is not None):
        return
    R, tok = buf.shape[1], buf[:, t]
    ended = tok == eos_token_id if at_eos else torch.zeros_like(tok, dtype=torch.bool)
    if stop is not None:
        ended = ended | stop(buf[:, : t + 1], eos_seen_at == R).to(buf.device)
    eos_seen_at.masked_fill_(ended & (eos_seen_at == R), t)


def prefill(dec, prompt_ids: Tensor, pos: Tensor, prefix: CallPrefixes | None) -> Tensor:
    """The prompts' forward: (B, V) logits of their last positions. With ``prefix``, the columns before the
    first one it must compute are copied from the prefix cache instead."""
    start = 0 if prefix is None else prefix.load(dec, prompt_ids.shape[1])
    dec.length = start
    return dec.forward(prompt_ids[:, start:], pos[:, start:])


def _next_logits(dec, ids, pos, logits, held, ended, prefix, state) -> Tensor:
    """The (B, V) logits after feeding ``ids`` (B, 1) at ``pos``: every row's, or with ``held`` (:func:`sample`'s
    ``retire``) the ended rows retired first and the held rows' logits written into ``logits``."""
    if held is None:
        return dec.forward(ids, pos)
    _retire(dec, held, ended, prefix, state)
    rows = torch.tensor(held, device=ids.device)
    logits[rows] = dec.forward(ids[rows], pos[rows])
    return logits


def _retire(dec, held: list[int], ended: Tensor, prefix: CallPrefixes | None, state: tuple) -> None:
    """Drop the rows of ``held`` (the call's rows in the decoder's cache rows 0, 1, ...) that ``ended``: the last
    row held moves into each one's place (:func:`sample`'s ``retire``); the prefix cache keeps each first."""
    ended = ended.tolist()
    for slot in reversed(range(len(held))):  # from the last: the row moved in has not ended
        if not ended[held[slot]]:
            continue
        if prefix is not None:
            prefix.save(dec, *state, rows=[(slot, held[slot])])
        last = len(held) - 1
        if slot != last:
            dec.move(last, slot)
            held[slot] = held[last]
        held.pop()


def _uniforms(shape: torch.Size, generator: Generators, probs: Tensor) -> Tensor:
    """(B, 1) uniforms in [0, 1) from ``generator``, or row b's from ``generator[b]``; drawn on the
    generator's own device (a CPU generator also drives CUDA sampling: B floats)."""
    if isinstance(generator, list):
        rows = [torch.rand(1, generator=g, device=g.device, dtype=probs.dtype) for g in generator]
        return torch.cat(rows).to(probs.device).view(shape)
    device = generator.device if generator is not None else probs.device
    return torch.rand(shape, generator=generator, device=device, dtype=probs.dtype).to(probs.device)


def _finish(buf, eos_seen_at, steps, pad_token_id, stats=None, value_head=None) -> Sample:
    """Trim the (B, max_new) token buffer (and per-token stats) to ``steps`` columns and mask everything
    after the first EOS."""
    ids = buf[:, :steps]
    pos = torch.arange(steps, device=buf.device)
    mask = pos.unsqueeze(0) <= eos_seen_at.unsqueeze(1)
    ids = ids.masked_fill(~mask, pad_token_id)
    if stats is None:
        return Sample(ids, mask)
    lp, ent, values = stats[:, :, :steps]
    return Sample(ids, mask, lp, ent, values if value_head is not None else None)


class Sample(NamedTuple):
    """What :func:`sample` returns. ``response_ids`` (B, R) long and ``response_mask`` (B, R) bool as
    :func:`generate`; with ``with_log_probs``: ``log_probs`` and ``entropy`` (B, R) float32 of the sampled
    tokens under ``logits / temperature`` (full vocabulary, the distribution :func:`policy_forward` scores),
    and ``values`` (B, R) of ``value_head`` on the final hidden state when one is given. Padding positions
    hold whatever the finished rows computed; use ``response_mask``."""

    response_ids: Tensor
    response_mask: Tensor
    log_probs: Tensor | None = None
    entropy: Tensor | None = None
    values: Tensor | None = None


def check_positions(model, prompt_len: int, max_new_tokens: int) -> None:
    """ShifuError when a prompt of ``prompt_len`` tokens plus ``max_new_tokens`` would run past a model with
    positions (:func:`shifu.models.positions.position_limit`); trainers call it before writing anything."""
    n_positions = position_limit(model)
    if n_positions is not None and prompt_len + max_new_tokens > n_positions:
        raise ShifuError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"{n_positions} positions: lower data.max_prompt_len or generation.max_new_tokens"
        )


def check_exact_kl_memory(cfg, model, strategy) -> None:
    """``kl.loss_estimator=full`` (PPO's ``cfg``) keeps the reference's log-probs over the whole vocabulary for
    every response token of the rollout, (batch per process, max_new_tokens, V) floats: 12.6 MB at imdb's 2048
    tokens, ~300 MB at SmolLM2's 49152 with 64 x 24, growing with both. A ShifuError, before anything is
    written, when that is over half the memory ``strategy.free_memory()`` reports, naming the size."""
    if not (cfg.kl.penalty == "loss" and cfg.kl.loss_estimator == "full"):
        return
    rows, R, vocab = cfg.batch_size // strategy.world, cfg.generation.max_new_tokens, model.config.vocab_size
    need, free = rows * R * vocab * 4, strategy.free_memory()
    if free is not None and need > free // 2:
        raise ShifuError(
            f"kl.loss_estimator=full keeps the reference's log-probs over the vocabulary for the whole rollout: "
            f"{rows} responses x {R} tokens x {vocab} = {need / 2**30:.1f} GiB on this process, over half of "
            f"the {free / 2**30:.1f} GiB free on {strategy.device}; lower batch_size or "
            "generation.max_new_tokens, or use kl.loss_estimator=k3 (or k2)"
        )


def generate(model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, *args, **kwargs):
    """Sample responses -> ``(response_ids, response_mask)``; the arguments of :func:`sample`.

    ``prompt_ids``/``prompt_mask`` (B, P) are left-padded. ``response_ids`` (B, R) long and ``response_mask``
    (B, R) bool are right-padded: True on real response tokens including the first EOS; everything after
    the first EOS is ``pad_token_id`` with mask False. ``R <= max_new_tokens``: trimmed to the longest
    response; decoding stops early once every row has emitted EOS (when ``stop_at_eos``).
    """
    out = sample(model, prompt_ids, prompt_mask, params, *args, **kwargs)
    return out.response_ids, out.response_mask


@torch.no_grad()
def sample(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    generator: Generators = None,
    all_done: Callable[[bool], bool] | None = None,
    engine: str = "auto",
    with_log_probs: bool = False,
    value_head: nn.Module | None = None,
    stop: Callable[[Tensor, Tensor], Tensor] | None = None,
    on_step: Callable[[int, Tensor, Tensor, Tensor | None], None] | None = None,
    constrain: Callable[[int, Tensor], None] | None = None,
    prefix: CallPrefixes | None = None,
    retire: bool = False,
) -> Sample:
    """Sample a response to each left-padded prompt (:func:`generate` returns just the tokens and mask);
    with ``with_log_probs`` also what PPO's rollout would otherwise need a second forward pass for: the
    log-probs and entropies of the sampled tokens and shared-trunk values, read off the decode steps (the
    same logits, up to float rounding; ``tests/test_rollout.py`` checks 1e-5).

    ``all_done(local_done) -> global_done`` lets distributed ranks keep stepping (forwards on finished rows)
    until every rank is done; the default is local. ``engine="auto"`` uses the hand-written decoder for
    GPT-2 and Llama-style models (:mod:`shifu.generation.decode`, a preallocated KV cache) and the HF forward with its
    cache for everything else; "hf" forces the latter. Both give the same tokens up to float rounding.

    ``generator``: one for the batch, or one per row (:func:`sample_next`: a row's tokens then depend on its own
    generator only, not on the other rows').

    ``stop(tokens (B, t+1), running (B,) bool) -> (B,) bool``, called after each step, ends the rows it marks
    at the token just sampled, as EOS does (the token is kept): stop strings and per-row budgets of the
    episode source and the gateway (:class:`shifu.generation.stops.RowStops`). ``running`` marks the rows that have not ended.

    ``on_step(t, tokens (B,), real (B,) bool, logp (B, V) | None)``, called after each step once its ends are
    known: the tokens of step ``t``, the rows they belong to (True up to a row's ending token, included) and,
    with ``with_log_probs``, the step's ``log_softmax(logits / T)`` that the tokens' log-probs are read off
    (else None); the gateway streams answers with it as they are decoded and reads ``top_logprobs`` off it. It
    must not change ``logp``, and changes nothing sampled.

    ``constrain(t, logits (B, V))``, called before each step, may lower logits in place (a grammar's mask: the
    gateway's ``response_format``); the step then samples, and reads its log-probs and entropy, from the
    constrained logits, which :func:`policy_forward` does not recompute.

    ``prefix`` (:class:`shifu.generation.kv_cache.CallPrefixes`): the rows' cached prefixes are copied into the
    decoder's cache and only the columns after them prefilled; each row's prompt and response are kept for
    later calls. The same tokens and log-probs up to float rounding (its module docstring).

    ``retire``: a row that ended leaves the decoder at once (its cache row taken by the last row held,
    :meth:`~shifu.generation.decode._FastDecoder.move`), so later steps forward only the rows still sampling.
    Every row is still sampled each step (finished rows' draws are discarded, so a batch generator draws as
    many numbers as without), and the same tokens and log-probs come out up to the float rounding of forwards
    over fewer rows (``tests/test_prefix_cache.py``). Only with the decoders that keep their own cache, and
    without ``value_head`` or ``all_done`` (a rank stepping in lockstep forwards every row)."""
    B, P = prompt_ids.shape
    device = prompt_ids.device
    R = params.max_new_tokens
    if all_done is None:
        check_positions(model, P, R)
    # ranks stepping in step (all_done) keep forwarding rows that ended, whose positions may then run past a
    # model's learned positions: they are held at the last one (a row still sampling never gets there)
    last_position = position_limit(model)
    last_position = last_position - 1 if last_position is not None and all_done is not None else None
    retire = retire and all_done is None and value_head is None
    all_done = all_done or (lambda local: local)
    buf = torch.full((B, R), pad_token_id, dtype=torch.long, device=device)
    # index of the first EOS per row (R = none yet): response_mask = position <= eos_seen_at
    eos_seen_at = torch.full((B,), R, dtype=torch.long, device=device)
    stats = None
    if with_log_probs or value_head is not None:
        stats = torch.zeros((3, B, R), dtype=torch.float32, device=device)  # log-probs, entropy, values
    if R == 0:
        return _finish(buf, eos_seen_at, 0, pad_token_id, stats, value_head)
    weight = next(model.parameters())
    dec = decoder(model, B, P + R, weight, engine, want_hidden=value_head is not None)
    dec.key_mask[:, :P] = prompt_mask.to(dec.key_mask.dtype)
    pos = position_ids_from_mask(prompt_mask)
    next_pos = pos[:, -1:] + 1  # (B, 1) position of response token 0
    logits = prefill(dec, prompt_ids, pos, prefix)
    steps = 0
    # with retire: the call's rows held in the decoder's cache rows 0, 1, ...
    held = list(range(B)) if retire and dec.keeps_kv else None
    for t in range(R):
        if constrain is not None:
            constrain(t, logits)
        probs = None
        if stats is not None:  # log-softmax(logits / T) once: log-prob, entropy, and the sampling probs
            logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
            probs = logp.exp()
        tok = sample_next(logits, params, generator, probs)
        buf[:, t] = tok
        if stats is not None:
            stats[0, :, t] = logp.gather(1, tok.unsqueeze(1)).squeeze(1)
            stats[1, :, t] = -(probs * logp).sum(-1)
            if value_head is not None:
                stats[2, :, t] = value_head(dec.last_hidden).squeeze(-1).float()
        steps = t + 1
        _mark_ends(buf, t, eos_seen_at, params.stop_at_eos, eos_token_id, stop)
        if on_step is not None:
            on_step(t, tok, eos_seen_at >= t, logp if stats is not None else None)
        if (params.stop_at_eos or stop is not None) and all_done(bool((eos_seen_at < R).all())):
            break
        if t + 1 < R:
            pos = next_pos + t if last_position is None else (next_pos + t).clamp(max=last_position)
            state = (P, buf, eos_seen_at, steps)
            logits = _next_logits(dec, buf[:, t : t + 1], pos, logits, held, eos_seen_at < R, prefix, state)
    if prefix is not None:
        prefix.save(dec, P, buf, eos_seen_at, steps, None if held is None else enumerate(held))
    return _finish(buf, eos_seen_at, steps, pad_token_id, stats, value_head)


def policy_forward(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    value_head: nn.Module | None = None,
    entropy_grad: bool = True,
    log_softmax: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None] | tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Log-probs (B, R) of ``input_ids[:, P:]`` under ``logits / temperature``, read at positions
    ``P-1 .. P+R-2``; entropy (B, R) of the same distributions if asked (outside the autograd graph with
    ``entropy_grad=False``: a logged-only entropy costs no backward); ``value_head(last hidden state)``
    (B, R) at the same positions if a value head is given (shared-trunk critic). Differentiable.

    ``input_ids``/``attention_mask`` (B, P+R) = cat(left-padded prompt, right-padded response). Logits are
    computed only at the R positions needed (``logits_to_keep`` as an index tensor), and for the models
    :mod:`shifu.generation.lm_head` knows, a chunk at a time: no (B, R, V) tensor exists. With
    ``log_softmax`` a fourth output: the whole next-token log-distribution ``log_softmax(logits / T)``
    (B, R, V), float32 (the exact KL to the reference, ``kl.loss_estimator=full``; full logits).
    """
    position_ids = position_ids_from_mask(attention_mask)
    return token_log_probs(
        model,
        input_ids,
        attention_mask,
        position_ids,
        prompt_len,
        temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        value_head=value_head,
        log_softmax=log_softmax,
    )


def critic_forward(critic, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """(B, R) values of a :class:`shifu.models.scalar.ScalarModel` critic at positions ``P-1 .. P+R-2``."""
    T = input_ids.shape[1]
    values = critic(input_ids, attention_mask, position_ids=position_ids_from_mask(attention_mask))
    return values[:, prompt_len - 1 : T - 1]


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of each response: its real tokens minus a final EOS (EOS ends the response, it is not text)."""
    out = []
    for ids, mask in zip(response_ids.tolist(), response_mask.tolist()):
        real = [t for t, m in zip(ids, mask) if m]
        if real and real[-1] == tokenizer.eos_token_id:
            real = real[:-1]
        out.append(tokenizer.decode(real, skip_special_tokens=True))
    return out

"""The rollout engine: sampling responses and the batched scoring forwards of PPO.

Conventions (docs/architecture.md): prompts are left-padded ``(B, P)``, responses right-padded ``(B, R)``;
a rollout row is ``cat(prompt, response)`` with position ids ``cumsum(attention_mask) - 1``. The
log-prob / value of response token ``t`` is read at sequence position ``P - 1 + t``. ``response_mask`` is
True on real response tokens, the first EOS included; everything after it is ``pad_token_id``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from shifu.models import position_ids_from_mask


@dataclasses.dataclass
class SamplingParams:
    """How responses are sampled. Order: ``logits / temperature``, then top-k, then top-p."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False
    stop_at_eos: bool = True


def _log_probs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    # TODO(core): switch to shifu.core.log_probs_from_logits once it lands
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _entropy_from_logits(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sample_next(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """(B,) next tokens from (B, V) logits: argmax when greedy, else softmax(logits/T) restricted by top-k
    then top-p (the smallest set of most likely tokens whose mass reaches p; the most likely always kept)."""
    if params.greedy:
        return logits.argmax(-1)
    scaled = logits.float() / params.temperature
    idx = None
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        scaled, idx = scaled.topk(params.top_k, dim=-1)  # sorted descending
    elif params.top_p < 1.0:
        scaled, idx = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        # drop a token when the mass strictly before it already reaches p (keeps the first always)
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return choice if idx is None else idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


def _finish(buf: Tensor, eos_seen_at: Tensor, steps: int, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Trim the (B, max_new) token buffer to ``steps`` columns and mask everything after the first EOS."""
    ids = buf[:, :steps]
    pos = torch.arange(steps, device=buf.device)
    mask = pos.unsqueeze(0) <= eos_seen_at.unsqueeze(1)
    ids = ids.masked_fill(~mask, pad_token_id)
    return ids, mask


def _cache_kwarg(model) -> str:
    # transformers >= 5.2x renamed `past_key_values` to `cache`
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def generate(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    all_done: Callable[[bool], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample responses.

    ``prompt_ids``/``prompt_mask`` (B, P) are left-padded. Returns ``response_ids`` (B, R) long and
    ``response_mask`` (B, R) bool, right-padded: True on real response tokens including the first EOS;
    everything after the first EOS is ``pad_token_id`` with mask False. ``R <= max_new_tokens``: trimmed to
    the longest response; decoding stops early once every row has emitted EOS (when ``stop_at_eos``).
    ``all_done(local_done) -> global_done`` lets distributed ranks keep stepping (forwards on finished
    rows) until every rank is done; the default is local.
    """
    B, P = prompt_ids.shape
    device = prompt_ids.device
    R = params.max_new_tokens
    all_done = all_done or (lambda local: local)
    buf = torch.full((B, R), pad_token_id, dtype=torch.long, device=device)
    # index of the first EOS per row (R = none yet): mask = position <= eos_seen_at
    eos_seen_at = torch.full((B,), R, dtype=torch.long, device=device)
    if R == 0:
        return _finish(buf, eos_seen_at, 0, pad_token_id)
    mask = torch.zeros((B, P + R), dtype=torch.long, device=device)
    mask[:, :P] = prompt_mask.long()
    pos = position_ids_from_mask(mask[:, :P])
    next_pos = pos[:, -1:] + 1
    out = model(
        input_ids=prompt_ids, attention_mask=mask[:, :P], position_ids=pos, use_cache=True, logits_to_keep=1
    )
    past = _cache_of(out)
    cache_kw = _cache_kwarg(model)
    logits = out.logits[:, -1]
    steps = 0
    for t in range(R):
        tok = sample_next(logits, params, generator)
        buf[:, t] = tok
        steps = t + 1
        if params.stop_at_eos:
            newly = (tok == eos_token_id) & (eos_seen_at == R)
            eos_seen_at = torch.where(newly, torch.full_like(eos_seen_at, t), eos_seen_at)
            if all_done(bool((eos_seen_at < R).all())):
                break
        if t + 1 == R:
            break
        mask[:, P + t] = 1
        out = model(
            input_ids=tok.unsqueeze(1),
            attention_mask=mask[:, : P + t + 1],
            position_ids=next_pos,
            use_cache=True,
            **{cache_kw: past},
        )
        past = _cache_of(out)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    return _finish(buf, eos_seen_at, steps, pad_token_id)


def policy_forward(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    value_head: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Log-probs (B, R) of ``input_ids[:, P:]`` under ``logits / temperature``, read at positions
    ``P-1 .. P+R-2``; entropy (B, R) of the same distributions if asked; ``value_head(last hidden state)``
    (B, R) at the same positions if a value head is given (shared-trunk critic). Differentiable.

    ``input_ids``/``attention_mask`` (B, P+R) = cat(left-padded prompt, right-padded response). Logits are
    computed only at the R positions needed (``logits_to_keep`` as an index tensor).
    """
    P = prompt_len
    T = input_ids.shape[1]
    R = T - P
    keep = torch.arange(P - 1, T - 1, device=input_ids.device)  # (R,) positions predicting the response
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=keep,
        output_hidden_states=value_head is not None,
        use_cache=False,
    )
    logits = out.logits  # (B, R, V)
    assert logits.shape[1] == R
    log_probs = _log_probs_from_logits(logits, input_ids[:, P:], temperature)
    entropy = None
    if with_entropy:
        entropy = _entropy_from_logits(logits.float() / temperature if temperature != 1.0 else logits)
    values = None
    if value_head is not None:
        hidden = out.hidden_states[-1][:, P - 1 : T - 1]  # (B, R, d), after the final norm
        values = value_head(hidden).squeeze(-1)
    return log_probs, entropy, values


def critic_forward(critic, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """(B, R) values of a :class:`shifu.models.ScalarModel` critic at positions ``P-1 .. P+R-2``."""
    T = input_ids.shape[1]
    values = critic(input_ids, attention_mask, position_ids=position_ids_from_mask(attention_mask))
    return values[:, prompt_len - 1 : T - 1]


def _cat(parts: list):
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    raise TypeError(f"in_micro_batches: cannot concatenate outputs of type {type(first).__name__}")


@torch.no_grad()
def in_micro_batches(fn: Callable, micro_batch_size: int, *tensors: Tensor):
    """Run ``fn(*row_slices)`` over slices of ``micro_batch_size`` rows and concatenate the outputs along
    dim 0 (a tensor, or a tuple of tensors / None, as ``fn`` returns). No gradients."""
    n = tensors[0].shape[0]
    step = max(1, micro_batch_size)
    parts = [fn(*(t[i : i + step] for t in tensors)) for i in range(0, n, step)]
    return _cat(parts)

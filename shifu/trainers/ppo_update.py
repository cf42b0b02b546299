"""Phase 5 of a PPO iteration: ``ppo_epochs`` passes over the rollout in shuffled minibatches, each one
optimiser step on :func:`minibatch_loss` (the PPO objective ``L_policy + c1 L_value - c2 H (+ ptx)``)."""

from __future__ import annotations

import dataclasses
import math

import torch

from shifu import core
from shifu.config.schema import PPOConfig
from shifu.generation.lm_head import sequence_log_probs
from shifu.generation.rollout import critic_forward, policy_forward
from shifu.trainers.common import autocast
from shifu.trainers.ppo_models import PPOModels, PPOState
from shifu.trainers.ppo_rollout import Rollout


def update(
    m: PPOModels, s: PPOState, cfg: PPOConfig, rollout: Rollout, ptx=None, actor=True
) -> dict[str, float]:
    """``ppo_epochs`` passes over the rollout in shuffled minibatches, each one optimiser step of
    ``grad_accum`` micro-batches; stops the epochs early when ``approx_kl`` passes 1.5 x its target.
    ``actor=False`` (critic warm-up, and the extra passes of ``critic_updates``): only the critic's value
    loss and optimiser."""
    strategy = m.strategy
    coefs = coefficients(s)  # the controllers move after the update (phase 6)
    trained = list(m.optimizers.values()) if actor else [m.optimizers["critic"]]
    first = "loss/policy" if actor else "loss/value"  # a non-finite loss skips the step
    B, mbs, mask = len(rollout), cfg.minibatch_size // strategy.world, rollout.response_mask
    sums: dict[str, float] = {}
    n_steps = 0
    m.actor.train()
    if m.critic is not None:
        m.critic.train()
    for epoch in range(cfg.ppo_epochs):
        # rows, not groups, are shuffled: a group's comparison is already in its advantages (phase 4), and
        # every loss term is a function of its own row (GSPO's ratio too), so groups may split freely
        perm = torch.randperm(B, generator=s.shuffle_gen)
        epoch_kl, epoch_n = 0.0, 0
        for start in range(0, B, mbs):
            idx = perm[start : start + mbs]
            n_tokens = strategy.token_mean_divisor(mask[idx].sum())  # the minibatch's, over every rank
            if cfg.loss_aggregation == "token_sum_norm":  # Dr. GRPO's constant: rows x max_new_tokens
                n_tokens = strategy.token_mean_divisor(mask[idx].any(1).sum() * cfg.max_response_tokens)
            stats: dict[str, float] = {}
            if cfg.micro_batch_tokens is None:
                micros = idx.chunk(max(1, min(cfg.grad_accum, len(idx))))
            else:  # by a token budget: similar lengths together, then their shared padding trimmed
                micros = token_budget_split(idx, rollout, cfg.micro_batch_tokens, strategy)
            for j, micro in enumerate(micros):
                with strategy.accumulating(trained, sync=j == len(micros) - 1):
                    mb = rollout.select(micro)
                    if cfg.micro_batch_tokens is not None:
                        mb = trim_padding(mb)
                    st = {}
                    for name, loss, part_stats in minibatch_loss(
                        m, cfg, mb, n_tokens, len(micro) / len(idx), ptx, actor, **coefs
                    ):
                        strategy.backward([(m.optimizers[name], loss)])
                        st |= part_stats
                share = len(micro) / len(idx)  # token-budget micro-batches: their share of the tokens
                if cfg.micro_batch_tokens is not None:
                    share = float(mb.response_mask.sum() / mask[idx].sum().clamp(min=1))
                for k, v in st.items():  # loss/* are partial sums; the rest are micro-batch means
                    wk = 1.0 if k.startswith("loss/") else share
                    stats[k] = stats.get(k, 0.0) + float(v) * wk
            s.skipped.record(strategy.optimizer_step(trained, finite=math.isfinite(stats[first])))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            n_steps += 1
            epoch_kl, epoch_n = epoch_kl + stats.get("policy/approx_kl", 0.0), epoch_n + 1
        # stop the remaining epochs when the policy moved too far from the rollout policy (every rank alike)
        epoch_kl = strategy.mean_over_ranks({"kl": epoch_kl})["kl"]
        if cfg.target_approx_kl is not None and epoch_kl / epoch_n > 1.5 * cfg.target_approx_kl:
            sums["policy/early_stop_epoch"] = epoch + 1
            break
    out = {k: v / max(1, n_steps) for k, v in sums.items() if k != "policy/early_stop_epoch"}
    out["policy/early_stop_epoch"] = sums.get("policy/early_stop_epoch", 0)
    out = strategy.mean_over_ranks(out)
    return out | {"optim/lr": trained[0].scheduler.get_last_lr()[0], "optim/skipped_steps": s.skipped.total}


def token_budget_split(idx: torch.Tensor, rollout: Rollout, budget: int, strategy) -> list[torch.Tensor]:
    """The rows ``idx`` of a minibatch as micro-batches of at most ``budget`` tokens each, counting a
    micro-batch as rows x (longest prompt + longest response) among its rows, i.e. its size after
    :func:`trim_padding`. Rows go longest response first, greedily (a row over the budget alone is a
    micro-batch). Every rank gets as many micro-batches as the rank that needs the most (the largest are
    halved), since sharded and synced backward passes must match in number across ranks.

    The minibatch's loss is unchanged up to float rounding: the token-mean divisor is the minibatch's
    (``n_tokens``), seq_mean weighs each micro-batch by its share of rows, and causal attention with
    position ids from the mask makes a trimmed row's log-probs and values those of the padded row."""
    P = rollout.prompt_len
    resp = rollout.attention_mask[idx, P:].sum(1)  # (episodes: observation tokens too)
    prompt = rollout.attention_mask[idx, :P].sum(1)
    order = torch.argsort(resp, descending=True, stable=True)
    micros, cur, p_max, r_max = [], [], 0, 0
    for i in order.tolist():
        p, r = max(p_max, int(prompt[i])), max(r_max, int(resp[i]))
        if cur and (len(cur) + 1) * (p + r) > budget:
            micros.append(cur)
            cur, p, r = [], int(prompt[i]), int(resp[i])
        cur.append(i)
        p_max, r_max = p, r
    micros.append(cur)
    target = max(strategy.gather(len(micros)))
    while len(micros) < target:  # split the micro-batch with the most rows in two
        k = max(range(len(micros)), key=lambda j: len(micros[j]))
        half = len(micros[k]) // 2
        micros[k : k + 1] = [micros[k][:half], micros[k][half:]]
    return [idx[torch.tensor(mb, dtype=torch.long)] for mb in micros]


def trim_padding(mb: Rollout) -> Rollout:
    """``mb`` without the prompt columns every row left-pads and the response columns every row
    right-pads (``prompt_len`` adjusted): the same real tokens at the same positions, a shorter forward."""
    P, R = mb.prompt_len, mb.response_mask.shape[1]
    keep_p = max(1, int(mb.attention_mask[:, :P].sum(1).max()))
    keep_r = max(1, int(mb.attention_mask[:, P:].sum(1).max()))  # (episodes: observation tokens too)
    lo, hi = P - keep_p, P + keep_r
    per_token = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    out = {
        k: v[:, :keep_r]
        for k, v in per_token.items()
        if isinstance(v, torch.Tensor)
        and v.dim() in (2, 3)
        and v.shape[1] == R
        and k not in ("input_ids", "attention_mask")
    }
    return dataclasses.replace(
        mb,
        input_ids=mb.input_ids[:, lo:hi],
        attention_mask=mb.attention_mask[:, lo:hi],
        prompt_len=keep_p,
        **out,
    )


def coefficients(s: PPOState) -> dict[str, float | None]:
    """The loss coefficients :func:`minibatch_loss` takes, read off the controllers: ``kl_coef`` (the KL
    loss term's, kl.penalty=loss) and ``beta`` (algo=ppo_penalty's KL penalty; None for the others)."""
    return {"kl_coef": s.kl_ctl.value, "beta": s.penalty_ctl.value if s.penalty_ctl else None}


def minibatch_loss(
    m: PPOModels,
    cfg: PPOConfig,
    mb: Rollout,
    n_tokens,
    frac: float,
    ptx=None,
    actor=True,
    *,
    kl_coef: float,
    beta: float | None,
):
    """The loss of one micro-batch ``mb`` of the rollout, as ``(optimiser name, loss, stats)`` parts in the
    order they are back-propagated. A generator: a separate critic's forward runs only once the actor's part
    was back-propagated, so one model's activations are held at a time (the two graphs share nothing: the
    gradients are those of one backward through the sum).

    ``L = L_policy + c1 * L_value - c2 * H (+ beta * L_kl) (+ ptx_coef * L_ptx)``, scaled so that the
    micro-batches of a minibatch *sum* to its loss: token_mean (token_sum_norm) divides each term's sum over
    real tokens by ``n_tokens`` (the minibatch's token count, or rows x max_new_tokens, over every rank);
    seq_mean weighs the micro-batch's mean by its share ``frac`` of the rows. With a separate critic
    optimiser the critic's part ``c1 * L_value`` is its own loss; ``actor=False`` (critic warm-up) computes
    only that. ``L_kl`` (kl.penalty=loss) is the KL to the reference, weighed by ``kl_coef``; ``beta`` is
    ppo_penalty's coefficient (:func:`coefficients` reads both off the PPO state). Stats ``loss/*`` are
    such partial sums; the others are means over the micro-batch.
    """
    separate = "critic" in m.optimizers  # the critic's part goes to its own optimiser
    if actor:
        loss, stats = actor_loss(m, cfg, mb, n_tokens, frac, ptx, not separate, kl_coef, beta)
        yield "actor", loss, stats
    if separate:
        yield "critic", *critic_loss(m, cfg, mb, n_tokens, frac)


def _aggregation(cfg: PPOConfig, n_tokens, frac: float):
    """``(num, kw, w)`` of a micro-batch's loss terms: token_mean / token_sum_norm divide by ``num`` (the
    minibatch's divisor, passed as ``kw``) with weight 1; seq_mean has no ``num`` and weighs the
    micro-batch's mean by its share ``frac`` of the rows."""
    num = n_tokens if cfg.loss_aggregation != "seq_mean" else None
    return (num, {"num_tokens": num}, 1.0) if num is not None else (None, {}, frac)


def actor_loss(
    m: PPOModels,
    cfg: PPOConfig,
    mb: Rollout,
    n_tokens,
    frac: float,
    ptx,
    with_critic: bool,
    kl_coef: float,
    beta: float | None,
):
    """The actor's part of :func:`minibatch_loss` (with the value loss of a critic that shares its
    optimiser, ``with_critic``) -> ``(loss, stats)``."""
    mask, P = mb.response_mask, mb.prompt_len
    num, kw, w = _aggregation(cfg, n_tokens, frac)
    denom = num if num is not None else mask.sum().clamp(min=1)
    exact = mb.ref_log_softmax is not None  # kl.loss_estimator=full: the actor's whole distributions too
    with autocast(m.precision.update, m.strategy.device):
        log_probs, entropy, values, *log_softmax = policy_forward(
            m.actor,
            mb.input_ids,
            mb.attention_mask,
            P,
            cfg.generation.temperature,
            with_entropy=True,
            value_head=m.value_head,
            entropy_grad=bool(cfg.ent_coef),
            log_softmax=exact,
        )
        if m.critic is not None and with_critic:
            values = critic_forward(m.critic, mb.input_ids, mb.attention_mask, P)
    log_probs, entropy = log_probs.float(), entropy.float()
    pg_loss, st = core.POLICY_LOSSES[cfg.algo](
        log_probs,
        mb.old_log_probs,
        mb.advantages,
        mask,
        aggregation=cfg.loss_aggregation,
        **kw,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        beta=beta,
    )
    pg_loss = pg_loss * w
    stats = {"loss/policy": pg_loss.detach()} | {
        f"policy/{k}": st[k] for k in ("approx_kl", "clipfrac", "ratio_mean")
    }
    if cfg.kl.penalty == "loss":  # GRPO: beta * KL to the reference (k3) as its own term, not in the reward
        if exact:
            kl_part, kst = core.exact_kl_loss(
                log_softmax[0], mb.ref_log_softmax, mask, cfg.loss_aggregation, **kw
            )
        else:
            kl_part, kst = core.kl_loss(
                log_probs, mb.ref_log_probs, mask, cfg.loss_aggregation, estimator=cfg.kl.loss_estimator, **kw
            )
        pg_loss = pg_loss + kl_coef * kl_part * w
        stats["loss/kl"] = (kl_part * w).detach()
    value_part = None
    if values is not None and cfg.algo != "reinforce":
        value_part, vstats = value_loss(values, mb, cfg, kw, w)
        stats |= vstats
    ent = core.masked_sum(entropy, mask) / denom * w
    stats["loss/entropy"] = ent.detach()
    ptx_part = None
    if cfg.ptx_coef > 0 and ptx is not None:  # PPO-ptx: SFT NLL on a batch of demonstrations
        b = next(ptx)
        ptx_log_probs = sequence_log_probs(m.actor, b["input_ids"], b["attention_mask"])  # (B, T-1)
        nll = -core.masked_mean(ptx_log_probs, b["loss_mask"][:, 1:].bool())
        stats["loss/ptx"] = (nll * frac).detach()
        ptx_part = cfg.ptx_coef * (nll * frac)
    loss = pg_loss if value_part is None else pg_loss + value_part
    if cfg.ent_coef:  # 0 * H would still backpropagate through a (B, R, V) softmax
        loss = loss - cfg.ent_coef * ent
    if ptx_part is not None:
        loss = loss + ptx_part
    return loss, stats


def value_loss(values, mb: Rollout, cfg: PPOConfig, kw: dict, w: float):
    """``c1 * L_value`` of a micro-batch (aggregated and weighted as the policy loss) and its stats."""
    mask = mb.response_mask
    vf_loss, vst = core.ppo_value_loss(
        values.float(),
        mb.values,
        mb.returns,
        mask,
        clip=cfg.value_clip,
        aggregation=cfg.loss_aggregation,
        **kw,
    )
    vf_loss = vf_loss * w
    stats = {
        "loss/value": vf_loss.detach(),
        "value/clipfrac": vst["clipfrac"],
        "value/explained_var": core.explained_variance(mb.values, mb.returns, mask),
    }
    return cfg.vf_coef * vf_loss, stats


def critic_loss(m: PPOModels, cfg: PPOConfig, mb: Rollout, n_tokens, frac: float):
    """A separate critic's part of a micro-batch's loss (alone in the critic warm-up) -> ``(loss, stats)``."""
    _, kw, w = _aggregation(cfg, n_tokens, frac)
    with autocast(m.precision.update, m.strategy.device):
        values = critic_forward(m.critic, mb.input_ids, mb.attention_mask, mb.prompt_len)
    return value_loss(values, mb, cfg, kw, w)

"""Stage 3: PPO with four models — actor, critic, frozen reference, frozen reward model (or function).

One iteration (spec, stage 3): rollout -> score processing -> KL-shaped per-token rewards -> GAE ->
``ppo_epochs`` passes of shuffled minibatches -> KL controller. Every formula lives in ``shifu.core``;
this module only orders the calls. ``PPOTrainer.step`` is one iteration on a batch of prompts (used by
``train`` below and by ``benchmarks/ppo_iteration.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from shifu import core
from shifu import distributed as D
from shifu import lora as L
from shifu.models import fuse_tanh_gelu
from shifu.rewards import RewardSource
from shifu.rollout import SamplingParams, critic_forward, policy_forward, sample
from shifu.trainers.common import autocast, build_optimizer, build_scheduler, local_shard
from shifu.trainers.ppo_config import Config, derived_sizes

__all__ = ["Config", "PPOTrainer", "train"]


def new_value_head(hidden_size: int, seed: int) -> nn.Linear:
    """Scalar head N(0, 1/sqrt(d+1)), bias 0 — the spec's initialisation, for the shared-trunk critic."""
    head = nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / (hidden_size + 1) ** 0.5)
        head.bias.zero_()
    return head


class PPOTrainer:
    """Holds the four models, the optimisers and the controllers; ``step`` runs one PPO iteration.

    ``critic`` is a ScalarModel, or ``None`` with ``value_head`` set (shared trunk), or both ``None``
    for ``algo=reinforce``. ``ref`` is ``None`` for a LoRA actor (the reference is the actor with its
    adapters disabled).

    Under torchrun (``cfg.distributed``) the trainer wraps the plain models it is given: actor and critic
    with DDP / FSDP2 / DeepSpeed, frozen models replicated or sharded. Each rank holds ``batch_size / W``
    rollouts; losses use the global token count, whitening / score statistics / KL are global, and every
    rank takes the same decisions (non-finite skip, early stop, KL coefficient).
    """

    def __init__(
        self,
        actor,
        critic,
        ref,
        reward: RewardSource,
        tokenizer,
        cfg: Config,
        value_head: nn.Module | None = None,
        ptx_batches=None,
        device: torch.device | None = None,
    ):
        self.actor, self.critic, self.ref, self.reward = actor, critic, ref, reward
        self.value_head, self.tok, self.cfg, self.ptx_batches = value_head, tokenizer, cfg, ptx_batches
        self.device = device or torch.device("cpu")
        for frozen in (ref, getattr(reward, "model", None)):
            if isinstance(frozen, nn.Module):
                frozen.requires_grad_(False).eval()
        for m in (actor, critic, ref, getattr(reward, "model", None)):
            if isinstance(m, nn.Module):
                fuse_tanh_gelu(m)  # same function, one fused kernel
        dcfg = cfg.distributed
        self.strategy, self.world = dcfg.strategy, D.world_size()
        self.deepspeed = dcfg.strategy == "deepspeed"
        self.offload_frozen = dcfg.offload_frozen
        # the fast decoder reads weights directly: sharded weights (FSDP2, ZeRO-3) go through HF forwards
        self.gen_engine = "hf" if dcfg.strategy in ("fsdp2", "deepspeed") else "auto"
        if dcfg.gradient_checkpointing:
            for m in (actor, critic):
                if m is not None:
                    D.enable_gradient_checkpointing(m)
        if dcfg.strategy != "none":
            if not self.deepspeed:
                actor = D.wrap_trainable(actor, dcfg.strategy)
                critic = D.wrap_trainable(critic, dcfg.strategy) if critic is not None else None
            for frozen in (ref, getattr(reward, "model", None)):
                if isinstance(frozen, nn.Module):
                    D.prepare_frozen(frozen, dcfg.frozen)
                    if dcfg.offload_frozen:
                        frozen.to("cpu")
            self.actor, self.critic = actor, critic
        sizes = derived_sizes(cfg)
        total = sizes["total_optimizer_steps"]
        actor_params = list(actor.parameters()) + (
            list(value_head.parameters()) if value_head is not None else []
        )
        separate_critic = critic is not None and not cfg.joint_optimizer
        if critic is not None and not separate_critic:
            actor_params += list(critic.parameters())
        self.opt = build_optimizer(actor_params, cfg.optim)
        self.critic_opt = build_optimizer(critic.parameters(), cfg.critic.optim) if separate_critic else None
        self.sched = build_scheduler(self.opt, cfg.optim, total)
        self.critic_sched = (
            build_scheduler(self.critic_opt, cfg.critic.optim, total) if separate_critic else None
        )
        if self.deepspeed:
            # the engines own the ZeRO-partitioned optimisers; the schedules stay shifu's, on the torch
            # optimisers inside them (ZeRO keeps their param_group dicts, so the lr set there is used)
            ds = dcfg.deepspeed_config
            self.actor, self.opt = D.wrap_deepspeed(actor, cfg.optim, ds, optimizer=self.opt)
            if self.critic_opt is not None:
                self.critic, self.critic_opt = D.wrap_deepspeed(
                    critic, cfg.critic.optim, ds, optimizer=self.critic_opt
                )
        self.kl_ctl = core.build_kl_controller(
            cfg.kl.controller, cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon
        )
        self.penalty_ctl = (
            core.PenaltyKLController(cfg.penalty_init, cfg.penalty_target)
            if cfg.algo == "ppo_penalty"
            else None
        )
        self.score_moments = core.RunningMoments()
        self.sample_gen = torch.Generator().manual_seed(D.rank_seed(cfg.seed))  # own stream per rank
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.skipped_steps = 0  # optimiser steps skipped for non-finite loss/gradients
        self.nonfinite_in_a_row = 0  # consecutive skipped steps (the loop stops at cfg.max_nonfinite_steps)
        self.params = SamplingParams(
            cfg.generation.max_new_tokens,
            cfg.generation.temperature,
            cfg.generation.top_k,
            cfg.generation.top_p,
        )

    # ---------------------------------------------------------------- distributed helpers
    @property
    def actor_module(self) -> nn.Module:
        """The actor for no-grad forwards and generation: inside DDP/DeepSpeed wrappers (no gradient
        sync, no per-forward collectives); the FSDP2 model itself."""
        return D.unwrap(self.actor)

    def _gen_kwargs(self) -> dict[str, Any]:
        if self.world == 1:
            return {}
        # ranks keep stepping until every rank's responses ended: sharded forwards never deadlock
        return {"all_done": D.all_true, "engine": self.gen_engine}

    def _offloaded(self, model: nn.Module | None):
        if model is None or not self.offload_frozen:
            return contextlib.nullcontext(model)
        return D.offload_frozen(model, self.device)

    @contextlib.contextmanager
    def reference(self):
        """The reference model for a no-grad forward: the frozen copy (moved in from the CPU with
        ``offload_frozen``), or the LoRA actor with its adapters disabled."""
        if self.ref is None:
            with L.reference(self.actor_module, None) as ref:
                yield ref
            return
        with self._offloaded(self.ref) as ref:
            yield ref

    def _global_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean over the elements of ``x`` on every rank (``x.mean()`` in one process)."""
        if self.world == 1:
            return x.mean()
        s = D.all_reduce_sum(torch.stack([x.sum().double(), torch.tensor(x.numel(), dtype=torch.float64)]))
        return (s[0] / s[1]).to(x.dtype)

    def _global_whiten(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``core.masked_whiten`` with the mean and unbiased variance of the real elements of all ranks."""
        if self.world == 1:
            return core.masked_whiten(x, mask)
        m = mask.to(x.dtype)
        s = D.all_reduce_sum(torch.stack([(x * m).sum().double(), m.sum().double()]))
        n = s[1]
        if n < 2:
            raise ValueError("masked_whiten needs at least 2 real elements over all ranks")
        mean = (s[0] / n).to(x.dtype)
        ss = D.all_reduce_sum(((x - mean) * m).pow(2).sum().double())
        var = (ss / (n - 1)).to(x.dtype)
        out = (x - mean) * torch.rsqrt(var + 1e-8)
        return torch.where(mask.bool(), out, torch.zeros((), dtype=x.dtype, device=x.device))

    def reuses_decode_log_probs(self, bf16_autocast: bool) -> bool:
        """Whether the decode steps' log-probs stand in for a second actor forward: fp32 only, since bf16
        (autocast or bf16/fp16 weights) makes decode and full-sequence kernels round differently."""
        fp32 = not bf16_autocast and next(self.actor_module.parameters()).dtype == torch.float32
        return self.cfg.reuse_generation_log_probs and fp32

    # ---------------------------------------------------------------- rollout
    @torch.no_grad()
    def rollout(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[dict]
    ) -> dict[str, Any]:
        cfg, tok, T = self.cfg, self.tok, self.cfg.generation.temperature
        t0 = time.perf_counter()
        self.actor.eval()
        actor = self.actor_module
        # 1. sample responses (B,R), right-padded; everything after the first EOS is pad (mask False).
        # In fp32 the decode steps' own log-probs / entropies (and shared-trunk values) are the rollout's
        # old_log_probs: the same logits as a second forward up to float rounding, one forward pass fewer.
        reuse = self.reuses_decode_log_probs(cfg.bf16)
        with autocast(cfg.bf16, self.device):
            sampled = sample(
                actor,
                prompt_ids,
                prompt_mask,
                self.params,
                tok.eos_token_id,
                tok.pad_token_id,
                generator=self.sample_gen,
                with_log_probs=reuse,
                value_head=self.value_head if reuse else None,
                **self._gen_kwargs(),
            )
        response_ids, response_mask = sampled.response_ids, sampled.response_mask
        t_gen = time.perf_counter() - t0
        P = prompt_ids.shape[1]
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        # 2. old / reference log-probs (logits / T), values, entropy — batched no-grad forwards
        old_lp, entropy, old_values, ref_lp = [], [], [], []
        if reuse:
            old_lp, entropy = [sampled.log_probs], [sampled.entropy]
            if sampled.values is not None:
                old_values.append(sampled.values)
        mb = cfg.micro_batch_size
        with autocast(cfg.bf16, self.device):
            for i in range(0, input_ids.shape[0], mb):
                ids, am = input_ids[i : i + mb], attention_mask[i : i + mb]
                if not reuse:
                    lp, ent, v = policy_forward(
                        actor, ids, am, P, T, with_entropy=True, value_head=self.value_head
                    )
                    old_lp.append(lp.float()), entropy.append(ent.float())
                    if v is not None:
                        old_values.append(v.float())
                with self.reference() as ref:
                    ref_lp.append(policy_forward(ref, ids, am, P, T)[0].float())
                if self.critic is not None:
                    old_values.append(critic_forward(D.unwrap(self.critic), ids, am, P).float())
        old_log_probs, ref_log_probs, entropy = torch.cat(old_lp), torch.cat(ref_lp), torch.cat(entropy)
        values = torch.cat(old_values) if old_values else torch.zeros_like(old_log_probs)
        # 3. scores of prompt + response from the reward model(s) or function
        prompts = [r["prompt"] for r in rows]
        responses = [
            tok.decode(response_ids[i][response_mask[i]], skip_special_tokens=True) for i in range(len(rows))
        ]
        reward_model = self.reward.model if isinstance(self.reward.model, nn.Module) else None
        with self._offloaded(reward_model):
            scores = self.reward(prompts, responses, rows, input_ids, attention_mask).to(old_log_probs.device)
        last = (response_mask.long().cumsum(1) == response_mask.sum(1, keepdim=True)) & response_mask
        eos_found = (response_ids == tok.eos_token_id).logical_and(last).any(1)
        exp = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            prompt_len=P,
            old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs,
            values=values,
            entropy=entropy,
            scores=scores,
            eos_found=eos_found,
            prompts=prompts,
            responses=responses,
            rows=rows,
        )
        # a NaN/Inf score drops that sample (counted) instead of poisoning the batch
        finite = torch.isfinite(scores)
        exp["dropped_nonfinite"] = int((~finite).sum())
        if not finite.all():
            keep = finite.nonzero().squeeze(1)
            exp = {k: _select(v, keep) for k, v in exp.items()}
        exp["time/generation_s"] = t_gen
        exp["time/rollout_s"] = time.perf_counter() - t0
        return exp

    # ---------------------------------------------------------------- advantages
    def advantages(self, exp: dict[str, Any]) -> dict[str, float]:
        cfg, mask = self.cfg, exp["response_mask"]
        scores = exp["scores"].clone()
        # 2. score processing: missing-EOS penalty, running normalisation, clipping (each optional)
        if cfg.reward.missing_eos_penalty is not None:
            pen = cfg.reward.missing_eos_penalty
            penalised = (
                scores - pen if cfg.reward.missing_eos_mode == "subtract" else torch.full_like(scores, -pen)
            )
            scores = torch.where(exp["eos_found"], scores, penalised)
        raw_mean = self._global_mean(scores)
        if cfg.reward.normalize:
            # global statistics: every rank merges the same scores of all ranks
            self.score_moments.update(scores if self.world == 1 else torch.cat(D.gather_object(scores.cpu())))
            scores = (scores - self.score_moments.mean) / max(self.score_moments.std, 1e-8)
        if cfg.reward.clip is not None:
            scores = scores.clamp(-cfg.reward.clip, cfg.reward.clip)
        # 3. per-token KL to the reference and shaped rewards: -beta*kl per token, score on the last token
        beta = self.kl_ctl.value
        kl = core.kl_estimate(exp["old_log_probs"], exp["ref_log_probs"], cfg.kl.estimator) * mask
        kl1 = core.kl_estimate(exp["old_log_probs"], exp["ref_log_probs"], "k1") * mask
        kl_seq = core.masked_sum(kl1, mask, dim=1)  # (B,) nats per response
        if cfg.algo == "reinforce":
            # whole-sequence return R = score - beta * sum_t kl_t, the same for every token of the response
            ret = scores - beta * core.masked_sum(kl, mask, dim=1)
            adv = ret - self._global_mean(ret) if cfg.reinforce_baseline else ret
            exp["advantages"] = adv.unsqueeze(1) * mask
            exp["returns"] = exp["advantages"]
        else:
            rewards = core.shape_rewards(scores, kl, mask, beta)
            # 4. GAE backwards over real tokens, V after the last token = 0; whiten over real tokens
            advantages, returns = core.gae(rewards, exp["values"], mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                advantages = self._global_whiten(advantages, mask)
            exp["advantages"], exp["returns"] = advantages, returns
        if self.world > 1:  # means over all ranks' responses / tokens, in one collective
            n_tok = mask.sum()
            sums = D.reduce_metrics(
                {
                    "rows": float(mask.shape[0]),
                    "tokens": n_tok,
                    "score": scores.sum(),
                    "kl": kl_seq.sum(),
                    "kl_tok": (kl1 * mask).sum(),
                    "rlhf": (scores - beta * kl_seq).sum(),
                    "ent": (exp["entropy"] * mask).sum(),
                    "eos": exp["eos_found"].float().sum(),
                    "dropped": float(exp["dropped_nonfinite"]),
                },
                op="sum",
            )
            rows, toks = max(sums["rows"], 1.0), max(sums["tokens"], 1.0)
            return {
                "objective/score": float(raw_mean),
                "objective/score_processed": sums["score"] / rows,
                "objective/kl": sums["kl"] / rows,
                "objective/kl_per_token": sums["kl_tok"] / toks,
                "objective/kl_coef": beta,
                "objective/rlhf_reward": sums["rlhf"] / rows,
                "objective/entropy": sums["ent"] / toks,
                "rollout/response_len": sums["tokens"] / rows,
                "rollout/eos_frac": sums["eos"] / rows,
                "rollout/dropped_nonfinite": sums["dropped"],
                "rollout/rows": sums["rows"],
            }
        return {
            "objective/score": float(raw_mean),
            "objective/score_processed": float(scores.mean()),
            "objective/kl": float(kl_seq.mean()),
            "objective/kl_per_token": float(core.masked_mean(kl1, mask)),
            "objective/kl_coef": beta,
            "objective/rlhf_reward": float((scores - beta * kl_seq).mean()),
            "objective/entropy": float(core.masked_mean(exp["entropy"], mask)),
            "rollout/response_len": float(mask.sum(1).float().mean()),
            "rollout/eos_frac": float(exp["eos_found"].float().mean()),
            "rollout/dropped_nonfinite": exp["dropped_nonfinite"],
        }

    # ---------------------------------------------------------------- update
    def update(self, exp: dict[str, Any]) -> dict[str, float]:
        cfg = self.cfg
        # local rows and local minibatch (the config's sizes are global: W ranks share them)
        B, mbs, P = exp["input_ids"].shape[0], cfg.minibatch_size // self.world, exp["prompt_len"]
        mask = exp["response_mask"]
        sums: dict[str, float] = {}
        n_stat = 0
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        for _epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(B, generator=self.shuffle_gen)
            epoch_kl, epoch_n = 0.0, 0
            for start in range(0, B, mbs):
                idx = perm[start : start + mbs]
                if self.world == 1:
                    n_tokens = mask[idx].sum().clamp(min=1)
                else:  # N_global / W: DDP/FSDP2/ZeRO average gradients over ranks (shifu.distributed)
                    n_tokens = D.token_mean_divisor(mask[idx].sum())
                if not self.deepspeed:
                    self.opt.zero_grad(set_to_none=True)
                    if self.critic_opt is not None:
                        self.critic_opt.zero_grad(set_to_none=True)
                stats = {}
                micros = idx.chunk(max(1, min(cfg.grad_accum, len(idx))))
                for j, micro in enumerate(micros):
                    last = j == len(micros) - 1
                    loss, st = self._loss(exp, micro, P, n_tokens, len(micro) / len(idx))
                    if self.deepspeed:  # each engine back-propagates its own (disjoint) part
                        actor_part, critic_part = self._loss_parts
                        D.backward(self.actor, actor_part if self.critic_opt is not None else loss)
                        if self.critic_opt is not None and critic_part is not None:
                            D.backward(self.critic, critic_part)
                    elif last or self.world == 1:
                        loss.backward()
                    else:  # accumulate locally; the last micro-batch all-reduces
                        with D.grad_sync(self.actor, False), contextlib.ExitStack() as es:
                            if self.critic is not None:
                                es.enter_context(D.grad_sync(self.critic, False))
                            loss.backward()
                    for k, v in st.items():  # loss/* are partial sums; the rest are micro-batch means
                        wk = 1.0 if k.startswith("loss/") else len(micro) / len(idx)
                        stats[k] = stats.get(k, 0.0) + float(v) * wk
                self._optimizer_step()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_stat += 1
                epoch_kl, epoch_n = epoch_kl + stats["policy/approx_kl"], epoch_n + 1
            # 5. stop the remaining epochs when the policy moved too far from the rollout policy
            if self.world > 1 and cfg.target_approx_kl is not None:  # the same decision on every rank
                epoch_kl = D.reduce_metrics({"kl": epoch_kl})["kl"]
            if cfg.target_approx_kl is not None and epoch_kl / epoch_n > 1.5 * cfg.target_approx_kl:
                sums["policy/early_stop_epoch"] = _epoch + 1
                break
        out = {k: v / max(1, n_stat) for k, v in sums.items() if k != "policy/early_stop_epoch"}
        out["policy/early_stop_epoch"] = sums.get("policy/early_stop_epoch", 0)
        if self.world > 1:
            out = D.reduce_metrics(out)  # means over ranks, once per iteration
            B = B * self.world
        out["optim/lr"] = self.sched.get_last_lr()[0]
        out["optim/skipped_steps"] = self.skipped_steps
        if self.penalty_ctl is not None:
            self.penalty_ctl.update(out["policy/approx_kl"], B)
            out["policy/penalty_coef"] = self.penalty_ctl.value
        return out

    def _loss(self, exp, micro, P, n_tokens, frac) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch, scaled so that the micro-batches of a minibatch *sum* to its loss.

        token_mean: every term is (sum over the micro-batch's real tokens) / (real tokens of the minibatch);
        seq_mean: the micro-batch's mean weighted by its share ``frac`` of the minibatch rows.
        Stats keyed ``loss/...`` are such partial sums; the others are means over the micro-batch.
        """
        cfg = self.cfg
        ids, am, m = exp["input_ids"][micro], exp["attention_mask"][micro], exp["response_mask"][micro]
        adv, old_lp = exp["advantages"][micro], exp["old_log_probs"][micro]
        num = n_tokens if cfg.loss_aggregation == "token_mean" else None
        w = 1.0 if num is not None else frac
        denom = num if num is not None else m.sum().clamp(min=1)
        kw = {"num_tokens": num} if num is not None else {}
        with autocast(cfg.bf16, self.device):
            log_probs, entropy, values = policy_forward(
                self.actor,
                ids,
                am,
                P,
                cfg.generation.temperature,
                with_entropy=True,
                value_head=self.value_head,
                entropy_grad=bool(cfg.ent_coef),
            )
            if self.critic is not None:
                values = critic_forward(self.critic, ids, am, P)
        log_probs, entropy = log_probs.float(), entropy.float()
        if cfg.algo == "ppo":
            pg_loss, st = core.ppo_policy_loss(
                log_probs,
                old_lp,
                adv,
                m,
                cfg.clip_low,
                cfg.clip_high,
                cfg.dual_clip,
                cfg.loss_aggregation,
                **kw,
            )
            pg_loss = pg_loss * w
        else:
            if cfg.algo == "ppo_penalty":  # PPO paper sec. 4: maximise ratio*A - beta*KL(pi_old || pi)
                pg_loss, _ = core.ppo_penalty_loss(
                    log_probs, old_lp, adv, m, self.penalty_ctl.value, cfg.loss_aggregation, **kw
                )
                pg_loss = pg_loss * w
            else:  # REINFORCE: -A * log pi over the response, A the (baselined) sequence return
                pg_loss = -core.masked_sum(adv * log_probs, m) / denom * w
            log_ratio = log_probs.detach() - old_lp
            st = {
                "approx_kl": core.masked_mean(torch.expm1(log_ratio) - log_ratio, m),
                "clipfrac": torch.zeros(()),
                "ratio_mean": core.masked_mean(log_ratio.exp(), m),
            }
        stats = {
            "loss/policy": pg_loss.detach(),
            "policy/approx_kl": st["approx_kl"],
            "policy/clipfrac": st["clipfrac"],
            "policy/ratio_mean": st["ratio_mean"],
        }
        loss = pg_loss
        critic_part = None
        if values is not None and cfg.algo != "reinforce":
            old_values, returns = exp["values"][micro], exp["returns"][micro]
            vf_loss, vst = core.ppo_value_loss(
                values.float(),
                old_values,
                returns,
                m,
                clip=cfg.value_clip,
                aggregation=cfg.loss_aggregation,
                **kw,
            )
            vf_loss = vf_loss * w
            critic_part = cfg.vf_coef * vf_loss
            loss = loss + critic_part
            stats.update(
                {
                    "loss/value": vf_loss.detach(),
                    "value/clipfrac": vst["clipfrac"],
                    "value/explained_var": core.explained_variance(old_values, returns, m),
                }
            )
        ent = core.masked_sum(entropy, m) / denom * w
        if cfg.ent_coef:  # 0 * H would still backpropagate through a (B, R, V) softmax
            loss = loss - cfg.ent_coef * ent
        stats["loss/entropy"] = ent.detach()
        if cfg.ptx_coef > 0 and self.ptx_batches is not None:
            ptx = self._ptx_loss(next(self.ptx_batches)) * frac
            loss = loss + cfg.ptx_coef * ptx
            stats["loss/ptx"] = ptx.detach()
        if self.deepspeed:  # the actor engine's part (policy, entropy, ptx) and the critic engine's
            actor_part = pg_loss - cfg.ent_coef * ent  # (built apart: its graph must not reach the critic)
            if "loss/ptx" in stats:
                actor_part = actor_part + cfg.ptx_coef * ptx
            self._loss_parts = (actor_part, critic_part)
        return loss, stats

    def _ptx_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """PPO-ptx: SFT negative log-likelihood on response tokens of a batch of demonstrations."""
        ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        logits = self.actor(input_ids=ids, attention_mask=am).logits[:, :-1]
        lp = core.log_probs_from_logits(logits, ids[:, 1:])
        return -core.masked_mean(lp, lm[:, 1:].bool())

    def _optimizer_step(self) -> None:
        cfg = self.cfg
        if self.deepspeed:  # the engines clip (gradient_clipping from optim.max_grad_norm) and step
            D.optimizer_step(self.actor, self.opt, None)
            self.sched.step()
            if self.critic_opt is not None:
                D.optimizer_step(self.critic, self.critic_opt, None)
                self.critic_sched.step()
            self.nonfinite_in_a_row = 0
            return
        groups = [(self.opt, self.sched, cfg.optim.max_grad_norm)]
        if self.critic_opt is not None:
            groups.append((self.critic_opt, self.critic_sched, cfg.critic.optim.max_grad_norm))
        # one fused norm per optimiser decides both the clipping and whether the step is finite (no
        # per-parameter isfinite pass). In one process the gradients are rescaled only when the norm is
        # over the limit (clip_grad_norm_ multiplies every gradient by a coefficient clamped to 1 anyway);
        # sharded/replicated gradients keep clip_grad_norm_, which reduces the norm over ranks itself.
        norms = []
        for opt, _, max_norm in groups:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            limit = max_norm if max_norm is not None else float("inf")
            if self.world > 1:
                norms.append(torch.nn.utils.clip_grad_norm_(params, limit, foreach=True))
                continue
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            if float(norm) > limit:
                torch.nn.utils.clip_grads_with_norm_(params, limit, norm, foreach=True)
            norms.append(norm)
        finite = bool(torch.isfinite(torch.stack([local_shard(n).float() for n in norms])).all())
        if self.world > 1:  # skip on every rank, or the replicas / shards diverge
            finite = not D.any_true(not finite)
        if not finite:  # a NaN/Inf gradient skips this step (counted), never reaches the weights
            self.skipped_steps += 1
            self.nonfinite_in_a_row += 1
            for opt, sched, _ in groups:
                opt.zero_grad(set_to_none=True)
                sched.step()
            return
        for opt, sched, _ in groups:
            opt.step()
            sched.step()
        self.nonfinite_in_a_row = 0

    # ---------------------------------------------------------------- one iteration
    def step(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[dict]) -> dict[str, Any]:
        exp = self.rollout(prompt_ids.to(self.device), prompt_mask.to(self.device), rows)
        if exp["input_ids"].shape[0] == 0:  # every score was NaN/Inf: no update, controllers untouched
            nan = float("nan")
            return {
                "objective/score": nan,
                "objective/kl": nan,
                "objective/kl_coef": self.kl_ctl.value,
                "rollout/dropped_nonfinite": exp["dropped_nonfinite"],
                "optim/skipped_steps": self.skipped_steps,
                "time/rollout_s": exp["time/rollout_s"],
                "_exp": {k: exp[k] for k in ("prompts", "responses", "scores")},
            }
        t0 = time.perf_counter()
        metrics = self.advantages(exp)
        metrics.update(self.update(exp))
        # 6. the KL controller sees the measured KL in nats per response
        # (the global mean KL and the global number of responses: every rank's controller agrees)
        self.kl_ctl.update(metrics["objective/kl"], exp["input_ids"].shape[0] * self.world)
        t_update = time.perf_counter() - t0
        n_tokens = int(exp["response_mask"].sum())
        metrics.update(
            {
                "time/rollout_s": exp["time/rollout_s"],
                "time/generation_s": exp["time/generation_s"],
                "time/scoring_s": exp["time/rollout_s"] - exp["time/generation_s"],
                "time/update_s": t_update,
                "perf/tokens_per_s": n_tokens / max(1e-9, exp["time/rollout_s"] + t_update),
            }
        )
        metrics["_exp"] = {k: exp[k] for k in ("prompts", "responses", "scores")}
        return metrics

    def sharded(self) -> bool:
        """True when weights and optimiser states are saved per rank (FSDP2, DeepSpeed): see
        :meth:`save_shards`; the tensor state then holds only the schedules."""
        return D.is_sharded(self.actor)

    def trained_modules(self) -> dict[str, nn.Module]:
        """name -> (wrapped) trained model with its optimiser, for sharded checkpoints."""
        out = {"actor": (self.actor, self.opt)}
        if self.critic is not None:
            out["critic"] = (self.critic, self.critic_opt)
        return out

    def save_shards(self, path) -> None:
        """Every rank writes its shards of the trained models and optimisers under ``path`` (FSDP2: DCP;
        DeepSpeed: the engine's checkpoint). Call on all ranks."""
        from pathlib import Path

        for name, (model, opt) in self.trained_modules().items():
            if D._is_deepspeed(model):
                model.save_checkpoint(str(Path(path) / name), tag="shards")
            else:
                D.save_sharded(Path(path) / name, model, opt)

    def load_shards(self, path) -> None:
        from pathlib import Path

        for name, (model, opt) in self.trained_modules().items():
            if D._is_deepspeed(model):
                model.load_checkpoint(str(Path(path) / name), tag="shards")
            else:
                D.load_sharded(Path(path) / name, model, opt)

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensor_state, json_state) for a checkpoint: optimisers, schedulers, controllers, generators.

        Under FSDP2 / DeepSpeed the optimisers are in the shards (:meth:`save_shards`), not here. Call on
        every rank under torchrun (the per-rank sampling generators are gathered)."""
        sharded = self.sharded()
        tensors = {"sched": self.sched.state_dict()}
        if not sharded:
            tensors["opt"] = self.opt.state_dict()
        if self.critic_opt is not None:
            tensors["critic_sched"] = self.critic_sched.state_dict()
            if not sharded:
                tensors["critic_opt"] = self.critic_opt.state_dict()
        js = {
            "kl_ctl": self.kl_ctl.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "sample_gen": self.sample_gen.get_state().tolist(),
            **(
                {"sample_gen_ranks": D.gather_object(self.sample_gen.get_state().tolist())}
                if self.world > 1
                else {}
            ),
            "shuffle_gen": self.shuffle_gen.get_state().tolist(),
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        if self.penalty_ctl is not None:
            js["penalty_ctl"] = self.penalty_ctl.state_dict()
        return tensors, js

    def load_state_dict(self, tensors: dict[str, Any], js: dict[str, Any]) -> None:
        if "opt" in tensors:
            self.opt.load_state_dict(tensors["opt"])
        self.sched.load_state_dict(tensors["sched"])
        if self.critic_opt is not None:
            if "critic_opt" in tensors:
                self.critic_opt.load_state_dict(tensors["critic_opt"])
            self.critic_sched.load_state_dict(tensors["critic_sched"])
        self.kl_ctl.load_state_dict(js["kl_ctl"])
        self.score_moments.load_state_dict(js["score_moments"])
        gen_state = js["sample_gen_ranks"][D.rank()] if self.world > 1 else js["sample_gen"]
        self.sample_gen.set_state(torch.tensor(gen_state, dtype=torch.uint8))
        self.shuffle_gen.set_state(torch.tensor(js["shuffle_gen"], dtype=torch.uint8))
        self.skipped_steps = js["skipped_steps"]
        self.nonfinite_in_a_row = js.get("nonfinite_in_a_row", 0)
        if self.penalty_ctl is not None:
            self.penalty_ctl.load_state_dict(js["penalty_ctl"])


def _select(v: Any, keep: torch.Tensor) -> Any:
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        return v[keep]
    if isinstance(v, list):
        return [v[i] for i in keep.tolist()]
    return v


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict:
    from shifu.trainers.ppo_loop import run

    return run(cfg, resume=resume, overwrite=overwrite)

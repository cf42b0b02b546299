"""Stage 3: PPO with four models — actor, critic, frozen reference, frozen reward model (or function).

One iteration (spec, stage 3): rollout -> score processing -> KL-shaped per-token rewards -> GAE ->
``ppo_epochs`` passes of shuffled minibatches -> KL controller. Every formula lives in ``shifu.core``;
this module only orders the calls. ``PPOTrainer.step`` is one iteration on a batch of prompts (used by
``train`` below and by ``benchmarks/ppo_iteration.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from shifu import core
from shifu.rewards import RewardSource
from shifu.rollout import SamplingParams, critic_forward, generate, policy_forward
from shifu.trainers.common import autocast, build_optimizer, build_scheduler
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
    for ``algo=reinforce``.
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
        sizes = derived_sizes(cfg)
        total = sizes["total_optimizer_steps"]
        actor_params = list(actor.parameters()) + (
            list(value_head.parameters()) if value_head is not None else []
        )
        separate_critic = critic is not None and not cfg.joint_optimizer
        if critic is not None and not separate_critic:
            actor_params += list(critic.parameters())
        self.opt = build_optimizer(actor_params, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim, total)
        self.critic_opt = build_optimizer(critic.parameters(), cfg.critic.optim) if separate_critic else None
        self.critic_sched = (
            build_scheduler(self.critic_opt, cfg.critic.optim, total) if separate_critic else None
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
        self.sample_gen = torch.Generator().manual_seed(cfg.seed)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.skipped_steps = 0  # optimiser steps skipped for non-finite loss/gradients
        self.nonfinite_in_a_row = 0  # consecutive skipped steps (the loop stops at cfg.max_nonfinite_steps)
        self.params = SamplingParams(
            cfg.generation.max_new_tokens,
            cfg.generation.temperature,
            cfg.generation.top_k,
            cfg.generation.top_p,
        )

    # ---------------------------------------------------------------- rollout
    @torch.no_grad()
    def rollout(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[dict]
    ) -> dict[str, Any]:
        cfg, tok, T = self.cfg, self.tok, self.cfg.generation.temperature
        t0 = time.perf_counter()
        self.actor.eval()
        # 1. sample responses (B,R), right-padded; everything after the first EOS is pad (mask False)
        with autocast(cfg.bf16, self.device):
            response_ids, response_mask = generate(
                self.actor,
                prompt_ids,
                prompt_mask,
                self.params,
                tok.eos_token_id,
                tok.pad_token_id,
                generator=self.sample_gen,
            )
        t_gen = time.perf_counter() - t0
        P = prompt_ids.shape[1]
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        # 2. old / reference log-probs (logits / T), values, entropy — batched no-grad forwards
        old_lp, entropy, old_values, ref_lp = [], [], [], []
        mb = cfg.micro_batch_size
        with autocast(cfg.bf16, self.device):
            for i in range(0, input_ids.shape[0], mb):
                ids, am = input_ids[i : i + mb], attention_mask[i : i + mb]
                lp, ent, v = policy_forward(
                    self.actor, ids, am, P, T, with_entropy=True, value_head=self.value_head
                )
                old_lp.append(lp.float()), entropy.append(ent.float())
                ref_lp.append(policy_forward(self.ref, ids, am, P, T)[0].float())
                if self.critic is not None:
                    v = critic_forward(self.critic, ids, am, P)
                if v is not None:
                    old_values.append(v.float())
        old_log_probs, ref_log_probs, entropy = torch.cat(old_lp), torch.cat(ref_lp), torch.cat(entropy)
        values = torch.cat(old_values) if old_values else torch.zeros_like(old_log_probs)
        # 3. scores of prompt + response from the reward model(s) or function
        prompts = [r["prompt"] for r in rows]
        responses = [
            tok.decode(response_ids[i][response_mask[i]], skip_special_tokens=True) for i in range(len(rows))
        ]
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
        raw_mean = scores.mean()
        if cfg.reward.normalize:
            self.score_moments.update(scores)
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
            adv = ret - ret.mean() if cfg.reinforce_baseline else ret
            exp["advantages"] = adv.unsqueeze(1) * mask
            exp["returns"] = exp["advantages"]
        else:
            rewards = core.shape_rewards(scores, kl, mask, beta)
            # 4. GAE backwards over real tokens, V after the last token = 0; whiten over real tokens
            advantages, returns = core.gae(rewards, exp["values"], mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                advantages = core.masked_whiten(advantages, mask)
            exp["advantages"], exp["returns"] = advantages, returns
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
        B, mbs, P = exp["input_ids"].shape[0], cfg.minibatch_size, exp["prompt_len"]
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
                n_tokens = mask[idx].sum().clamp(min=1)
                self.opt.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                stats = {}
                for micro in idx.chunk(max(1, min(cfg.grad_accum, len(idx)))):
                    loss, st = self._loss(exp, micro, P, n_tokens, len(micro) / len(idx))
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
            if cfg.target_approx_kl is not None and epoch_kl / epoch_n > 1.5 * cfg.target_approx_kl:
                sums["policy/early_stop_epoch"] = _epoch + 1
                break
        out = {k: v / max(1, n_stat) for k, v in sums.items() if k != "policy/early_stop_epoch"}
        out["policy/early_stop_epoch"] = sums.get("policy/early_stop_epoch", 0)
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
            loss = loss + cfg.vf_coef * vf_loss
            stats.update(
                {
                    "loss/value": vf_loss.detach(),
                    "value/clipfrac": vst["clipfrac"],
                    "value/explained_var": core.explained_variance(old_values, returns, m),
                }
            )
        ent = core.masked_sum(entropy, m) / denom * w
        loss = loss - cfg.ent_coef * ent
        stats["loss/entropy"] = ent.detach()
        if cfg.ptx_coef > 0 and self.ptx_batches is not None:
            ptx = self._ptx_loss(next(self.ptx_batches)) * frac
            loss = loss + cfg.ptx_coef * ptx
            stats["loss/ptx"] = ptx.detach()
        return loss, stats

    def _ptx_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """PPO-ptx: SFT negative log-likelihood on response tokens of a batch of demonstrations."""
        ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        logits = self.actor(input_ids=ids, attention_mask=am).logits[:, :-1]
        lp = core.log_probs_from_logits(logits, ids[:, 1:])
        return -core.masked_mean(lp, lm[:, 1:].bool())

    def _optimizer_step(self) -> None:
        cfg = self.cfg
        groups = [(self.opt, self.sched, cfg.optim.max_grad_norm)]
        if self.critic_opt is not None:
            groups.append((self.critic_opt, self.critic_sched, cfg.critic.optim.max_grad_norm))
        params = [
            p for opt, _, _ in groups for g in opt.param_groups for p in g["params"] if p.grad is not None
        ]
        finite = all(torch.isfinite(p.grad).all() for p in params)
        if not finite:  # a NaN/Inf gradient skips this step (counted), never reaches the weights
            self.skipped_steps += 1
            self.nonfinite_in_a_row += 1
            for opt, sched, _ in groups:
                opt.zero_grad(set_to_none=True)
                sched.step()
            return
        for opt, sched, max_norm in groups:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], max_norm)
            opt.step()
            sched.step()
        self.nonfinite_in_a_row = 0

    # ---------------------------------------------------------------- one iteration
    def step(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list[dict]) -> dict[str, Any]:
        exp = self.rollout(prompt_ids.to(self.device), prompt_mask.to(self.device), rows)
        t0 = time.perf_counter()
        metrics = self.advantages(exp)
        metrics.update(self.update(exp))
        # 6. the KL controller sees the measured KL in nats per response
        self.kl_ctl.update(metrics["objective/kl"], exp["input_ids"].shape[0])
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

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensor_state, json_state) for a checkpoint: optimisers, schedulers, controllers, generators."""
        tensors = {"opt": self.opt.state_dict(), "sched": self.sched.state_dict()}
        if self.critic_opt is not None:
            tensors.update(
                critic_opt=self.critic_opt.state_dict(), critic_sched=self.critic_sched.state_dict()
            )
        js = {
            "kl_ctl": self.kl_ctl.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "sample_gen": self.sample_gen.get_state().tolist(),
            "shuffle_gen": self.shuffle_gen.get_state().tolist(),
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        if self.penalty_ctl is not None:
            js["penalty_ctl"] = self.penalty_ctl.state_dict()
        return tensors, js

    def load_state_dict(self, tensors: dict[str, Any], js: dict[str, Any]) -> None:
        self.opt.load_state_dict(tensors["opt"])
        self.sched.load_state_dict(tensors["sched"])
        if self.critic_opt is not None:
            self.critic_opt.load_state_dict(tensors["critic_opt"])
            self.critic_sched.load_state_dict(tensors["critic_sched"])
        self.kl_ctl.load_state_dict(js["kl_ctl"])
        self.score_moments.load_state_dict(js["score_moments"])
        self.sample_gen.set_state(torch.tensor(js["sample_gen"], dtype=torch.uint8))
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

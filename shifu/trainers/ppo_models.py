"""The four models of ``shifu ppo`` and the state a checkpoint keeps besides their weights.

:func:`build` loads the actor, the frozen reference, the reward (a model or a function) and the critic
(:func:`shifu.trainers.ppo_load.load`), places them with the strategy and builds the optimisers
(:func:`place`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any

import torch
from torch import nn

from shifu import core
from shifu.config.schema import PPOConfig
from shifu.generation.rollout import check_exact_kl_memory
from shifu.models import lora as L
from shifu.models.loading import fuse_tanh_gelu
from shifu.parallel import precision as bf16
from shifu.parallel.strategy import Strategy, Trained, decay_groups
from shifu.rollout.sources import Policy, RolloutSource
from shifu.trainers.common import SkippedSteps
from shifu.trainers.ppo_load import load


@dataclasses.dataclass
class PPOModels:
    """The actor (trained), the critic (trained: a ScalarModel, or ``value_head`` on the actor's trunk, or
    neither for REINFORCE and the critic-free estimators), the frozen reference (``None`` with LoRA: the actor
    with its adapters disabled), the rollout source and the frozen reward model it reads, each as the strategy
    placed it; ``optimizers`` "actor" (with the value head, and
    the critic under ``joint_optimizer``) and "critic"; ``plain`` the modules a checkpoint saves."""

    actor: nn.Module
    critic: nn.Module | None
    value_head: nn.Module | None
    ref: nn.Module | None
    source: RolloutSource  # what makes the rollouts (and scores them): shifu.rollout
    reward_model: nn.Module | None  # the frozen reward model the source reads, if any
    tokenizer: Any
    strategy: Strategy
    optimizers: dict[str, Trained]
    plain: dict[str, nn.Module]
    # config keys that could not run as written -> the value that ran (config.yaml records it; ppo_load.load)
    used: dict[str, Any] = dataclasses.field(default_factory=dict)
    precision: bf16.Precision = bf16.FP32  # phases run in bf16 (bf16=true: measured, parallel.precision)
    decode_copy: nn.Module | None = None  # the actor's bf16 copy that generation reads (precision.decode)

    @property
    def actor_module(self) -> nn.Module:
        """The actor for no-grad forwards and generation (inside any wrapper: no gradient sync)."""
        return self.strategy.unwrap(self.actor)

    @contextlib.contextmanager
    def reference(self):
        """The reference for a no-grad forward: the frozen copy, or the LoRA actor with adapters disabled."""
        if self.ref is None:
            with L.reference(self.actor_module, None) as ref:
                yield ref
            return
        with self.strategy.offloaded(self.ref) as ref:
            yield ref

    def reuses_decode_log_probs(self, cfg: PPOConfig, bf16_autocast: bool) -> bool:
        """Whether the decode steps' log-probs stand in for a second actor forward: fp32 only, since bf16
        (autocast, a bf16 decode copy, bf16/fp16 weights) makes decode and full-sequence kernels round
        differently."""
        fp32 = not bf16_autocast and next(self.actor_module.parameters()).dtype == torch.float32
        return cfg.reuse_generation_log_probs and fp32

    def policy(
        self, model: nn.Module, with_log_probs: bool = False, value_head: nn.Module | None = None
    ) -> Policy:
        """``model`` as a rollout source samples from it, in step with the other ranks under torchrun."""
        s = self.strategy
        kwargs = s.generation_kwargs()
        return Policy(model, self.tokenizer, with_log_probs, value_head, kwargs, s.largest, whole=s.whole)

    def decoder(self) -> nn.Module:
        """The model generation reads: the actor, or its bf16 copy refreshed from the actor's current
        weights (called once per rollout, so the copy is never older than the last update)."""
        if self.decode_copy is None:
            return self.actor_module
        bf16.refresh(self.decode_copy, self.actor_module)
        return self.decode_copy


@dataclasses.dataclass
class PPOState:
    """What a checkpoint keeps besides weights and optimisers: beta's controller (and the penalty
    variant's), the running score statistics, this rank's sampling generator and the shuffling generator,
    the skipped-step counts."""

    kl_ctl: Any
    penalty_ctl: Any
    score_moments: core.RunningMoments
    sample_gen: torch.Generator
    shuffle_gen: torch.Generator
    skipped: SkippedSteps

    @classmethod
    def new(cls, cfg: PPOConfig, strategy: Strategy) -> PPOState:
        kl = cfg.kl
        return cls(
            kl_ctl=core.build_kl_controller(kl.controller, kl.init_coef, kl.target, kl.horizon),
            penalty_ctl=(
                core.PenaltyKLController(cfg.penalty_init, cfg.penalty_target)
                if cfg.algo == "ppo_penalty"
                else None
            ),
            score_moments=core.RunningMoments(),
            sample_gen=torch.Generator().manual_seed(strategy.rank_seed(cfg.seed)),  # own stream per rank
            shuffle_gen=torch.Generator().manual_seed(cfg.seed + 1),
            skipped=SkippedSteps(cfg.max_nonfinite_steps),
        )

    def state_dict(self, strategy: Strategy) -> dict[str, Any]:
        """JSON state (call on every rank: the per-rank sampling generators are gathered)."""
        return {
            "kl_ctl": self.kl_ctl.state_dict(),
            "penalty_ctl": self.penalty_ctl.state_dict() if self.penalty_ctl else None,
            "score_moments": self.score_moments.state_dict(),
            "sample_gen_ranks": strategy.gather(self.sample_gen.get_state().tolist()),
            "shuffle_gen": self.shuffle_gen.get_state().tolist(),
            "skipped": self.skipped.state(),
        }

    def load_state_dict(self, js: dict[str, Any], strategy: Strategy) -> None:
        self.kl_ctl.load_state_dict(js["kl_ctl"])
        if self.penalty_ctl is not None:
            self.penalty_ctl.load_state_dict(js["penalty_ctl"])
        self.score_moments.load_state_dict(js["score_moments"])
        self.sample_gen.set_state(torch.tensor(js["sample_gen_ranks"][strategy.rank], dtype=torch.uint8))
        self.shuffle_gen.set_state(torch.tensor(js["shuffle_gen"], dtype=torch.uint8))
        self.skipped.total, self.skipped.in_a_row = js["skipped"]


def place(
    actor,
    critic,
    value_head,
    ref,
    source: RolloutSource,
    reward_model,
    tok,
    cfg: PPOConfig,
    strategy: Strategy,
) -> PPOModels:
    """The models placed by the strategy (trained ones wrapped, frozen ones frozen) and their optimisers."""
    plain = {"actor": actor} | ({"critic": critic} if critic is not None else {})
    plain |= {"value_head": value_head} if value_head is not None else {}
    for m in (actor, critic, ref, reward_model):
        if m is not None:
            fuse_tanh_gelu(m)  # same function, one fused kernel
    ref = strategy.frozen(ref) if ref is not None else None
    if reward_model is not None:
        strategy.frozen(reward_model)
    actor = strategy.wrap(actor)
    critic = strategy.wrap(critic) if critic is not None else None
    steps = cfg.batch_size // cfg.minibatch_size * cfg.ppo_epochs  # optimiser steps per iteration
    total = steps * cfg.iterations  # (the actor sits out the critic warm-up)
    params = list(actor.parameters()) + (list(value_head.parameters()) if value_head is not None else [])
    separate_critic = critic is not None and not cfg.joint_optimizer
    if critic is not None and not separate_critic:
        params += list(critic.parameters())
    # (the gradient norm is summed in the optimiser's group order: matrices, then vectors)
    optimizers = {
        "actor": strategy.optimize(
            actor, _grouped(params), cfg.optim, max(1, total - steps * cfg.critic_warmup)
        )
    }
    if separate_critic:
        optimizers["critic"] = strategy.optimize(
            critic, _grouped(critic.parameters()), cfg.critic.optim, total
        )
    actor = optimizers["actor"].model  # a DeepSpeed engine, else the wrapped model
    critic = optimizers["critic"].model if separate_critic else critic
    m = PPOModels(actor, critic, value_head, ref, source, reward_model, tok, strategy, optimizers, plain)
    return with_precision(m, cfg, reward_model) if cfg.bf16 else m


def with_precision(m: PPOModels, cfg: PPOConfig, reward_model: nn.Module | None) -> PPOModels:
    """``bf16=true``: what the GEMM probe at the models' own shapes measured faster (:mod:`shifu.parallel.precision`),
    said on stderr: bf16 copies of the frozen reference and reward model (cast once), a bf16 decode copy of
    the actor, bf16 autocast in the update (master weights and optimiser state fp32)."""
    actor, strategy, g, rows = m.actor_module, m.strategy, cfg.generation, cfg.batch_size // m.strategy.world
    work = bf16.Workload(
        *bf16.linear_shapes(actor),
        rows,
        min(cfg.micro_batch_size, rows),
        cfg.minibatch_size // strategy.world // cfg.grad_accum,
        cfg.data.max_prompt_len + g.max_new_tokens,
        g.max_new_tokens,
    )
    probe, reuse = bf16.Probe(strategy.device), m.reuses_decode_log_probs(cfg, False) and cfg.tis_cap is None
    plain = not strategy.sharded and not L.is_lora(actor)  # a whole, plain actor can have a bf16 copy
    scorer = (
        None
        if reward_model is None
        else dataclasses.replace(  # the reward model at its own shapes
            work, trunk=bf16.linear_shapes(reward_model)[0], head=None
        )
    )
    precision = strategy.on_main(lambda: bf16.choose(work, probe, reuse, plain, scorer))  # rank 0's, for all
    probe.save()
    for chosen, frozen in ((precision.frozen, m.ref), (precision.reward, reward_model)):
        if chosen and frozen is not None and cfg.distributed.frozen == "replicate":
            bf16.cast_parameters(frozen)
    if strategy.is_main:
        print(f"shifu ppo: {precision.reason}", file=sys.stderr, flush=True)
    decode_copy = bf16.bf16_copy(actor) if precision.decode else None
    return dataclasses.replace(m, precision=precision, decode_copy=decode_copy)


def _grouped(params) -> list:
    decay, no_decay = decay_groups([p for p in params if p.requires_grad])
    return decay + no_decay


def build(cfg: PPOConfig, tok, strategy: Strategy) -> PPOModels:
    """The four models (and the rollout source) from ``cfg``, placed, with their optimisers (``used``: see
    :func:`shifu.trainers.ppo_load.load`)."""
    *models, used = load(cfg, tok, strategy)
    m = dataclasses.replace(place(*models, tok, cfg, strategy), used=used)
    check_exact_kl_memory(cfg, m.actor_module, strategy)  # the rollout's (B, R, V) reference log-probs fit
    return m

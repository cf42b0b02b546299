"""Configuration of ``shifu ppo``: every key, its default and its meaning (``shifu ppo --help-config``).

KL targets are in **nats per response** (the unit of ``objective/kl``), never per token.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from shifu.config import opt
from shifu.distributed import DistributedConfig, planned_world_size
from shifu.errors import ConfigError
from shifu.lora import LoraConfig
from shifu.trainers.common import OptimConfig, require_positive


@dataclasses.dataclass
class DataConfig:
    prompts: str = opt(
        "",
        "training prompts: JSONL/Parquet/datasets dir with a `prompt` field (other fields reach reward functions)",
    )
    eval_prompts: str | None = opt(
        None, "held-out prompts for evaluation (default: a held-out fraction of `prompts`)"
    )
    eval_fraction: float = opt(
        0.05, "fraction of `prompts` held out for evaluation when eval_prompts is not given"
    )
    max_prompt_len: int = opt(128, "prompt tokens kept (longer prompts: see prompt_policy)")
    prompt_policy: Literal["truncate_left", "drop"] = opt(
        "truncate_left", "what to do with prompts over max_prompt_len"
    )
    skip_bad: bool = opt(
        False, "skip malformed rows (counted and reported) instead of stopping with an error"
    )
    ptx: str | None = opt(None, "SFT data (prompt/response) for the PPO-ptx term; needs ptx_coef > 0")


@dataclasses.dataclass
class GenerationConfig:
    max_new_tokens: int = opt(48, "maximum response length R in tokens")
    temperature: float = opt(1.0, "sampling temperature T (log-probs use logits/T too)")
    top_k: int = opt(0, "top-k sampling; 0 disables")
    top_p: float = opt(1.0, "nucleus sampling; 1.0 disables")


@dataclasses.dataclass
class RewardConfig:
    model_path: str | None = opt(None, "reward model directory (shifu rm output, or an ensemble directory)")
    function: str | None = opt(None, "rule-based reward 'package.module:function' (instead of model_path)")
    normalize: bool = opt(False, "running mean/std normalisation of scores")
    clip: float | None = opt(None, "clip (normalised) scores to [-clip, clip]; null disables")
    missing_eos_penalty: float | None = opt(None, "penalty for responses without EOS; null disables")
    missing_eos_mode: Literal["subtract", "replace"] = opt(
        "subtract", "subtract the penalty, or replace the score with -penalty"
    )


@dataclasses.dataclass
class CriticConfig:
    init: Literal["reward", "sft", "shared"] = opt(
        "reward", "critic from the reward model, from the SFT model, or a value head on the actor's trunk"
    )
    path: str | None = opt(None, "override the critic's starting directory")
    optim: OptimConfig = opt(OptimConfig(lr=1e-4), "critic optimiser (separate optimisers)")


@dataclasses.dataclass
class KLConfig:
    controller: Literal["fixed", "adaptive", "step", "penalty"] = opt(
        "adaptive", "how beta follows the KL to the reference"
    )
    init_coef: float = opt(0.05, "initial beta")
    target: float | None = opt(6.0, "KL target in nats per response (adaptive/step/penalty)")
    horizon: int = opt(10000, "adaptive controller horizon in samples (Ziegler et al. 2019)")
    estimator: Literal["k1", "k2", "k3"] = opt("k1", "per-token KL estimator for the reward penalty")


@dataclasses.dataclass
class EvalConfig:
    every: int = opt(5, "evaluate on held-out prompts every N iterations (0: only at the end)")
    num_prompts: int = opt(64, "held-out prompts per evaluation")
    temperature: float = opt(0.7, "sampling temperature of evaluation samples (low: near the mode)")
    gold_function: str | None = opt(None, "gold judge 'package.module:function' (logged as gold/score)")
    best_metric: str = opt("eval/score", "metric that picks best/ (higher is better), e.g. gold/score")


@dataclasses.dataclass
class GuardConfig:
    kl_ceiling: float | None = opt(
        None, "stop and restore best/ when objective/kl exceeds this many nats per response"
    )
    divergence_patience: int = opt(
        0, "stop and restore best/ after N evaluations where gold falls while the score rises (0: off)"
    )


@dataclasses.dataclass
class Config:
    out_dir: str = opt("", "run directory (checkpoints, metrics, final/, best/)")
    seed: int = opt(0, "random seed (sampling, shuffling, heads)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "where to run")
    actor_path: str = opt("", "SFT model directory: the actor starts here")
    ref_path: str | None = opt(None, "reference model directory (default: actor_path)")
    trust_remote_code: bool = opt(False, "allow model code from the model directory (off: safe)")
    algo: Literal["ppo", "ppo_penalty", "reinforce"] = opt(
        "ppo", "ppo (clip), ppo_penalty (PPO paper), reinforce"
    )
    iterations: int = opt(20, "rollout + update iterations")
    batch_size: int = opt(32, "prompts (= responses) per rollout, over all processes (global)")
    minibatch_size: int = opt(8, "responses per optimiser step, over all processes (global)")
    grad_accum: int = opt(1, "micro-batches a minibatch is split into (same update, less memory)")
    micro_batch_size: int = opt(32, "rows per no-grad scoring forward in the rollout")
    ppo_epochs: int = opt(4, "passes over each rollout")
    clip_low: float = opt(0.2, "PPO clip: ratio >= 1 - clip_low")
    clip_high: float = opt(0.2, "PPO clip: ratio <= 1 + clip_high")
    dual_clip: float | None = opt(None, "dual-clip bound c > 1 for negative advantages; null disables")
    value_clip: float | None = opt(0.2, "value clipping around old values; null disables")
    vf_coef: float = opt(0.1, "c1: weight of the value loss")
    ent_coef: float = opt(0.0, "c2: weight of the entropy bonus")
    ptx_coef: float = opt(0.0, "weight of the SFT NLL term (PPO-ptx); needs data.ptx")
    gamma: float = opt(1.0, "GAE discount")
    lam: float = opt(0.95, "GAE lambda")
    whiten_advantages: bool = opt(True, "whiten advantages over the real tokens of the rollout")
    loss_aggregation: Literal["token_mean", "seq_mean"] = opt(
        "token_mean", "token-mean or sequence-mean losses"
    )
    target_approx_kl: float | None = opt(
        None, "stop the epochs early when approx_kl > 1.5 x this; null disables"
    )
    joint_optimizer: bool = opt(False, "one optimiser over actor and critic (always for critic.init=shared)")
    reinforce_baseline: bool = opt(True, "reinforce: subtract the batch mean return")
    penalty_init: float = opt(1.0, "ppo_penalty: initial beta of KL(pi_old || pi)")
    penalty_target: float = opt(0.01, "ppo_penalty: target per-token KL(pi_old || pi) (PPO paper d_targ)")
    bf16: bool = opt(False, "bf16 autocast for forwards (CPU where supported; native speed on GPU)")
    reuse_generation_log_probs: bool = opt(
        True,
        "fp32: take old log-probs, entropy and shared-trunk values from the decode steps instead of a "
        "second forward pass (equal up to float rounding); bf16 autocast or half-precision weights always "
        "recompute",
    )
    max_nonfinite_steps: int = opt(
        8, "stop after this many consecutive optimiser steps with a NaN/Inf loss or gradient (each skipped)"
    )
    save_every: int = opt(10, "checkpoint every N iterations (0: only at the end)")
    keep_last: int = opt(2, "checkpoints kept")
    generation: GenerationConfig = opt(GenerationConfig(), "sampling of rollouts")
    data: DataConfig = opt(DataConfig(), "prompt data")
    reward: RewardConfig = opt(RewardConfig(), "reward model or function, score processing")
    critic: CriticConfig = opt(CriticConfig(), "critic initialisation and optimiser")
    kl: KLConfig = opt(KLConfig(), "KL penalty to the reference and its controller")
    optim: OptimConfig = opt(OptimConfig(lr=1e-5), "actor optimiser")
    eval: EvalConfig = opt(EvalConfig(), "held-out evaluation and best checkpoint")
    guard: GuardConfig = opt(GuardConfig(), "reward-hacking guard")
    distributed: DistributedConfig = opt(
        DistributedConfig(), "multi-process training under torchrun (batch_size stays the global batch)"
    )
    lora: LoraConfig = opt(LoraConfig(), "LoRA actor; the reference is then the actor with adapters disabled")

    def validate(self) -> None:
        if not self.out_dir:
            raise ConfigError("out_dir is required (or pass --out DIR)")
        if not self.actor_path:
            raise ConfigError("actor_path is required: the SFT model directory")
        if not self.data.prompts:
            raise ConfigError("data.prompts is required: a JSONL file with a `prompt` field")
        if (self.reward.model_path is None) == (self.reward.function is None):
            raise ConfigError("give exactly one of reward.model_path and reward.function")
        if self.critic.init == "reward" and self.reward.model_path is None and self.algo != "reinforce":
            raise ConfigError(
                "critic.init=reward needs reward.model_path; with a reward function use critic.init=sft or shared"
            )
        require_positive(
            self,
            ("iterations", "batch_size", "minibatch_size", "grad_accum", "micro_batch_size", "ppo_epochs"),
        )
        if self.batch_size % self.minibatch_size:
            raise ConfigError(
                f"batch_size ({self.batch_size}) must be a multiple of minibatch_size ({self.minibatch_size})"
            )
        if self.minibatch_size % self.grad_accum:
            raise ConfigError(
                f"minibatch_size ({self.minibatch_size}) must be a multiple of grad_accum ({self.grad_accum})"
            )
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ConfigError("clip_low must be in (0, 1) and clip_high > 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip must be > 1 (got {self.dual_clip}); null disables it")
        if self.generation.temperature <= 0:
            raise ConfigError("generation.temperature must be > 0")
        if not 0 < self.generation.top_p <= 1:
            raise ConfigError("generation.top_p must be in (0, 1]")
        if self.kl.controller != "fixed" and (self.kl.target is None or self.kl.target <= 0):
            raise ConfigError(f"kl.controller={self.kl.controller} needs kl.target > 0 (nats per response)")
        if self.ptx_coef > 0 and not self.data.ptx:
            raise ConfigError("ptx_coef > 0 needs data.ptx (an SFT data file)")
        if self.algo == "reinforce" and self.ppo_epochs != 1:
            raise ConfigError("algo=reinforce is on-policy: set ppo_epochs=1")
        if self.max_nonfinite_steps < 1:
            raise ConfigError(f"max_nonfinite_steps must be >= 1 (got {self.max_nonfinite_steps})")
        if self.eval.every < 0 or self.save_every < 0 or self.keep_last < 1:
            raise ConfigError("eval.every and save_every must be >= 0, keep_last >= 1")
        self.optim.validate("optim")
        self.critic.optim.validate("critic.optim")
        self._validate_distributed()

    def _validate_distributed(self) -> None:
        d, W = self.distributed, planned_world_size()
        d.validate()
        if self.lora.enabled:
            self.lora.validate()
            if d.strategy in ("fsdp2", "deepspeed"):
                raise ConfigError(
                    f"lora.enabled=true with distributed.strategy={d.strategy} is not supported (final/ is "
                    "written by merging the adapters into a full copy of the actor): use strategy=ddp"
                )
            if self.ref_path:
                raise ConfigError(
                    "lora.enabled=true uses the actor with adapters disabled as the reference: drop ref_path"
                )
        if d.strategy != "none" and self.critic.init == "shared":
            raise ConfigError(
                f"critic.init=shared with distributed.strategy={d.strategy} is not supported (the value head "
                "sits outside the wrapped actor): use critic.init=sft or reward"
            )
        if d.strategy == "deepspeed" and self.joint_optimizer:
            raise ConfigError("joint_optimizer=true with distributed.strategy=deepspeed is not supported")
        if W > 1:
            for k in ("batch_size", "minibatch_size"):
                if getattr(self, k) % W:
                    raise ConfigError(
                        f"{k} ({getattr(self, k)}) is the global number of responses and must be a multiple "
                        f"of the number of processes ({W})"
                    )
            if (self.minibatch_size // W) % self.grad_accum:
                raise ConfigError(
                    f"minibatch_size / processes ({self.minibatch_size // W}) must be a multiple of "
                    f"grad_accum ({self.grad_accum})"
                )


def derived_sizes(cfg: Config) -> dict[str, int]:
    """Sizes that follow from the config (logged once; never written back into it)."""
    minibatches = cfg.batch_size // cfg.minibatch_size
    W = planned_world_size()
    out = {"processes": W, "rollouts_per_process": cfg.batch_size // W} if W > 1 else {}
    return out | {
        "minibatches_per_epoch": minibatches,
        "micro_batch_rows": cfg.minibatch_size // W // cfg.grad_accum,
        "optimizer_steps_per_iteration": minibatches * cfg.ppo_epochs,
        "total_optimizer_steps": minibatches * cfg.ppo_epochs * cfg.iterations,
    }

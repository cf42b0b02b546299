"""The config sections every command shares, each defined once: optimiser, processes (distributed), LoRA,
model, data, evaluation, critic, KL, reward-hacking guard, reward-model ensemble and normalisation. Where a PPO
run's trajectories come from (generation, reward, environment, agent) is in :mod:`shifu.config.sources`.

A section is a frozen dataclass whose fields are declared with :func:`shifu.config.loader.opt` (default and
help text); some check their own values in ``validate(prefix)``. The four command configs that compose them
are in :mod:`shifu.config.schema`. KL targets are in **nats per response** (the unit of ``objective/kl``),
never per token.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from shifu.config.loader import opt
from shifu.errors import ConfigError

frozen = dataclasses.dataclass(frozen=True)


@frozen
class OptimConfig:
    lr: float = opt(1e-4, "peak learning rate")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay")
    betas: list[float] = opt([0.9, 0.95], "AdamW betas")
    eps: float = opt(1e-5, "AdamW epsilon (1e-5 is published PPO practice; 1e-8 is torch's default)")
    warmup_steps: int = opt(0, "linear warm-up optimiser steps from 0 to lr")
    schedule: Literal["constant", "linear", "cosine"] = opt(
        "cosine", "decay after warm-up, to min_lr_ratio*lr"
    )
    min_lr_ratio: float = opt(0.0, "final learning rate as a fraction of lr (linear/cosine)")
    max_grad_norm: float | None = opt(1.0, "gradient-norm clipping; null disables")

    def validate(self, prefix: str = "optim") -> None:
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr must be > 0 (got {self.lr})")
        if self.eps <= 0:
            raise ConfigError(f"{prefix}.eps must be > 0 (got {self.eps})")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1) (got {self.betas})")
        if self.warmup_steps < 0:
            raise ConfigError(f"{prefix}.warmup_steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{prefix}.min_lr_ratio must be in [0, 1]")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"{prefix}.max_grad_norm must be > 0 or null")


@frozen
class DistributedConfig:
    """How the trained and frozen models are spread over the processes ``torchrun`` starts."""

    strategy: Literal["none", "ddp", "fsdp2", "deepspeed"] = opt(
        "none", "trained models: none (one process), ddp, fsdp2 (fully_shard) or deepspeed (ZeRO, ppo only)"
    )
    deepspeed_config: str | None = opt(
        None, "DeepSpeed JSON config (ZeRO stage 2/3, offload); needs strategy=deepspeed"
    )
    frozen: Literal["replicate", "fsdp2"] = opt(
        "replicate", "reference / reward model: a full copy per rank, or sharded with fsdp2"
    )
    gradient_checkpointing: bool = opt(False, "recompute block activations in the backward pass")
    offload_frozen: bool = opt(
        False, "keep the frozen models on the CPU between their forwards (saves accelerator memory)"
    )
    timeout_s: float = opt(600.0, "process-group timeout: a rank stuck in a collective fails after it")

    def validate(self, prefix: str = "distributed") -> None:
        if self.strategy == "deepspeed" and not self.deepspeed_config:
            raise ConfigError(
                f"{prefix}.strategy=deepspeed needs {prefix}.deepspeed_config (a JSON file with "
                "zero_optimization.stage 2 or 3)"
            )
        if self.deepspeed_config and self.strategy != "deepspeed":
            raise ConfigError(f"{prefix}.deepspeed_config is set but {prefix}.strategy is {self.strategy}")
        if self.offload_frozen and self.frozen == "fsdp2":
            raise ConfigError(
                f"{prefix}.offload_frozen keeps whole frozen models on the CPU; it cannot be combined with "
                f"{prefix}.frozen=fsdp2 (sharded): choose one"
            )
        if self.frozen == "fsdp2" and self.strategy == "deepspeed":
            raise ConfigError(
                f"{prefix}.frozen=fsdp2 with strategy=deepspeed is not supported: use frozen=replicate "
                "(optionally with offload_frozen=true)"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"{prefix}.timeout_s must be > 0 (got {self.timeout_s})")


@frozen
class LoraConfig:
    enabled: bool = opt(
        False,
        "train LoRA adapters instead of all weights; the reference is then the actor "
        "with adapters disabled (no separate reference model)",
    )
    r: int = opt(16, "adapter rank")
    alpha: float = opt(32.0, "scale numerator: the update is (alpha / r) * B A")
    dropout: float = opt(0.0, "dropout on the adapter input (keep 0 for PPO: ratios must start at 1)")
    target_modules: list[str] | None = opt(
        None,
        "names of the linear layers to adapt (e.g. [q_proj, v_proj]); null: peft's default for the "
        "architecture (c_attn for GPT-2, q_proj/v_proj for Llama-style models)",
    )
    critic: bool = opt(
        False,
        "ppo: train the critic as LoRA adapters on its frozen trunk plus its value head "
        "(same r, alpha, target_modules); checkpoints then hold only adapters and head",
    )

    def validate(self, prefix: str = "lora") -> None:
        if self.r < 1:
            raise ConfigError(f"{prefix}.r must be >= 1 (got {self.r})")
        if self.alpha <= 0:
            raise ConfigError(f"{prefix}.alpha must be > 0 (got {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{prefix}.dropout must be in [0, 1) (got {self.dropout})")

    def check_adapters(self, strategy: str) -> None:
        """``lora.enabled`` with the process strategy ``strategy``: the fields, and a strategy that shards the
        weights refused (final/ is written by merging the adapters into a full copy of the model)."""
        self.validate()
        if strategy in ("fsdp2", "deepspeed"):
            raise ConfigError(
                f"lora.enabled=true with distributed.strategy={strategy} is not supported (final/ is written by "
                "merging the adapters into a full copy of the model): use strategy=ddp"
            )


@frozen
class ModelConfig:
    path: str = opt("", "the model to start from: a local HF directory (shifu never downloads)")
    trust_remote_code: bool = opt(False, "allow custom model code shipped in the model directory (off: safe)")


@frozen
class SFTModelConfig(ModelConfig):
    path: str = opt("", "policy to fine-tune: a local HF causal LM directory (any architecture)")
    tokenizer: str = opt("", "tokenizer directory; empty: the model's own")


@frozen
class RMModelConfig(ModelConfig):
    path: str = opt(
        "",
        "backbone: a local HF model dir (the SFT output, any causal LM, or an encoder), `minilm`, or "
        "`bag-of-tokens` (one learned weight per token id of `model.tokenizer`: a linear model of token counts)",
    )
    tokenizer: str = opt("", "bag-of-tokens: the tokenizer directory whose ids it weighs (the policy's)")


@frozen
class PolicyModelConfig(ModelConfig):
    path: str = opt("", "the policy to train: a local HF causal LM directory (usually the SFT output)")
    ref_path: str = opt("", "frozen reference model directory; empty: a copy of model.path")


@frozen
class DataConfig:
    train: str = opt("", "training data: a .jsonl or .parquet file, or a saved HF datasets directory")
    eval: str = opt("", "held-out data (same formats); empty: hold out `eval_fraction` of `train`")
    eval_fraction: float = opt(0.05, "fraction of `train` held out when `eval` is empty (deterministic)")
    skip_bad: bool = opt(False, "skip invalid rows (and report how many and why) instead of stopping")
    max_prompt_len: int = opt(128, "prompt tokens kept; longer prompts follow `prompt_policy`")
    prompt_policy: Literal["truncate_left", "drop"] = opt(
        "truncate_left", "long prompts: `truncate_left` keeps their last tokens, `drop` drops the row"
    )
    chat_template: bool = opt(
        True, "render `prompt` strings as a user message with the tokenizer's chat template (if it has one)"
    )

    def validate(self, prefix: str = "data") -> None:
        if not self.train:
            raise ConfigError(
                f"{prefix}.train is required: the path of a .jsonl/.parquet file or datasets dir"
            )
        if not self.eval and not 0 < self.eval_fraction < 1:
            raise ConfigError(
                f"{prefix}.eval_fraction must be in (0, 1) when {prefix}.eval is empty "
                f"(got {self.eval_fraction}); give a held-out file in {prefix}.eval or a fraction like 0.05"
            )
        if self.max_prompt_len < 1:
            raise ConfigError(f"{prefix}.max_prompt_len must be >= 1 (got {self.max_prompt_len})")


@frozen
class TextDataConfig(DataConfig):
    """Demonstrations or preference pairs (sft, rm, dpo)."""

    split_seed: int = opt(0, "seed of the deterministic held-out split")
    max_len: int = opt(256, "prompt + response tokens (EOS included); longer responses are cut")
    group_by_length: bool = opt(
        False,
        "batches of rows of similar length (sorted within chunks of 50 batches of the shuffled order, "
        "the batches shuffled): less padding, so fewer FLOPs per row, when lengths vary",
    )

    def validate(self, prefix: str = "data") -> None:
        super().validate(prefix)
        if self.max_len <= self.max_prompt_len:
            raise ConfigError(
                f"{prefix}.max_len ({self.max_len}) must exceed {prefix}.max_prompt_len "
                f"({self.max_prompt_len}) to leave room for a response"
            )


@frozen
class PromptDataConfig(DataConfig):
    """Prompts for rollouts (ppo); ``train`` rows need a ``prompt`` field, other fields reach reward functions."""

    ptx: str | None = opt(None, "SFT data (prompt/response) for the PPO-ptx term; needs ptx_coef > 0")


@frozen
class EvalConfig:
    every: int = opt(0, "held-out evaluation every N steps; 0: only at the end")
    batch_size: int = opt(32, "rows per held-out forward pass")


@frozen
class PolicyEvalConfig:
    every: int = opt(
        5,
        "evaluate on held-out prompts before training, every N iterations and at the end "
        "(0: only at the end)",
    )
    num_prompts: int = opt(64, "held-out prompts per evaluation")
    temperature: float = opt(0.7, "sampling temperature of evaluation samples (low: near the mode)")
    gold_function: str | None = opt(None, "gold judge 'package.module:function' (logged as gold/score)")
    best_metric: str = opt(
        "auto",
        "metric that picks best/ (higher is better); auto: gold/score with a gold_function, else eval/score",
    )
    final_prompts: int = opt(
        128,
        "with a gold_function, an environment (env.factory) or an agent (agent.factory): at the end, the run's "
        "start (model.path) and "
        "the final policy sampled on the first N held-out prompts with one seed at "
        "eval.temperature, gold before/after and the paired gain with standard errors in summary.json and the "
        "model card (samples_before/after.jsonl); at most the held-out rows there are; 0: off",
    )

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0 (got {self.every})")
        if self.final_prompts < 0:
            raise ConfigError(f"eval.final_prompts must be >= 0 (got {self.final_prompts}; 0: off)")

    def best_key(self) -> str:
        """The metric that picks best/: ``best_metric``, with ``auto`` resolved (the judge when there is one)."""
        if self.best_metric != "auto":
            return self.best_metric
        return "gold/score" if self.gold_function else "eval/score"


@frozen
class CriticConfig:
    init: Literal["reward", "sft", "shared"] = opt(
        "reward", "critic from the reward model, from the SFT model, or a value head on the actor's trunk"
    )
    path: str | None = opt(None, "override the critic's starting directory")
    head_init: Literal["normal", "zero"] = opt(
        "normal",
        "a new value head (critic.init sft or shared): weights N(0, 1/sqrt(d+1)) as a reward model's head, or 0 "
        "(every value starts at 0, so the first advantages are the returns; for rare rewards)",
    )
    optim: OptimConfig = opt(OptimConfig(lr=1e-4), "critic optimiser (separate optimisers)")


@frozen
class KLConfig:
    controller: Literal["fixed", "adaptive", "step", "penalty"] = opt(
        "adaptive", "how beta follows the KL to the reference"
    )
    init_coef: float = opt(0.05, "initial beta")
    target: float | None = opt(6.0, "KL target in nats per response (adaptive/step/penalty)")
    horizon: int = opt(10000, "adaptive controller horizon in samples (Ziegler et al. 2019)")
    estimator: Literal["k1", "k2", "k3"] = opt("k1", "per-token KL estimator for the reward penalty")
    penalty: Literal["reward", "loss"] = opt(
        "reward",
        "where beta * KL goes: in the per-token reward (k1 by kl.estimator), or a loss term (GRPO)",
    )
    loss_estimator: Literal["k2", "k3", "full"] = opt(
        "k3",
        "kl.penalty=loss: the loss term's estimator; k3 (GRPO's) has the gradient of KL(pi_ref || pi), "
        "k2 = 1/2 (log pi/pi_ref)^2 that of KL(pi || pi_ref), the KL the reward penalty and the evaluation use; "
        "full: no estimate, KL(pi || pi_ref) over the whole vocabulary at each position (keeps the reference's "
        "(B, R, V) log-probs with the rollout)",
    )

    def validate(self) -> None:
        if self.controller != "fixed" and (self.target is None or self.target <= 0):
            raise ConfigError(f"kl.controller={self.controller} needs kl.target > 0 (nats per response)")


@frozen
class GuardConfig:
    kl_ceiling: float | None = opt(
        None, "stop and restore best/ when objective/kl exceeds this many nats per response"
    )
    divergence_patience: int = opt(
        3,
        "with a gold judge (eval.gold_function): stop and restore best/ after N evaluations in a row where gold "
        "falls while the reward model's score rises (0: off)",
    )


@frozen
class EnsembleConfig:
    k: int = opt(1, "number of reward models trained (seeds seed, seed+1, ...)")
    shard: bool = opt(False, "train member m on rows m, m+k, m+2k, ... instead of all rows")
    aggregate: Literal["mean", "median", "min", "mean_minus_std"] = opt("mean", "how member scores combine")
    std_coef: float = opt(1.0, "k in mean - k*std (aggregate: mean_minus_std)")


@frozen
class NormalizeConfig:
    responses: str = opt("", "JSONL/Parquet of prompt+response rows whose scores get mean 0, std 1")
    max_rows: int = opt(0, "fit on this many rows of `responses`, drawn with the run's seed (0: all of them)")
    policy: str = opt(
        "", "or: a policy dir sampled on training prompts for the same fit (e.g. the SFT output)"
    )
    num_prompts: int = opt(64, "training prompts sampled with `policy`")
    max_new_tokens: int = opt(48, "response tokens sampled per prompt")
    temperature: float = opt(1.0, "sampling temperature")
    batch_size: int = opt(16, "prompts per generate call")


@frozen
class TracesConfig:
    """What a PPO run records of its trajectories (``shifu traces export``: docs/how-to/traces.md)."""

    episodes: bool = opt(
        False,
        "record every rollout's trajectories in RUN/episodes/rank-R.jsonl: per turn the sampled token ids and "
        "log-probs, text, tool calls and reward, and what the policy read after it (shifu traces export reads "
        "them)",
    )
    atif: bool = opt(
        False,
        "record them (as traces.episodes) and also write them as ATIF during the run, one trajectory per line "
        "of RUN/episodes/atif-rank-R.jsonl",
    )

    @property
    def recording(self) -> bool:
        return self.episodes or self.atif

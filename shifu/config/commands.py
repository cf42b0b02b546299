"""The keys every command's config has (:class:`RunConfig`), and the configs of the supervised commands
``shifu sft``, ``shifu rm`` and ``shifu dpo`` (:class:`SupervisedConfig`: one loop over a data set).
:mod:`shifu.config.schema` gathers them with PPO's into the four command configs."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from shifu.config.loader import opt, require_finite, require_positive
from shifu.config.sections import (
    DistributedConfig,
    EnsembleConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    NormalizeConfig,
    OptimConfig,
    PolicyModelConfig,
    RMModelConfig,
    SFTModelConfig,
    TextDataConfig,
    frozen,
)
from shifu.errors import ConfigError


@frozen
class RunConfig:
    """The keys every command has: where it writes, randomness, device, precision, checkpoints, processes."""

    RENAMED: ClassVar[dict[str, str]] = {}  # an old key -> its new name (the error says which)

    out_dir: str = opt("", "run directory: metrics.jsonl, tb/, checkpoints/, final/")
    model: ModelConfig = opt(ModelConfig(), "the model to start from")
    seed: int = opt(0, "random seed (shuffling, sampling, new heads)")
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    bf16: bool = opt(
        False,
        "bf16 autocast for the training step where a GEMM probe at the model's shapes measures it faster (said "
        "on stderr, logged as precision/bf16_update; cached in $SHIFU_CACHE/bf16_probe.json); weights and "
        "optimiser stay fp32",
    )
    save_every: int = opt(0, "checkpoint every N steps (for --resume); 0: only at the end")
    keep_last: int = opt(2, "checkpoints kept")
    max_nonfinite_steps: int = opt(
        5, "stop after this many consecutive optimiser steps with a NaN/Inf loss or gradient (each skipped)"
    )
    progress: bool = opt(True, "show a progress bar on stderr")
    tensorboard: bool = opt(True, "also write TensorBoard scalars to OUT/tb")
    trackers: list[str] = opt(
        [],
        "more metric sinks besides metrics.jsonl: wandb, mlflow (optional extras; rank 0 only)",
        choices=("jsonl", "tensorboard", "wandb", "mlflow"),  # shifu.runs.tracking.TRACKERS (tested)
    )
    distributed: DistributedConfig = opt(
        DistributedConfig(), "multi-process training under torchrun (batch sizes stay global)"
    )

    def validate(self) -> None:
        if not self.out_dir:
            raise ConfigError("out_dir is required: pass --out DIR or out_dir=DIR")
        if not self.model.path:
            what = next(f for f in dataclasses.fields(self.model) if f.name == "path").metadata["help"]
            raise ConfigError(f"model.path is required: {what}")
        require_finite(self)
        require_positive(self, ("keep_last", "max_nonfinite_steps"))
        from shifu.runs.tracking import validate_trackers  # (names and installed extras; no import of them)

        validate_trackers(self.trackers)
        if self.save_every < 0:
            raise ConfigError(f"save_every must be >= 0 (got {self.save_every}); 0 means only at the end")
        self.distributed.validate()


@frozen
class SupervisedConfig(RunConfig):
    """sft, rm and dpo: one loop over shuffled micro-batches of a data set (``shifu.trainers.loop``)."""

    RENAMED: ClassVar[dict[str, str]] = {"eval_every": "eval.every", "eval_batch_size": "eval.batch_size"}

    data: TextDataConfig = opt(TextDataConfig(), "training and held-out data")
    optim: OptimConfig = opt(OptimConfig(), "AdamW and learning-rate schedule")
    eval: EvalConfig = opt(EvalConfig(), "held-out evaluation")
    batch_size: int = opt(8, "rows per micro-batch, over all processes (global)")
    grad_accum: int = opt(1, "micro-batches per optimiser step (loss = mean over all of them)")
    epochs: float = opt(1.0, "passes over the training data (used when max_steps is 0)")
    max_steps: int = opt(0, "optimiser steps; 0: derived from epochs")
    log_every: int = opt(10, "training metrics averaged and logged every N steps")

    def validate(self) -> None:
        super().validate()
        self.data.validate()
        self.optim.validate()
        require_positive(self, ("batch_size", "grad_accum", "log_every"))
        require_positive(self.eval, ("batch_size",), "eval.")
        for key, value in (("max_steps", self.max_steps), ("eval.every", self.eval.every)):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0 (got {value}); 0 means off/derived")
        if self.max_steps == 0 and self.epochs <= 0:
            raise ConfigError("set epochs > 0 or max_steps > 0")
        if self.distributed.strategy == "deepspeed":
            raise ConfigError(
                "distributed.strategy=deepspeed is supported by `shifu ppo` only; use ddp or fsdp2 here"
            )


@frozen
class SFTConfig(SupervisedConfig):
    model: SFTModelConfig = opt(SFTModelConfig(), "the model to fine-tune")
    optim: OptimConfig = opt(OptimConfig(), "AdamW and learning-rate schedule")
    eval: EvalConfig = opt(EvalConfig(batch_size=16), "held-out loss")
    lora: LoraConfig = opt(
        LoraConfig(),
        "train LoRA adapters instead of all weights (final/ holds them merged); lora.critic: ppo only",
    )

    def validate(self) -> None:
        super().validate()
        if self.lora.critic:
            raise ConfigError("lora.critic is a setting of shifu ppo (its critic); sft has none: drop it")
        if self.lora.enabled:
            self.lora.check_adapters(self.distributed.strategy)


@frozen
class RMConfig(SupervisedConfig):
    RENAMED: ClassVar[dict[str, str]] = {**SupervisedConfig.RENAMED, "model.backbone": "model.path"}

    model: RMModelConfig = opt(RMModelConfig(), "the backbone")
    optim: OptimConfig = opt(OptimConfig(lr=1e-4), "AdamW and learning-rate schedule")
    ensemble: EnsembleConfig = opt(EnsembleConfig(), "K reward models and their aggregation")
    normalize: NormalizeConfig = opt(NormalizeConfig(), "gain/bias fit after training (off when unset)")
    center_coef: float = opt(0.0, "c in c * mean((r_c + r_r)^2), keeps scores near 0")
    l2_coef: float = opt(
        0.0,
        "c in c * (sum of the backbone's squared trainable weights), added to each step's loss: ridge "
        "regression, for model.path=bag-of-tokens (it shrinks the weights of rarely seen tokens; AdamW's "
        "decoupled weight_decay does not)",
    )
    freeze_layers: int = opt(
        0,
        "freeze the backbone's embeddings and its lowest N transformer blocks (0: train everything); "
        "the backward pass and the optimiser then cover only the upper blocks and the head",
    )
    keep_layers: int = opt(
        0,
        "keep only the backbone's lowest N transformer blocks (0: all): a cheaper reward model to train "
        "and to score with (saved as an N-block model)",
    )

    def validate(self) -> None:
        super().validate()
        require_positive(self.ensemble, ("k",), "ensemble.")
        if self.l2_coef < 0:
            raise ConfigError(f"l2_coef must be >= 0 (got {self.l2_coef}); 0 turns the ridge penalty off")
        if self.freeze_layers < 0 or self.keep_layers < 0:
            raise ConfigError(
                f"freeze_layers and keep_layers must be >= 0 (got {self.freeze_layers}, "
                f"{self.keep_layers}); 0 trains / keeps every layer"
            )
        if self.normalize.responses and self.normalize.policy:
            raise ConfigError("set only one of normalize.responses and normalize.policy")
        if self.model.path == "bag-of-tokens":
            if not self.model.tokenizer:
                raise ConfigError(
                    "model.path=bag-of-tokens needs model.tokenizer: the directory of the tokenizer "
                    "whose ids it weighs (the policy's, e.g. the SFT output)"
                )
            if self.freeze_layers or self.keep_layers:
                raise ConfigError(
                    "model.path=bag-of-tokens has no transformer blocks: leave freeze_layers and "
                    "keep_layers at 0"
                )
        elif self.model.tokenizer:
            raise ConfigError(
                f"model.tokenizer is read only with model.path=bag-of-tokens (got model.path="
                f"'{self.model.path}', whose own tokenizer is used); remove model.tokenizer"
            )


@frozen
class DPOConfig(SupervisedConfig):
    RENAMED: ClassVar[dict[str, str]] = {
        **SupervisedConfig.RENAMED,
        "policy_path": "model.path",
        "ref_path": "model.ref_path",
        "trust_remote_code": "model.trust_remote_code",
    }

    model: PolicyModelConfig = opt(PolicyModelConfig(), "the policy and its frozen reference")
    optim: OptimConfig = opt(OptimConfig(lr=1e-5), "AdamW and learning-rate schedule")
    beta: float = opt(0.1, "beta of DPO: implicit reward = beta * (log pi - log pi_ref), summed over tokens")

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0 (got {self.beta}); typical values are 0.01 .. 0.5")

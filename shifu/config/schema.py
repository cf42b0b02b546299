"""The four command configs (sft, rm, dpo, ppo), composed from the sections of :mod:`shifu.config.sections`.

One name per concept across commands: the starting model is ``model.path`` (PPO's actor, DPO's policy,
the reward model's backbone, the model SFT fine-tunes) and its frozen reference ``model.ref_path``; the
evaluation cadence is ``eval.every``; training data is ``data.train`` / ``data.eval``. Configs are frozen
(change one with ``dataclasses.replace``). ``validate()`` checks a config on its own; what depends on how
the program was launched (the number of processes) is checked at launch by :func:`check_world_size`.
Derived sizes (per-process batch, minibatches, optimiser steps) come from :func:`derived_sizes`, are
logged as ``sizes/*`` at step 0 and never written back into a config.

``shifu CMD --help-config`` lists every key of a command with its default and meaning (:func:`describe`).
KL targets are in **nats per response** (the unit of ``objective/kl``), never per token.
"""

from __future__ import annotations

from shifu.config.commands import DPOConfig, RMConfig, RunConfig, SFTConfig, SupervisedConfig
from shifu.config.ppo_config import PPOConfig
from shifu.errors import ConfigError

# the four command configs (defined in shifu.config.commands and shifu.config.ppo_config), and the checks of
# a config against the processes it was launched with
__all__ = [
    "DPOConfig",
    "PPOConfig",
    "RMConfig",
    "RunConfig",
    "SFTConfig",
    "SupervisedConfig",
    "check_world_size",
    "derived_sizes",
]


def check_world_size(cfg: RunConfig, world: int) -> None:
    """What depends on the number of processes: a strategy for more than one, global batch sizes that the
    processes split evenly. Called once the process count is known (at launch), never by ``validate``."""
    d = cfg.distributed
    if world > 1 and d.strategy == "none":
        raise ConfigError(
            f"launched with {world} processes but distributed.strategy=none: set distributed.strategy=ddp, "
            "fsdp2 or deepspeed (or run one process)"
        )
    if isinstance(cfg, PPOConfig):
        for k in ("batch_size", "minibatch_size"):
            if getattr(cfg, k) % world:
                raise ConfigError(
                    f"{k} ({getattr(cfg, k)}) is the global number of responses and must be a multiple "
                    f"of the number of processes ({world})"
                )
        if (cfg.batch_size // cfg.group_size) % world:
            raise ConfigError(
                f"batch_size / group_size ({cfg.batch_size // cfg.group_size} prompts) must be a multiple of the "
                f"number of processes ({world}): each prompt's group of {cfg.group_size} stays on one process"
            )
        if (cfg.minibatch_size // world) % cfg.grad_accum:
            raise ConfigError(
                f"minibatch_size / processes ({cfg.minibatch_size // world}) must be a multiple of "
                f"grad_accum ({cfg.grad_accum})"
            )
    elif cfg.batch_size % world:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is the global number of rows per micro-batch: it must be a multiple "
            f"of the {world} processes (each takes batch_size / {world}); e.g. batch_size="
            f"{world * max(1, cfg.batch_size // world)}"
        )


def derived_sizes(cfg: RunConfig, world: int) -> dict[str, int]:
    """Sizes that follow from the config and the process count (logged once as ``sizes/*``)."""
    out = {"processes": world, "batch_per_process": cfg.batch_size // world}
    if not isinstance(cfg, PPOConfig):
        return out  # (the optimiser steps follow from the data: the loop adds them)
    minibatches = cfg.batch_size // cfg.minibatch_size
    return out | {
        "minibatches_per_epoch": minibatches,
        "micro_batch_rows": cfg.minibatch_size // world // cfg.grad_accum,
        "optimizer_steps_per_iteration": minibatches * cfg.ppo_epochs,
        "total_optimizer_steps": minibatches * cfg.ppo_epochs * cfg.iterations,
    }

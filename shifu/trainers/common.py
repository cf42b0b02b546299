"""Pieces every trainer shares: optimiser and schedule configs, seeding, run set-up."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import yaml

from shifu import checkpoint as ckpt
from shifu.config import opt, to_dict
from shifu.errors import ConfigError, ShifuError


@dataclasses.dataclass
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


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused (one kernel for the whole update) where torch has it: plain float tensors on CPU/CUDA; else
    # foreach. The per-parameter loop dominated small models' optimiser time in the PPO benchmark.
    fused = all(
        not hasattr(p, "to_local")
        and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16)
        for p in params
    )
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kind)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up to lr, then constant / linear / cosine decay to ``min_lr_ratio * lr``."""
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        if cfg.schedule == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(enabled: bool, device: torch.device | str = "cpu"):
    """bf16 autocast (CPU or CUDA) when enabled; a no-op context otherwise."""
    dev = torch.device(device).type
    return torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=enabled)


def write_config(run_dir: str | Path, cfg) -> None:
    """The resolved config next to the results (``config.yaml``)."""
    Path(run_dir, "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


class GracefulStop:
    """SIGINT/SIGTERM set ``requested``; the trainer finishes its step, checkpoints and exits 0.

    A second signal restores the default handler's behaviour (raise KeyboardInterrupt / terminate).
    """

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.requested:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.requested = True
        # os.write, not print: the signal may land while the main thread is inside a write to sys.stderr
        # (a progress bar), and a buffered stream refuses a reentrant write (RuntimeError)
        msg = f"\nshifu: got {signal.Signals(signum).name}; finishing this step and writing a checkpoint\n"
        try:
            os.write(sys.stderr.fileno(), msg.encode())
        except (OSError, ValueError, AttributeError):  # no usable stderr: stopping still works
            pass

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def announce_stop(cmd: str, where: str, out_dir) -> None:
    """The message of a run stopped by SIGINT/SIGTERM after its checkpoint: where it stopped, how to resume."""
    print(
        f"shifu {cmd}: stopped at {where} with a checkpoint. Resume with: shifu {cmd} "
        f"--config <same config> --out {out_dir} --resume",
        file=sys.stderr,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use device=cpu or auto")
    return torch.device(name)


# ---------------------------------------------------------------- non-finite steps (sft, rm, dpo)
def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def grads_finite(model: torch.nn.Module, loss: float) -> bool:
    """True when ``loss`` and every gradient of ``model`` (this rank's shard under FSDP2) are finite; one
    device-to-host read."""
    grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
    return math.isfinite(loss) and (
        not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
    )


def count_nonfinite(
    nonfinite: list[int], finite: bool, name: str, step: int, limit: int, run_dir: Path, say: bool = True
) -> ShifuError | None:
    """Book optimiser step ``step`` (1-based) in ``nonfinite`` = [skipped in total, skipped in a row]. A
    skipped step is announced on stderr (when ``say``); after ``limit`` skipped steps in a row the error
    that ends the run is returned (the caller closes its sinks and raises)."""
    if finite:
        nonfinite[1] = 0
        return None
    nonfinite[0] += 1
    nonfinite[1] += 1
    if say:
        print(f"shifu {name}: step {step}: non-finite loss or gradient, step skipped", file=sys.stderr)
    if nonfinite[1] < limit:
        return None
    last = ckpt.latest_checkpoint(run_dir)
    return ShifuError(
        f"{nonfinite[1]} consecutive steps (up to step {step}) had a NaN/Inf loss or gradient; "
        f"stopping (max_nonfinite_steps={limit}). "
        + (
            f"The last good checkpoint is {last}; lower optim.lr or check the data, then --resume"
            if last
            else "No checkpoint was written; lower optim.lr or check the data"
        )
    )


def require_positive(cfg, keys: tuple[str, ...]) -> None:
    """ConfigError naming the first of ``keys`` whose value on ``cfg`` is below 1."""
    for key in keys:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1 (got {getattr(cfg, key)})")


def validate_loop_fields(cfg) -> None:
    """The training-loop fields sft, rm and dpo Configs share: counts >= 1, step counts >= 0 (0 = off or
    derived), and some length of training (``epochs`` or ``max_steps``)."""
    require_positive(
        cfg, ("batch_size", "grad_accum", "eval_batch_size", "keep_last", "log_every", "max_nonfinite_steps")
    )
    for key in ("max_steps", "eval_every", "save_every"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (got {getattr(cfg, key)}); 0 means off/derived")
    if cfg.max_steps == 0 and cfg.epochs <= 0:
        raise ConfigError("set epochs > 0 or max_steps > 0")


def apply_step(
    model: torch.nn.Module, optimizer, scheduler, max_grad_norm: float | None, finite: bool
) -> None:
    """Clip and take the optimiser step unless the step's loss or gradients were not finite (then the weights
    and Adam moments stay untouched); the schedule advances and the gradients are cleared either way."""
    if finite:
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

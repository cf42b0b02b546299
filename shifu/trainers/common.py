"""What every trainer's run shares: seeding, autocast, signals, the run directory, skipped-step accounting."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.nn.attention import SDPBackend, sdpa_kernel

from shifu.config.loader import to_dict, with_values
from shifu.errors import ConfigError, ShifuError
from shifu.parallel import distributed as D
from shifu.parallel import precision
from shifu.runs import checkpoint as ckpt
from shifu.runs import files, jsonfile


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def autocast(enabled: bool, device: torch.device | str = "cpu"):
    """bf16 autocast (CPU or CUDA) when enabled; a no-op context otherwise.

    On CPU, attention under it runs as matmuls and a softmax (SDPA's math backend), not the fused CPU
    flash kernel: with torch 2.13 that kernel's bf16 *backward* measured 7x its fp32 time in a PPO update
    of the imdb quickstart's GPT-2 (4 layers, head dim 32, 48 positions; 1.20 s against 0.17 s), more than
    the bf16 GEMMs saved, so bf16 made the update slower than fp32 (3.1-3.4 s against 2.5-2.8 s); with the
    math backend it takes 1.6-1.8 s (docs/benchmarks/throughput.md). fp32 keeps the fused kernel, faster there."""
    dev = torch.device(device).type
    with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=enabled):
        if enabled and dev == "cpu":
            with sdpa_kernel([SDPBackend.MATH]):
                yield
        else:
            yield


def with_bf16_decision(cfg, model, lengths: list[int], strategy, name: str, pairs: bool = False):
    """``cfg`` as the steps of sft / rm / dpo use it: with ``bf16=true``, ``bf16`` is what the GEMM probe at
    ``model``'s shapes measures faster (:func:`shifu.parallel.precision.training`) for a micro-batch of this process
    (twice the rows with ``pairs``: chosen and rejected go through one forward) of sequences of the mean of
    ``lengths`` tokens, said on stderr. ``config.yaml`` keeps what the user asked for."""
    if not cfg.bf16:
        return cfg
    rows = max(1, cfg.batch_size // strategy.world // cfg.grad_accum) * (2 if pairs else 1)
    T = max(1, round(sum(lengths) / max(1, len(lengths))))

    def decide():  # on rank 0, whose answer every rank takes: all ranks compute alike
        probe = precision.Probe(strategy.device)
        out = precision.training(model, rows, T, probe)
        probe.save()
        return out

    use, reason = strategy.on_main(decide)
    if strategy.is_main:
        print(f"shifu {name}: {reason}", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, bf16=use)


def write_config(run_dir: str | Path, cfg) -> None:
    """The resolved config next to the results (``config.yaml``)."""
    Path(run_dir, "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def prepare_run(cfg, strategy, resume: bool, overwrite: bool, length: tuple[str, int] | None = None) -> Path:
    """The run directory (rank 0 prepares it; its refusal reaches every rank) with ``config.yaml`` written.

    ``length``: (config key, steps or iterations it plans). Resuming a run that already went past them is
    refused before anything is written: it would only rewrite final/ and summary.json."""
    run_dir = strategy.on_main(lambda: ckpt.prepare_run_dir(cfg.out_dir, resume, overwrite))
    latest = ckpt.latest_checkpoint(run_dir) if resume and length is not None else None
    if latest is not None and (reached := int(latest.name.split("-", 1)[1])) > length[1]:
        key, planned = length
        raise ConfigError(
            f"cannot resume '{run_dir}' with {key} giving {planned}: its checkpoint {latest.name} is already past "
            f"that. Give {key} of at least {reached} to train further (nothing was changed; its final/ stays)"
        )
    if strategy.is_main:
        write_config(run_dir, cfg)
    return run_dir


def finish_run(run_dir: Path, summary: dict[str, Any], strategy, kind: str, line: str) -> dict[str, Any]:
    """``summary.json``, the model card ``final/README.md`` (from the run's own files) and the run's closing
    line on stderr (rank 0), once every rank got here."""
    if strategy.is_main:
        from shifu.reporting.modelcard import write_model_card

        (run_dir / "summary.json").write_text(jsonfile.dumps(summary, indent=2), encoding="utf-8")
        write_model_card(run_dir / "final", run_dir, kind)
        print(line, file=sys.stderr)
    strategy.barrier()
    return summary


def tracker(cfg, run_dir: Path, strategy, resume_step: int | None = None):
    """The run's metric sinks (rank 0 writes): metrics.jsonl, TensorBoard, and ``cfg.trackers``, which
    receive the config too; ``resume_step`` continues a resumed run's logs (see :class:`Tracker`)."""
    from shifu.config.loader import to_dict
    from shifu.runs.tracking import Tracker

    return Tracker(
        run_dir,
        enabled=strategy.is_main,
        tensorboard=cfg.tensorboard,
        resume_step=resume_step,
        trackers=cfg.trackers,
        config=to_dict(cfg),
    )


def save_policy(strategy, model, fresh, tokenizer, path: Path) -> None:
    """A trained causal LM as an HF directory (rank 0 writes; sharded weights are gathered into
    ``fresh()`` first; a LoRA model is saved with its adapters merged)."""
    from shifu.models import lora

    plain = strategy.full_model(model, fresh)
    if strategy.is_main:
        files.save_hf_dir(lora.merged_copy(plain) if lora.is_lora(plain) else plain, tokenizer, path)
    strategy.barrier()


def check_resume_config(saved: dict[str, Any], cfg, safe: set[str] | tuple[str, ...], run_dir) -> None:
    """ConfigError naming the keys whose values differ from the checkpoint's config, outside ``safe`` (the
    keys a resumed run may change: they do not alter what the finished steps computed)."""
    changed = [k for k in ckpt.config_diff(saved, to_dict(cfg)) if k not in safe and k != "out_dir"]
    if changed:
        raise ConfigError(
            f"cannot resume '{run_dir}' with a changed config: {', '.join(changed)} differ from the checkpoint. "
            f"Only {', '.join(sorted(safe))} may change; restore the others or start a new run"
        )


class GracefulStop:
    """SIGINT/SIGTERM set ``requested``; the trainer finishes its step, checkpoints and exits 0.

    A second signal restores the default handler's behaviour (raise KeyboardInterrupt / terminate), except,
    in a process that torchrun launched (``launched``), the first signal again: a signal sent to every
    process of a job (Slurm's ``scancel``, systemd stopping a service) reaches each rank twice, directly
    and forwarded by the launcher, and is one request to stop. There the launcher owns the deadline: it
    kills the ranks after its shutdown timeout, and answers a second signal of its own with a SIGTERM,
    which after a SIGINT (Ctrl-C twice) still stops a rank at once.
    """

    def __init__(self, launched: bool | None = None) -> None:
        self.requested = False
        self.first: int | None = None  # the signal that asked to stop
        self.launched = D.launched_by_torchrun() if launched is None else launched
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.requested:
            if self.launched and signum == self.first:
                return  # the same request, delivered again by the launcher
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.requested, self.first = True, signum
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


def announce_stop(cmd: str, where: str, out_dir, best: tuple[Any, str, Any] | None = None) -> None:
    """The message of a run stopped by SIGINT/SIGTERM after its checkpoint: where it stopped, how to resume, and,
    when the run keeps a ``best/`` (PPO), that it is the model to use meanwhile; ``best``: (its iteration, the
    metric that picked it, its value)."""
    text = f"shifu {cmd}: stopped at {where} with a checkpoint. Resume with: shifu {cmd} --out {out_dir} --resume"
    if (Path(out_dir) / "best").is_dir():
        which = f" (iteration {best[0]}, {best[1]} {best[2]:.4g})" if best and best[2] is not None else ""
        text += (
            f". Until then, the model to use is {Path(out_dir) / 'best'}{which}: the best evaluation so far"
        )
    print(text, file=sys.stderr)


class SkippedSteps:
    """Optimiser steps skipped for a NaN/Inf loss or gradient: in total and in a row (both checkpointed).

    :meth:`record` books one step; :meth:`check` raises the error that ends the run once ``limit`` steps in a
    row were skipped, naming the last good checkpoint."""

    def __init__(self, limit: int, state: list[int] | None = None):
        self.limit = limit
        self.total, self.in_a_row = state or (0, 0)

    def state(self) -> list[int]:
        return [self.total, self.in_a_row]

    def record(self, taken: bool) -> None:
        self.total += not taken
        self.in_a_row = 0 if taken else self.in_a_row + 1

    def check(self, where: str, run_dir: Path, hint: str) -> None:
        if self.in_a_row < self.limit:
            return
        last = ckpt.latest_checkpoint(run_dir)
        raise ShifuError(
            f"{self.in_a_row} consecutive steps (up to {where}) had a NaN/Inf loss or gradient; stopping "
            f"(max_nonfinite_steps={self.limit}). "
            + (
                f"The last good checkpoint is {last}; lower optim.lr or {hint}, then --resume"
                if last
                else f"No checkpoint was written; lower optim.lr or {hint}"
            )
        )


def report_counts(path: str, counts: dict[str, int], main: bool = True) -> None:
    """Tell the user about dropped/truncated rows (never silent; once, from rank 0, under torchrun)."""
    if counts and main:
        print(
            f"shifu: {path}: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items()),
            file=sys.stderr,
        )


def total_steps(n_batches_per_epoch: int, grad_accum: int, epochs: float, max_steps: int) -> int:
    """Optimiser steps of the run: ``max_steps``, else ``ceil(epochs * batches_per_epoch / grad_accum)``."""
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(epochs * n_batches_per_epoch / grad_accum))


LENGTH_BIAS = 0.5  # |correlation| of a reward model's held-out scores with response length that is flagged


def warn_length_bias(corr: float, strategy) -> None:
    """Say (rank 0) when a reward model's held-out scores follow response length (|r| >= ``LENGTH_BIAS``): PPO
    against it can raise the score by writing longer (or shorter) responses rather than better ones."""
    if strategy.is_main and abs(corr) >= LENGTH_BIAS:
        print(
            f"warning: shifu rm: held-out scores correlate with response length (r = {corr:.2f}): PPO against this "
            f"model may learn to write {'longer' if corr > 0 else 'shorter'} rather than better responses; compare "
            "eval/rm/acc_chosen_longer with acc_chosen_shorter, or balance the lengths of chosen and rejected",
            file=sys.stderr,
        )


def policy_config(cfg):
    """``cfg`` with ``model.path`` the policy directory it names: a run directory's ``final/`` (as ``shifu
    sample`` and ``shifu serve`` read it). A reward model given as the policy is refused, saying where it goes."""
    given = Path(cfg.model.path)
    if not given.is_dir():
        return cfg  # the loaders' own errors name a missing path
    found = files.resolve_policy(given, reward_as="reward.model_path", policy_as="model.path")
    return cfg if found == given else with_values(cfg, {"model.path": str(found)})

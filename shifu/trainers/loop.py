"""The training loop of ``shifu sft``, ``shifu rm`` and ``shifu dpo``: one skeleton; each trainer gives only
its micro-batch loss and its evaluation (a :class:`Job`).

A step is ``grad_accum`` global micro-batches of ``batch_size`` rows from a
:class:`~shifu.data.batches.BatchStream`; each process takes its share (``strategy.share``). The step's loss
is the mean over all its rows (rm, dpo) or response tokens (sft): a micro-batch's loss *sum* is divided by the
step's count over every process (``strategy.token_mean_divisor``), so micro-batches and ranks add up to the
one-process mean. Around the step, in order: skip a non-finite step (counted; ``max_nonfinite_steps`` in a row
end the run), log the window's means every ``log_every`` steps, evaluate every ``eval.every`` steps,
checkpoint every ``save_every`` steps or on SIGINT/SIGTERM (then stop, exit 0). ``--resume`` restores the
weights, the optimiser, the data position, the logging window, the skipped-step counts and every RNG state.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shifu.config.loader import to_dict
from shifu.config.schema import SupervisedConfig, derived_sizes
from shifu.data.batches import BatchStream
from shifu.errors import ShifuError
from shifu.parallel.strategy import Strategy, Trained
from shifu.runs import checkpoint as ckpt
from shifu.runs.tracking import progress
from shifu.trainers import common
from shifu.trainers.common import GracefulStop, SkippedSteps, announce_stop, check_resume_config, total_steps

# config keys a resumed run may change (everything else must match the checkpoint's config)
SAFE_RESUME_KEYS = {
    "bf16",  # compute precision only (fp32 weights and optimiser state); the probe may decide otherwise elsewhere
    "distributed.timeout_s",
    "max_steps",
    "epochs",
    "save_every",
    "eval.every",
    "keep_last",
    "log_every",
    "progress",
    "tensorboard",
    "max_nonfinite_steps",
    "trackers",
}

# (this rank's rows of a micro-batch, the step's divisor) -> (the loss to back-propagate, its statistics
# already weighted by the micro-batch's share of the step, a throughput count: tokens or rows)
MicroBatchLoss = Callable[[list[int], torch.Tensor], tuple[torch.Tensor, dict[str, float], int]]


@dataclasses.dataclass
class Job:
    """What a trainer gives the loop."""

    name: str  # metric namespace and messages: "sft", "rm", "dpo"
    trained: Trained  # the model as the strategy wrapped it, its optimiser and schedule
    modules: dict[str, nn.Module]  # {name: the plain model}: its weights and optimiser in checkpoints
    n_rows: int  # training rows
    stat_keys: tuple[str, ...]  # the statistics of a step, the loss first
    count: Callable[[list[int]], int]  # what a micro-batch's loss sums over: response tokens, or rows
    loss: MicroBatchLoss
    evaluate: Callable[[], dict[str, float]]  # held-out metrics
    unit: str = "tokens"  # throughput: perf/<unit>_per_s
    seed: int = 0  # data order
    desc: str = ""  # progress bar and messages (default: name)
    eval_at_end: bool = True  # evaluate after the last step (rm reports after its normalisation instead)
    lengths: list[int] | None = None  # per training row, the tokens its forward pads to (group_by_length)


class Window:
    """Training statistics summed since the last log line (checkpointed, so a resumed run logs the same
    numbers): the stats of steps taken, their number, and the throughput count of every step."""

    def __init__(self, keys: tuple[str, ...], state: dict | None = None):
        self.keys = keys
        self.sums, self.steps, self.count = (
            (state["sums"], state["steps"], state["count"]) if state else (dict.fromkeys(keys, 0.0), 0, 0)
        )

    def state(self) -> dict:
        return {"sums": self.sums, "steps": self.steps, "count": self.count}

    def means(self) -> dict[str, float]:
        return {k: v / self.steps if self.steps else float("nan") for k, v in self.sums.items()}

    def add(self, stats: dict[str, float] | None, count: int) -> None:
        """One step more: its statistics if it was taken (None: skipped), its throughput count either way."""
        if stats is not None:
            self.sums = {k: self.sums[k] + stats[k] for k in self.keys}
            self.steps += 1
        self.count += count


def steps_of(cfg: SupervisedConfig, n_rows: int) -> int:
    """Optimiser steps of a run over ``n_rows`` training rows: ``max_steps``, or ``epochs`` passes."""
    batches_per_epoch = math.ceil(n_rows / cfg.batch_size)
    return total_steps(batches_per_epoch, cfg.grad_accum, cfg.epochs, cfg.max_steps)


def length(cfg: SupervisedConfig, n_rows: int) -> tuple[str, int]:
    """(the key that sets the run's length, its steps): what a resumed run must not already be past."""
    return ("max_steps" if cfg.max_steps > 0 else "epochs", steps_of(cfg, n_rows))


def start(job: Job, cfg: SupervisedConfig, strategy: Strategy, run_dir: Path, resume: bool, trained: dict):
    """Where :func:`run` starts: ``(step, batch stream, logging window, skipped steps, metric sinks)``, at step
    0, or resumed from the latest checkpoint (its weights, optimiser and RNG states loaded into ``trained``
    and ``job.modules``): the sinks then drop what the interrupted run logged after it (``--resume``
    without a checkpoint yet: everything)."""
    lengths = job.lengths if cfg.data.group_by_length else None
    stream = BatchStream(job.n_rows, cfg.batch_size, job.seed, lengths=lengths)
    step, state = 0, {}
    latest = ckpt.latest_checkpoint(run_dir) if resume else None
    if latest is not None:
        check_resume_config(ckpt.read_state(latest)["config"], cfg, SAFE_RESUME_KEYS, run_dir)
        state = strategy.load_checkpoint(latest, trained, job.modules)
        step = state["step"]
        stream = BatchStream(job.n_rows, cfg.batch_size, job.seed, **state["data"], lengths=lengths)
    # resuming drops what the interrupted run logged after its checkpoint (-1: no checkpoint, start over)
    resume_step = step if latest is not None else (-1 if resume else None)
    tracker = common.tracker(cfg, run_dir, strategy, resume_step)
    window = Window(job.stat_keys, state.get("window"))
    return step, stream, window, SkippedSteps(cfg.max_nonfinite_steps, state.get("nonfinite")), tracker


def forward_backward(job: Job, batches: list[list[int]], strategy: Strategy) -> tuple[dict[str, float], int]:
    """The forward and backward passes of one step's micro-``batches`` of row indices (this rank takes its
    share of each), the loss the mean over every rank's rows or tokens. Returns the step's statistics (the
    mean over ranks) and this rank's throughput count."""
    shares = [strategy.share(b) for b in batches]
    divisor = strategy.token_mean_divisor(torch.tensor(sum(job.count(i) for i, real in shares if real)))
    stats, count = dict.fromkeys(job.stat_keys, 0.0), 0
    for j, (rows, real) in enumerate(shares):
        with strategy.accumulating([job.trained], sync=j == len(shares) - 1):
            loss, st, n = job.loss(rows, divisor)
            if not real:  # a stand-in share (a short last batch): same forwards, weight 0
                loss, st, n = loss * 0.0, {}, 0
            strategy.backward([(job.trained, loss)])
        for k, v in st.items():
            stats[k] += v
        count += n
    return strategy.mean_over_ranks(stats), count


def step_extras(job: Job, rate: float, skipped: SkippedSteps) -> dict[str, float]:
    """What a log line adds to the window's means: the learning rate, the skipped steps, the throughput."""
    lr = job.trained.scheduler.get_last_lr()[0]
    extra = {f"{job.name}/lr": lr, f"{job.name}/skipped_steps": skipped.total}
    return extra | {f"perf/{job.unit}_per_s": rate}


def run(job: Job, cfg: SupervisedConfig, strategy: Strategy, run_dir: Path, resume: bool) -> dict:
    """Train ``job`` in ``run_dir`` (metrics, checkpoints) for :func:`steps_of` steps. Returns ``{"step",
    <name>/<stat> of the last log line, the last evaluation}``, or ``{"stopped": True, "step"}`` after a
    signal (the checkpoint is written)."""
    main, desc = strategy.is_main, job.desc or job.name
    trained = {next(iter(job.modules)): job.trained}  # checkpoints name the optimiser after its model
    n_steps = steps_of(cfg, job.n_rows)
    step, stream, window, skipped, tracker = start(job, cfg, strategy, run_dir, resume, trained)
    summary: dict[str, float] = {}
    if step == 0:  # the starting point of the curves
        sizes = derived_sizes(cfg, strategy.world) | {"total_optimizer_steps": n_steps}
        tracker.log(0, {f"sizes/{k}": v for k, v in sizes.items()} | job.evaluate())

    def save() -> None:
        js = {
            "data": stream.state(),
            "window": window.state(),
            "nonfinite": skipped.state(),
            "config": to_dict(cfg),
        }
        strategy.save_checkpoint(run_dir, step, trained, job.modules, js, cfg.keep_last)

    bar = progress(n_steps, desc, cfg.progress and main, step)
    t0 = time.perf_counter()
    with GracefulStop() as stop:
        while step < n_steps:
            # 1. forward and backward of the step's micro-batches (each rank its share), loss = global mean
            stats, count = forward_backward(job, [stream.next() for _ in range(cfg.grad_accum)], strategy)
            # 2. the optimiser step, unless the loss or a gradient is NaN/Inf on any rank
            taken = strategy.optimizer_step([job.trained], finite=math.isfinite(stats[job.stat_keys[0]]))
            step += 1
            bar.update(1)
            window.add(stats if taken else None, int(strategy.batch_sums({"count": count})["count"]))
            if not taken and main:
                print(
                    f"shifu {desc}: step {step}: non-finite loss or gradient, step skipped", file=sys.stderr
                )
            skipped.record(taken)
            try:
                skipped.check(f"step {step}", run_dir, "check the data")
            except ShifuError:
                bar.close(), tracker.close()
                raise
            # 3. log the window, evaluate, checkpoint
            if step % cfg.log_every == 0 or step == n_steps:
                last = {f"{job.name}/{k}": v for k, v in window.means().items()}
                rate = window.count / max(time.perf_counter() - t0, 1e-9)
                tracker.log(step, last | step_extras(job, rate, skipped))
                summary.update(last)
                bar.set_postfix({k.split("/")[1]: f"{v:.3f}" for k, v in list(last.items())[:2]})
                window, t0 = Window(job.stat_keys), time.perf_counter()
            due = bool(cfg.eval.every) and step % cfg.eval.every == 0
            if (due or step == n_steps) and (step < n_steps or job.eval_at_end):
                metrics = job.evaluate()
                tracker.log(step, metrics)
                summary.update(metrics)
            stopping = strategy.any_true(stop.requested)  # a signal seen by any rank stops every rank here
            if (cfg.save_every and (step % cfg.save_every == 0 or step == n_steps)) or stopping:
                save()
            if stopping and step < n_steps:
                bar.close(), tracker.close()
                if main:
                    announce_stop(job.name, f"step {step}", cfg.out_dir)
                return {"stopped": True, "step": step}
    bar.close()
    tracker.close()
    return {"step": step, **summary}


def train_policy(
    job: Job,
    cfg: SupervisedConfig,
    strategy: Strategy,
    resume: bool,
    overwrite: bool,
    bf16: bool,
    policy: tuple[nn.Module, Callable[[], nn.Module], Any],
    closing: Callable[[dict], str],
) -> dict:
    """A policy trainer's run once its :class:`Job` is built (sft, dpo): :func:`run` in the run directory
    (``--resume`` continues its latest checkpoint); then, unless it stopped, ``bf16`` (the precision the update
    ran in) in the summary, the policy in ``final/`` loadable by transformers (``policy`` = (model as trained,
    ``fresh()`` for an unsharded copy, tokenizer); rank 0 writes, sharded weights gathered first),
    ``summary.json``, the model card and the closing line ``closing(summary)`` with the model's directory."""
    run_dir = common.prepare_run(cfg, strategy, resume, overwrite, length(cfg, job.n_rows))
    summary = run(job, cfg, strategy, run_dir, resume)
    if summary.get("stopped"):
        return summary
    if cfg.bf16:
        summary["precision/bf16_update"] = float(bf16)
    model, fresh, tokenizer = policy
    common.save_policy(strategy, model, fresh, tokenizer, run_dir / "final")
    line = f"{closing(summary)}; model in {run_dir / 'final'}"
    return common.finish_run(run_dir, summary, strategy, job.name, line)

"""Stage 1, ``shifu sft``: supervised fine-tuning on (prompt, response) demonstrations.

Loss: mean next-token negative log-likelihood over the response tokens of the whole (accumulated) batch,
EOS included; prompt and padding positions are masked out. Output: ``OUT/final/``, an HF model +
tokenizer directory (``AutoModelForCausalLM.from_pretrained`` loads it).

The resume helpers here (``SAFE_RESUME_KEYS``, :func:`restore`) are shared with the reward-model trainer,
and so are the torchrun helpers (:func:`run_device`, :func:`prepare_run_dir_main`, :func:`rank_slice`,
:func:`save_distributed`, :func:`restore_distributed`).

Under ``torchrun`` (``distributed.strategy=ddp|fsdp2``): ``batch_size`` stays the *global* micro-batch;
each of the W ranks takes the strided slice ``batch[rank::W]`` of it and divides its masked NLL sum by
``N_global / W`` (``shifu.distributed.token_mean_divisor``), so the averaged gradient is the 1-process
token mean over the whole global batch. Metrics are reduced once per step; only rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shifu import checkpoint as ckpt
from shifu import distributed as D
from shifu.config import opt, to_dict
from shifu.core import log_probs_from_logits, masked_sum
from shifu.data import BatchStream, DataConfig, collate_sft, encode_sft, load_train_eval
from shifu.distributed import DistributedConfig
from shifu.errors import ConfigError, ShifuError
from shifu.models import load_causal_lm, load_tokenizer
from shifu.tracking import Tracker, progress
from shifu.trainers.common import (
    GracefulStop,
    OptimConfig,
    announce_stop,
    apply_step,
    autocast,
    build_optimizer,
    build_scheduler,
    count_nonfinite,
    grads_finite,
    seed_everything,
    validate_loop_fields,
    write_config,
)

# config keys a resumed run may change (everything else must match the checkpoint's config)
SAFE_RESUME_KEYS = (
    "out_dir",
    "max_steps",
    "epochs",
    "save_every",
    "eval_every",
    "keep_last",
    "log_every",
    "progress",
    "tensorboard",
    "max_nonfinite_steps",
)


@dataclasses.dataclass
class ModelConfig:
    path: str = opt("", "policy to fine-tune: a local HF causal LM directory (any architecture)")
    tokenizer: str = opt("", "tokenizer directory; empty: the model's own")
    trust_remote_code: bool = opt(False, "allow custom model code shipped in the model directory")


@dataclasses.dataclass
class Config:
    out_dir: str = opt("", "run directory: metrics.jsonl, tb/, checkpoints/, final/ (the fine-tuned model)")
    seed: int = opt(0, "seed of initialisation-independent randomness: shuffling, dropout")
    model: ModelConfig = opt(ModelConfig(), "the model to fine-tune")
    data: DataConfig = opt(DataConfig(), "training and held-out data (kind: sft rows)")
    optim: OptimConfig = opt(OptimConfig(), "AdamW and learning-rate schedule")
    batch_size: int = opt(8, "sequences per micro-batch")
    grad_accum: int = opt(1, "micro-batches per optimiser step (loss = token mean over all of them)")
    epochs: float = opt(1.0, "passes over the training data (used when max_steps is 0)")
    max_steps: int = opt(0, "optimiser steps; 0: derived from epochs")
    eval_every: int = opt(0, "held-out loss every N steps; 0: only at the end")
    eval_batch_size: int = opt(16, "sequences per held-out forward pass")
    save_every: int = opt(0, "checkpoint every N steps (for --resume); 0: none")
    keep_last: int = opt(2, "checkpoints kept")
    log_every: int = opt(10, "training metrics averaged and logged every N steps")
    bf16: bool = opt(False, "bf16 autocast for forward passes (weights and optimiser stay fp32)")
    max_nonfinite_steps: int = opt(
        5, "stop after this many consecutive steps with a NaN/Inf loss or gradient (each one is skipped)"
    )
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    progress: bool = opt(True, "show a progress bar on stderr")
    tensorboard: bool = opt(True, "also write TensorBoard scalars to OUT/tb")
    distributed: DistributedConfig = opt(
        DistributedConfig(), "torchrun: ddp or fsdp2 for the policy (batch_size stays global)"
    )

    def validate(self) -> None:
        if not self.out_dir:
            raise ConfigError("out_dir is required: pass --out DIR or out_dir=DIR")
        if not self.model.path:
            raise ConfigError("model.path is required: a local HF causal LM directory")
        self.data.validate()
        self.optim.validate()
        validate_distributed(self.distributed, self.batch_size, "sequences")
        validate_loop_fields(self)


def validate_distributed(dcfg: DistributedConfig, batch_size: int, unit: str) -> None:
    """The ``distributed`` section of sft/rm: ddp or fsdp2, and a global ``batch_size`` that the
    processes split evenly."""
    dcfg.validate()
    if dcfg.strategy == "deepspeed":
        raise ConfigError(
            "distributed.strategy=deepspeed is supported by `shifu ppo` only; use ddp or fsdp2 here"
        )
    world = D.planned_world_size()
    if batch_size % world:
        raise ConfigError(
            f"batch_size={batch_size} is the global number of {unit} per micro-batch: it must be a multiple "
            f"of the {world} processes (each takes batch_size / {world}); e.g. batch_size="
            f"{world * max(1, batch_size // world)}"
        )


def run_device(dcfg: DistributedConfig, name: str) -> torch.device:
    """This process's device. Under torchrun (WORLD_SIZE > 1) it first joins the process group (gloo on
    CPU, NCCL on GPU) and returns ``cuda:LOCAL_RANK`` or the CPU; otherwise ``resolve_device(name)``."""
    if D.planned_world_size() > 1:
        return D.init(timeout_s=dcfg.timeout_s)
    return resolve_device(name)


def prepare_run_dir_main(out_dir: str, resume: bool, overwrite: bool) -> Path:
    """``ckpt.prepare_run_dir`` on rank 0 only; its error (a ShifuError) is raised on every rank, so no
    rank waits forever for a rank that stopped."""
    if D.world_size() == 1:
        return ckpt.prepare_run_dir(out_dir, resume, overwrite)
    answer: Any = None
    if D.is_main():
        try:
            answer = str(ckpt.prepare_run_dir(out_dir, resume, overwrite))
        except ShifuError as e:
            answer = e
    answer = D.broadcast_object(answer)
    if isinstance(answer, ShifuError):
        raise answer
    return Path(answer)


def rank_slice(batch: list, world: int, rank: int) -> tuple[list, bool]:
    """``(this rank's items, real)``: the strided slice ``batch[rank::world]`` of a global micro-batch.

    A rank left without items (a last batch of an epoch smaller than ``world``) gets the batch's first item
    with ``real=False``: it must still run its forward/backward (DDP all-reduces, FSDP2 all-gathers) but
    with weight 0.
    """
    mine = batch[rank::world]
    return (mine, True) if mine else (batch[:1], False)


def save_distributed(
    run_dir: Path,
    step: int,
    name: str,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    json_state: dict[str, Any],
    keep_last: int,
) -> None:
    """A checkpoint under torchrun; call on every rank.

    DDP: rank 0 writes the plain weights, optimiser and schedule (identical on every rank). FSDP2: every
    rank writes its weight and optimiser shards (``shifu.distributed.save_sharded``) into a hidden
    directory that rank 0 adopts as ``sharded/`` (``ckpt.save_checkpoint_with_shards``). Each rank's RNG
    state is kept (``rng_ranks``).
    """
    json_state = {**json_state, "rng_ranks": D.gather_object(ckpt.rng_state())}
    if D.is_sharded(model):
        shards = run_dir / ckpt.CKPT_DIR / f".shards-step-{step:08d}"
        D.save_sharded(shards / name, model, optimizer)
        D.barrier()
        if D.is_main():
            ckpt.save_checkpoint_with_shards(
                run_dir, step, {}, {"scheduler": scheduler.state_dict()}, json_state, keep_last, shards=shards
            )
    elif D.is_main():
        ckpt.save_checkpoint(
            run_dir,
            step,
            {name: D.unwrap(model)},
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            json_state,
            keep_last=keep_last,
        )
    D.barrier()


def restore_distributed(
    run_dir: Path, cfg, name: str, model: torch.nn.Module, optimizer, scheduler
) -> dict[str, Any] | None:
    """:func:`restore` of the trained model ``name``, in one process or under torchrun (every rank): plain
    weights into a DDP model, or the DCP shards into an FSDP2 model and its optimiser; this rank's RNG
    state when the checkpoint has one per rank."""
    if D.world_size() == 1:
        return restore(run_dir, cfg, {name: model}, optimizer, scheduler)
    path = ckpt.latest_checkpoint(run_dir)
    if path is None:
        return None
    if not D.is_sharded(model):
        state = restore(run_dir, cfg, {name: D.unwrap(model)}, optimizer, scheduler)
    else:
        if not (path / "sharded" / name).is_dir():
            raise ShifuError(
                f"checkpoint '{path}' has no sharded weights for '{name}': it was written without "
                "distributed.strategy=fsdp2; resume it with the strategy it was written with"
            )
        tensor_state, state = ckpt.load_checkpoint(path, {})
        changed = [k for k in ckpt.config_diff(state["config"], to_dict(cfg)) if k not in SAFE_RESUME_KEYS]
        if changed:
            raise ConfigError(
                f"cannot resume '{run_dir}' with a changed config: {', '.join(changed)} differ from the "
                f"checkpoint. Only {', '.join(SAFE_RESUME_KEYS)} may change; restore the others"
            )
        D.load_sharded(path / "sharded" / name, model, optimizer)
        scheduler.load_state_dict(tensor_state["scheduler"])
    ranks = state.get("rng_ranks")
    ckpt.set_rng_state(ranks[D.rank()] if ranks and len(ranks) == D.world_size() else state["rng"])
    return state


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def total_steps(n_batches_per_epoch: int, grad_accum: int, epochs: float, max_steps: int) -> int:
    """Optimiser steps of the run: ``max_steps``, else ``ceil(epochs * batches_per_epoch / grad_accum)``."""
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(epochs * n_batches_per_epoch / grad_accum))


def restore(
    run_dir: Path, cfg, modules: dict[str, torch.nn.Module], optimizer, scheduler
) -> dict[str, Any] | None:
    """Load the latest checkpoint of ``run_dir`` into modules/optimizer/scheduler and the RNGs.

    Returns its json state (``step``, ``data`` position, ...) or None when there is none. Refuses a
    config that differs from the checkpoint's outside :data:`SAFE_RESUME_KEYS`, naming the keys.
    """
    path = ckpt.latest_checkpoint(run_dir)
    if path is None:
        return None
    tensor_state, state = ckpt.load_checkpoint(path, modules)
    changed = [k for k in ckpt.config_diff(state["config"], to_dict(cfg)) if k not in SAFE_RESUME_KEYS]
    if changed:
        raise ConfigError(
            f"cannot resume '{run_dir}' with a changed config: {', '.join(changed)} differ from the checkpoint. "
            f"Only {', '.join(SAFE_RESUME_KEYS)} may change; restore the others or start a new run"
        )
    optimizer.load_state_dict(tensor_state["optimizer"])
    scheduler.load_state_dict(tensor_state["scheduler"])
    ckpt.set_rng_state(state["rng"])
    return state


def report_counts(path: str, counts: dict[str, int]) -> None:
    """Tell the user about dropped/truncated rows (never silent; once, from rank 0, under torchrun)."""
    if counts and D.is_main():
        print(
            f"shifu: {path}: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items()),
            file=sys.stderr,
        )


@torch.no_grad()
def evaluate(model, examples: list[dict], pad_id: int, batch_size: int, device, bf16: bool) -> float:
    """Token-mean NLL of the response tokens of ``examples`` (the held-out loss).

    Under torchrun each rank scores its strided share of every ``batch_size`` chunk (every rank runs the
    same number of forwards) and the sums and counts are added over ranks: every rank returns the loss of
    the whole set."""
    model.eval()
    total, count = 0.0, 0
    world, rank = D.world_size(), D.rank()
    for i in range(0, len(examples), batch_size):
        mine, real = rank_slice(examples[i : i + batch_size], world, rank)
        nll_sum, n = sft_nll_sum(model, collate_sft(mine, pad_id), device, bf16)
        if real:
            total, count = total + float(nll_sum), count + n
    model.train()
    if world > 1:
        summed = D.reduce_metrics({"total": total, "count": count}, op="sum")
        total, count = summed["total"], int(summed["count"])
    return total / max(count, 1)


def sft_nll_sum(model, batch: dict[str, torch.Tensor], device, bf16: bool) -> tuple[torch.Tensor, int]:
    """(sum of response-token NLL, number of response tokens) of one right-padded batch."""
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    target_mask = batch["loss_mask"][:, 1:].to(device)  # (B, T-1): token t+1 is a response token
    with autocast(bf16, device):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    log_probs = log_probs_from_logits(logits[:, :-1].float(), input_ids[:, 1:])  # (B, T-1)
    return -masked_sum(log_probs, target_mask), int(target_mask.sum())


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict[str, float]:
    """Run SFT as ``cfg`` says; returns the final metrics (``eval/sft/loss``, ``sft/loss``)."""
    # 1. data: read and validate everything before the output directory is touched
    train_rows, eval_rows = load_train_eval(cfg.data, "sft")
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
    d = cfg.data
    train_ex, counts = encode_sft(tokenizer, train_rows, d.max_prompt_len, d.max_len, d.prompt_policy)
    eval_ex, eval_counts = encode_sft(tokenizer, eval_rows, d.max_prompt_len, d.max_len, d.prompt_policy)
    report_counts(d.train, counts)
    report_counts(d.eval or d.train + " (held out)", eval_counts)
    if not train_ex or not eval_ex:
        raise ConfigError("no SFT examples left after the prompt policy; raise data.max_prompt_len")

    # 2. model, optimiser, schedule
    seed_everything(cfg.seed)  # the same seed on every rank: the same model, the same data order
    device = run_device(cfg.distributed, cfg.device)
    world, rank, main = D.world_size(), D.rank(), D.is_main()
    model = load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code).to(device)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
    model.train()
    if cfg.distributed.gradient_checkpointing:
        D.enable_gradient_checkpointing(model)
    if world > 1:
        model = D.wrap_trainable(model, cfg.distributed.strategy)  # before the optimiser (FSDP2 shards)
        torch.manual_seed(D.rank_seed(cfg.seed))  # dropout: a different stream per rank
    stream = BatchStream(len(train_ex), cfg.batch_size, cfg.seed)  # global micro-batches
    n_steps = total_steps(stream.batches_per_epoch(), cfg.grad_accum, cfg.epochs, cfg.max_steps)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, n_steps)

    # 3. run directory (rank 0); resume from its latest checkpoint
    run_dir = prepare_run_dir_main(cfg.out_dir, resume, overwrite)
    step = 0
    state = None
    if resume:
        state = restore_distributed(run_dir, cfg, "policy", model, optimizer, scheduler)
    if state is not None:
        step = state["step"]
        stream = BatchStream(len(train_ex), cfg.batch_size, cfg.seed, **state["data"])
    if main:
        write_config(run_dir, cfg)
    tracker = Tracker(
        run_dir,
        enabled=main,
        tensorboard=cfg.tensorboard,
        resume_step=step if state else (-1 if resume else None),
    )  # -1: --resume without a checkpoint starts over and drops old lines
    if world > 1 and state is None:  # the per-rank sizes are derived, never written into the config
        sizes = {"sizes/world_size": world, "sizes/batch_size_per_rank": cfg.batch_size // world}
        tracker.log(0, sizes)
        D.print0(
            f"shifu sft: {world} processes, {cfg.batch_size // world} sequences per rank per micro-batch"
        )

    # 4. the loop: each step = grad_accum micro-batches, loss = token mean over all of them
    bar = progress(n_steps, "sft", enabled=cfg.progress and main, initial=step)
    # metrics accumulated since the last log line (checkpointed, so a resumed run logs the same numbers)
    window: dict[str, float] = state["window"] if state else {"loss": 0.0, "tokens": 0, "steps": 0}
    # steps skipped for a NaN/Inf loss or gradient: in total, and in a row (both checkpointed)
    nonfinite = state.get("nonfinite", [0, 0]) if state else [0, 0]
    summary: dict[str, float] = {}
    if step == 0:  # the starting point of the held-out curve
        eval_loss = evaluate(model, eval_ex, tokenizer.pad_token_id, cfg.eval_batch_size, device, cfg.bf16)
        tracker.log(0, {"eval/sft/loss": eval_loss})

    def save() -> None:
        json_state = {
            "data": stream.state(),
            "window": window,
            "nonfinite": nonfinite,
            "rng": ckpt.rng_state(),
            "config": to_dict(cfg),
        }
        if world > 1:
            save_distributed(run_dir, step, "policy", model, optimizer, scheduler, json_state, cfg.keep_last)
            return
        ckpt.save_checkpoint(
            run_dir,
            step,
            {"policy": model},
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            json_state,
            keep_last=cfg.keep_last,
        )

    t0 = time.perf_counter()
    with GracefulStop() as stop:
        while step < n_steps:
            # global micro-batches; under torchrun this rank's strided share of each (real=False: an empty
            # share, replaced by a weight-0 stand-in so every rank runs the same forwards)
            shares = [rank_slice(stream.next(), world, rank) for _ in range(cfg.grad_accum)]
            batches = [collate_sft([train_ex[i] for i in idx], tokenizer.pad_token_id) for idx, _ in shares]
            real = [r for _, r in shares]
            n_tokens = sum(int(b["loss_mask"][:, 1:].sum()) for b, r in zip(batches, real) if r)
            # 1 process: the token count of the step; W ranks: N_global / W (DDP/FSDP2 average gradients)
            divisor = max(n_tokens, 1) if world == 1 else D.token_mean_divisor(torch.tensor(float(n_tokens)))
            step_loss = 0.0
            for j, batch in enumerate(batches):
                with D.grad_sync(model, j == len(batches) - 1):  # all-reduce once, on the last micro-batch
                    nll_sum, _ = sft_nll_sum(model, batch, device, cfg.bf16)
                    loss = nll_sum / divisor if real[j] else nll_sum * 0.0
                    loss.backward()
                step_loss += float(loss.detach())
            finite = grads_finite(model, step_loss)
            tokens = sum(int(b["attention_mask"].sum()) for b, r in zip(batches, real) if r)
            synced_stop = False
            if world > 1:  # one collective per step: global loss, skip and stop decisions, throughput
                g = D.reduce_metrics(
                    {
                        "loss": step_loss,
                        "finite": float(finite),
                        "stop": float(stop.requested),
                        "tokens": tokens,
                    }
                )
                step_loss, finite, synced_stop = g["loss"], g["finite"] == 1.0, g["stop"] > 0
                tokens = round(g["tokens"] * world)
            apply_step(model, optimizer, scheduler, cfg.optim.max_grad_norm, finite)
            if finite:
                window["loss"] += step_loss
                window["steps"] += 1
            step += 1
            bar.update(1)
            window["tokens"] += tokens
            error = count_nonfinite(nonfinite, finite, "sft", step, cfg.max_nonfinite_steps, run_dir, main)
            if error:
                bar.close(), tracker.close()
                raise error

            if step % cfg.log_every == 0 or step == n_steps:
                elapsed = time.perf_counter() - t0
                metrics = {
                    "sft/loss": window["loss"] / window["steps"] if window["steps"] else float("nan"),
                    "sft/lr": scheduler.get_last_lr()[0],
                    "sft/skipped_steps": nonfinite[0],
                    "perf/tokens_per_s": window["tokens"] / max(elapsed, 1e-9),
                }
                tracker.log(step, metrics)
                summary["sft/loss"] = metrics["sft/loss"]
                bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
                window, t0 = {"loss": 0.0, "tokens": 0, "steps": 0}, time.perf_counter()
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == n_steps:
                eval_loss = evaluate(
                    model, eval_ex, tokenizer.pad_token_id, cfg.eval_batch_size, device, cfg.bf16
                )
                tracker.log(step, {"eval/sft/loss": eval_loss})
                summary["eval/sft/loss"] = eval_loss
            # under torchrun: a signal seen by any rank at this step's collective stops every rank here
            stopping = stop.requested if world == 1 else synced_stop
            if (cfg.save_every and (step % cfg.save_every == 0 or step == n_steps)) or stopping:
                save()
            if stopping and step < n_steps:
                bar.close(), tracker.close()
                if main:
                    announce_stop("sft", f"step {step}", run_dir)
                return {"stopped": True, "step": step}
    bar.close()
    tracker.close()

    # 5. the fine-tuned model, loadable by transformers (rank 0 writes; FSDP2 shards are gathered first)
    if world == 1:
        ckpt.save_hf_dir(model, tokenizer, run_dir / "final")
    else:
        save_final_policy(model, cfg, tokenizer, run_dir / "final")
    if main:
        (run_dir / "summary.json").write_text(
            json.dumps({"step": step, **summary}, indent=2), encoding="utf-8"
        )
        print(
            f"shifu sft: {step} steps, eval/sft/loss {summary.get('eval/sft/loss', float('nan')):.4f}; "
            f"model in {run_dir / 'final'}",
            file=sys.stderr,
        )
    D.barrier()
    return summary


def save_final_policy(model: torch.nn.Module, cfg: Config, tokenizer, path: Path) -> None:
    """The trained policy as an HF directory, written by rank 0 (call on every rank under torchrun).

    DDP: rank 0 saves its replica. FSDP2: the full state dict is gathered on rank 0 and loaded into a plain
    CPU copy of ``model.path`` (embeddings resized like the trained one) before saving.
    """
    if D.is_sharded(model):
        sd = D.full_state_dict(model)
        if D.is_main():
            plain = load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
            if len(tokenizer) > plain.get_input_embeddings().num_embeddings:
                plain.resize_token_embeddings(len(tokenizer))
            plain.load_state_dict(sd)
            ckpt.save_hf_dir(plain, tokenizer, path)
    elif D.is_main():
        ckpt.save_hf_dir(D.unwrap(model), tokenizer, path)
    D.barrier()

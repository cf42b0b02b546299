"""Stage 2, ``shifu rm``: a Bradley-Terry reward model on (prompt, chosen, rejected) pairs.

Loss ``-log sigmoid(r_c - r_r - margin) + center_coef * mean((r_c + r_r)^2) + l2_coef * ||w||^2`` (``w``: the
backbone's trainable weights; the ridge term is for the bag-of-tokens backbone), with
``r`` the scalar head at the last real token of ``ScalarModel.encode(prompt, response)`` (the same
tokenisation PPO scores with); the step's loss is the mean over its pairs. Held-out report: accuracy,
margin, chosen/rejected means, and the length-bias check (Pearson correlation of score with response length
in characters; accuracy on pairs whose chosen response is shorter vs longer than the rejected one).

Output: ``OUT/final/`` (``ScalarModel.from_pretrained``); with ``ensemble.k > 1`` each member in
``OUT/member-<m>/`` (its own metrics and checkpoints, model in ``final/``) and ``OUT/final/ensemble.json``.
Either loads with :func:`shifu.rewards.ensemble.load_reward`. After training, gain/bias are fitted (when
``normalize.responses`` or ``normalize.policy`` is set) so normalisation-set scores have mean 0, std 1. The
loop (resume, signals, cadence, skipped steps) is :mod:`shifu.trainers.loop`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shifu.config.schema import RMConfig, check_world_size
from shifu.core import bradley_terry_loss
from shifu.data.batches import encode_reward_pairs
from shifu.data.rows import load_rows, load_train_eval
from shifu.errors import ConfigError
from shifu.models.loading import (
    check_length,
    load_tokenizer,
    require_model_dir,
    resolve_backbone,
)
from shifu.models.padding import pad_right
from shifu.models.scalar import ScalarModel
from shifu.parallel import build_strategy
from shifu.parallel.strategy import Strategy
from shifu.rewards.ensemble import RewardEnsemble, write_manifest
from shifu.runs import jsonfile
from shifu.trainers import common, loop
from shifu.trainers.common import autocast, prepare_run, report_counts, seed_everything
from shifu.trainers.reward_normalise import normalisation_rows, normalise

Config = RMConfig
STATS = ("loss", "accuracy", "margin")


def pair_scores(model, pairs: list[dict], pad_id: int, device, bf16: bool, plain=None):
    """(N,), (N,) scores of the chosen and rejected sides, in one forward over 2N sequences. ``plain``:
    the ScalarModel inside ``model`` when ``model`` is a wrapper (training forwards go through it)."""
    batch = pad_right([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with autocast(bf16, device):
        scores = (
            model.score(ids, mask) if plain is None else plain.read_score(model(ids, mask), mask)
        ).float()
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def evaluate(scorer, pairs: list[dict], cfg: RMConfig, strategy: Strategy) -> dict:
    """Held-out report: ``eval/rm/{accuracy, margin, chosen_mean, rejected_mean, len_corr, acc_chosen_*}``.

    ``scorer``: a ScalarModel or an ensemble. Each rank scores its share of every ``eval.batch_size`` chunk
    and the scores of all ranks are gathered: every rank computes the same report."""
    scorer = strategy.unwrap(scorer)
    was_training = scorer.training
    scorer.eval()
    pad, mine = scorer.tokenizer.pad_token_id, []  # (pair index, chosen, rejected)
    for i in range(0, len(pairs), cfg.eval.batch_size):
        idx, real = strategy.share(list(range(i, min(i + cfg.eval.batch_size, len(pairs)))))
        c, r = pair_scores(scorer, [pairs[j] for j in idx], pad, strategy.device, cfg.bf16)
        if real:
            mine += zip(idx, c.cpu().tolist(), r.cpu().tolist())
    scorer.train(was_training)
    everything = sorted(x for part in strategy.gather(mine) for x in part)
    chosen = torch.tensor([x[1] for x in everything], dtype=torch.float)
    rejected = torch.tensor([x[2] for x in everything], dtype=torch.float)
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
    cfg: RMConfig,
    strategy: Strategy,
    model: ScalarModel,
    fresh,
    member: int,
    run_dir: Path,
    pairs,
    eval_pairs,
    resume,
):
    """Train ``model``, member ``member`` (seed ``seed + member``), in ``run_dir``. Returns ``(its last
    training metrics, a plain copy of it on every rank)`` (``fresh()`` builds an untrained copy)."""
    seed = cfg.seed + member
    seed_everything(seed)
    model.to(strategy.device).train()
    wrapped = strategy.wrap(model)  # before the optimiser (FSDP2 shards the parameters)
    strategy.seed_per_rank(seed)  # dropout: a different stream per rank
    trained = strategy.optimize(wrapped, wrapped.parameters(), cfg.optim, loop.steps_of(cfg, len(pairs)))
    pad = model.tokenizer.pad_token_id
    ridge = [p for p in model.backbone.parameters() if p.requires_grad] if cfg.l2_coef else []

    def loss(rows: list[int], divisor: torch.Tensor):
        batch = [pairs[i] for i in rows]
        chosen, rejected = pair_scores(wrapped, batch, pad, strategy.device, cfg.bf16, plain=model)
        margin = torch.tensor([p["margin"] for p in batch], device=strategy.device)
        loss, st = bradley_terry_loss(chosen, rejected, margin if margin.any() else None, cfg.center_coef)
        loss = loss + cfg.l2_coef * sum(p.pow(2).sum() for p in ridge)  # summed shares: one per step
        w = len(batch) / float(divisor)  # this micro-batch's share of the step's pairs
        return (
            loss * len(batch) / divisor,
            {k: w * float(v) for k, v in (("loss", loss.detach()), *st.items())},
            len(batch),
        )

    job = loop.Job(
        name="rm",
        trained=trained,
        modules={"rm": model},
        n_rows=len(pairs),
        stat_keys=STATS,
        count=len,
        loss=loss,
        evaluate=lambda: evaluate(wrapped, eval_pairs, cfg, strategy),
        unit="pairs",
        seed=seed,
        desc="rm" if cfg.ensemble.k == 1 else f"rm member {member}",
        eval_at_end=False,  # the final report comes after the normalisation fit
        lengths=[max(len(p["chosen"]), len(p["rejected"])) for p in pairs],
    )
    stats = loop.run(job, cfg, strategy, run_dir, resume)
    stats = {k: v for k, v in stats.items() if k in ("step", "stopped") or k.startswith("rm/")}
    return stats, strategy.full_model(wrapped, fresh, everywhere=True).eval()


def train_members(cfg: RMConfig, strategy: Strategy, first: ScalarModel, fresh, run_dir: Path, pairs, resume):
    """Train the ``ensemble.k`` members, each in its own run directory (the top one when k == 1; rank 0
    writes), on the training ``pairs[0]`` (shard ``m::k`` of them with ``ensemble.shard``); ``first`` is
    member 0, ``fresh(m)`` builds member m. A member finished before an interruption is loaded. Returns
    ``(models, their final/ directories, their stats)``; a signal stops at the member it interrupts, whose
    stats say ``stopped``."""
    k, (train_pairs, eval_pairs) = cfg.ensemble.k, pairs
    members, member_dirs, member_stats = [], [], []
    for m in range(k):
        mdir = run_dir if k == 1 else run_dir / f"member-{m}"
        mdir.mkdir(exist_ok=True)
        done = mdir / "final" / "summary.json"
        if resume and done.exists():  # finished before the interruption
            model, stats = ScalarModel.from_pretrained(mdir / "final"), json.loads(done.read_text())
        else:
            mine = train_pairs[m::k] if cfg.ensemble.shard else train_pairs
            model = first if m == 0 else fresh(m)
            stats, model = train_member(
                cfg, strategy, model, lambda m=m: fresh(m), m, mdir, mine, eval_pairs, resume
            )
            if stats.get("stopped"):  # SIGINT/SIGTERM: checkpointed; --resume continues this member
                return members, member_dirs, [*member_stats, stats]
            if k > 1 and strategy.is_main:
                model.save_pretrained(mdir / "final")  # unnormalised; rewritten below after the fit
                (mdir / "final" / "summary.json").write_text(jsonfile.dumps(stats), encoding="utf-8")
        members.append(model)
        member_dirs.append(mdir / "final")
        member_stats.append(stats)
    return members, member_dirs, member_stats


def log_final_report(cfg: RMConfig, run_dir: Path, strategy: Strategy, step: int, report: dict, resume: bool):
    """The final model's held-out ``report`` logged at ``step``, once: a resumed run drops the one a run
    killed after logging it wrote."""
    metrics_file = run_dir / "metrics.jsonl"
    if strategy.is_main and resume and metrics_file.exists():
        jsonfile.keep_rows(metrics_file, lambda r: not (r["step"] == step and set(report) <= set(r)))
    tracker = common.tracker(cfg, run_dir, strategy)
    tracker.log(step, report)
    tracker.close()


def train(cfg: RMConfig, resume: bool = False, overwrite: bool = False) -> dict[str, float]:
    """Train ``ensemble.k`` reward models; returns ``rm/*`` (train) and ``eval/rm/*`` (held-out) metrics."""
    strategy = build_strategy(cfg.distributed)
    # 1. data, fully validated before anything is written
    train_rows, eval_rows = load_train_eval(cfg.data, "preference")
    norm_rows = (
        load_rows(cfg.normalize.responses, "sft", cfg.data.skip_bad) if cfg.normalize.responses else []
    )
    norm_rows = normalisation_rows(norm_rows, cfg.normalize.max_rows, cfg.seed)
    backbone, k = resolve_backbone(cfg.model.path), cfg.ensemble.k
    if cfg.normalize.policy:  # fails now, not after training, on a bad path or damaged weights
        load_tokenizer(cfg.normalize.policy)
        require_model_dir(cfg.normalize.policy, "normalize.policy")

    def fresh(member: int) -> ScalarModel:
        if cfg.model.path == "bag-of-tokens":  # (shifu.models.bag_of_tokens; l2_coef is its ridge penalty)
            return ScalarModel.bag_of_tokens(cfg.model.tokenizer, seed=cfg.seed + member)
        return ScalarModel.from_backbone(
            backbone,
            seed=cfg.seed + member,
            freeze_layers=cfg.freeze_layers,
            keep_layers=cfg.keep_layers,
            trust_remote_code=cfg.model.trust_remote_code,
        )

    first = fresh(0)
    d = cfg.data
    encode = (d.max_len, d.max_prompt_len, d.prompt_policy, d.chat_template)
    train_pairs, counts = encode_reward_pairs(first, train_rows, *encode)
    eval_pairs, eval_counts = encode_reward_pairs(first, eval_rows, *encode)
    if not train_pairs or not eval_pairs:
        raise ConfigError("no preference pairs left after the prompt policy; raise data.max_prompt_len")
    longest = max(len(x[side]) for x in train_pairs + eval_pairs for side in ("chosen", "rejected"))
    check_length(first, longest, d.train)

    # 2. train each member in its own run directory (the top one when k == 1); rank 0 writes
    device = strategy.launch(cfg.device)
    check_world_size(cfg, strategy.world)
    main = strategy.is_main
    report_counts(d.train, counts, main)
    report_counts(d.eval or d.train + " (held out)", eval_counts, main)
    run_dir = prepare_run(cfg, strategy, resume, overwrite, loop.length(cfg, len(train_pairs)))
    lengths = [max(len(x["chosen"]), len(x["rejected"])) for x in train_pairs]
    asked, cfg = cfg, common.with_bf16_decision(cfg, first, lengths, strategy, "rm", pairs=True)
    members, member_dirs, member_stats = train_members(
        cfg, strategy, first, fresh, run_dir, (train_pairs, eval_pairs), resume
    )
    if member_stats[-1].get("stopped"):  # SIGINT/SIGTERM: checkpointed; --resume continues that member
        return member_stats[-1]
    # 3. normalisation: scores of given responses, or of policy samples, get mean 0 and std 1
    if cfg.normalize.responses or cfg.normalize.policy:
        normalise(cfg, members, norm_rows, train_rows, device)
    # 4. save, and report the final (normalised, aggregated) model on the held-out pairs
    if main:
        for model, mdir in zip(members, member_dirs):
            model.save_pretrained(mdir)
        if k > 1:
            write_manifest(run_dir / "final", member_dirs, cfg.ensemble.aggregate, cfg.ensemble.std_coef)
    scorer = members[0] if k == 1 else RewardEnsemble(members, cfg.ensemble.aggregate, cfg.ensemble.std_coef)
    report = evaluate(scorer, eval_pairs, cfg, strategy)
    log_final_report(cfg, run_dir, strategy, max(s["step"] for s in member_stats), report, resume)
    summary = {f"rm/{s}": sum(m.get(f"rm/{s}", float("nan")) for m in member_stats) / k for s in STATS}
    summary.update(report | ({"precision/bf16_update": float(cfg.bf16)} if asked.bf16 else {}))
    acc, margin, corr = (report[f"eval/rm/{k}"] for k in ("accuracy", "margin", "len_corr"))
    common.warn_length_bias(corr, strategy)
    line = f"shifu rm: held-out accuracy {acc:.3f}, margin {margin:.3f}, length corr {corr:.3f}"
    return common.finish_run(run_dir, summary, strategy, "rm", line + f"; model in {run_dir / 'final'}")

"""``shifu ppo``: load the four models and the prompts, then iterate, evaluate, keep the best, checkpoint.

Run directory: ``metrics.jsonl`` and ``tb/`` (every iteration), ``samples.jsonl`` (evaluation samples),
``checkpoints/`` (resume), ``best/`` (actor at the best ``eval.best_metric``), ``final/`` (the actor at the
end, an HF directory), ``critic/`` (the trained critic or value head), ``config.yaml``, ``summary.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from shifu import checkpoint as ckpt
from shifu import distributed as D
from shifu import lora as L
from shifu.config import to_dict
from shifu.errors import ConfigError, ShifuError
from shifu.models import ScalarModel, load_causal_lm, load_tokenizer, pad_left, pad_right
from shifu.rewards import RewardSource, load_function, load_reward_model, same_tokenizer
from shifu.rollout import SamplingParams, policy_forward, sample
from shifu.tracking import Tracker, progress
from shifu.trainers.common import GracefulStop, announce_stop, resolve_device, seed_everything, write_config
from shifu.trainers.ppo import PPOTrainer, new_value_head
from shifu.trainers.ppo_config import Config, derived_sizes

# keys a resumed run may change: they do not alter what the finished iterations computed
SAFE_ON_RESUME = {
    "iterations",
    "save_every",
    "keep_last",
    "eval.every",
    "eval.num_prompts",
    "guard.kl_ceiling",
    "guard.divergence_patience",
    "max_nonfinite_steps",
}


def encode_prompts(
    tok, rows: list[dict], max_len: int, policy: str, path: str
) -> tuple[list[list[int]], list[dict], int]:
    """Token ids of each prompt (no special tokens added), over-long ones truncated from the left or dropped."""
    ids, kept, dropped = [], [], 0
    for r in rows:
        x = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        if not x:
            raise ShifuError(f"{path}: a prompt encodes to zero tokens: {r['prompt']!r}")
        if len(x) > max_len:
            if policy == "drop":
                dropped += 1
                continue
            x = x[-max_len:]
        ids.append(x), kept.append(r)
    if not ids:
        raise ShifuError(f"{path}: no prompts left after applying data.max_prompt_len={max_len} ({policy})")
    return ids, kept, dropped


class PromptStream:
    """Epoch permutations derived from (seed, epoch): the data position is just (epoch, index)."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.bs, self.seed, self.epoch, self.index = n, batch_size, seed, 0, 0

    def _perm(self) -> list[int]:
        return torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        ).tolist()

    def next(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.bs:
            perm = self._perm()
            take = perm[self.index : self.index + self.bs - len(out)]
            out += take
            self.index += len(take)
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out


class _Counted:
    """An iterator that counts the items it served, so a resumed run skips exactly that many (ptx batches)."""

    def __init__(self, it):
        self.it, self.served = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.served += 1
        return next(self.it)


def _ptx_stream(cfg: Config, tok):
    from shifu.data import load_rows, sft_texts

    rows = [sft_texts(tok, r) for r in load_rows(cfg.data.ptx, "sft", skip_bad=cfg.data.skip_bad)]
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    while True:
        for i in torch.randperm(len(rows), generator=gen).tolist():
            chunk = [rows[(i + j) % len(rows)] for j in range(cfg.minibatch_size // cfg.grad_accum)]
            seqs, masks = [], []
            for r in chunk:
                p = tok(r[0], add_special_tokens=False)["input_ids"][-cfg.data.max_prompt_len :]
                resp = tok(r[1], add_special_tokens=False)["input_ids"][: cfg.generation.max_new_tokens]
                seqs.append(p + resp + [tok.eos_token_id])
                masks.append([0] * len(p) + [1] * (len(resp) + 1))
            b = pad_right(seqs, tok.pad_token_id)
            b["loss_mask"] = pad_right(masks, 0)["input_ids"]
            yield b


def build_trainer(cfg: Config, tok, device) -> tuple[PPOTrainer, dict[str, torch.nn.Module]]:
    """Load the four models (plus optimisers and controllers); returns the trainer and its stateful modules
    (the plain models, unwrapped: what a non-sharded checkpoint saves). With LoRA no reference is loaded."""

    def load_actor():
        actor = load_causal_lm(cfg.actor_path, trust_remote_code=cfg.trust_remote_code, dropout=False)
        if cfg.lora.enabled:
            actor = L.wrap_lora(actor, cfg.lora)
            D.print0(f"shifu ppo: LoRA actor, {L.trainable_summary(actor)}; reference = adapters disabled")
        return actor.to(device)

    deepspeed = cfg.distributed.strategy == "deepspeed"
    actor = None if deepspeed else load_actor()  # (the order of loads of a single process is kept)
    ref = None
    if not cfg.lora.enabled:
        ref = load_causal_lm(
            cfg.ref_path or cfg.actor_path, trust_remote_code=cfg.trust_remote_code, dropout=False
        ).to(device)
    if cfg.reward.function:
        reward = RewardSource(function=load_function(cfg.reward.function), micro_batch=cfg.micro_batch_size)
    else:
        rm = load_reward_model(cfg.reward.model_path)
        if isinstance(rm, torch.nn.Module):
            rm = rm.to(device)
        reward = RewardSource(model=rm, policy_tokenizer=tok, micro_batch=cfg.micro_batch_size)
    # ZeRO-3: trained HF models are built straight into shards while this object is alive (frozen ones
    # are loaded before it and after it is dropped: they are not managed by an engine)
    zero3 = D.deepspeed_zero3_init(cfg.distributed.deepspeed_config) if deepspeed else None
    if deepspeed:
        actor = load_actor()
    critic, value_head, init = None, None, cfg.critic.init
    if cfg.algo != "reinforce":
        if init == "reward":
            path = cfg.critic.path or cfg.reward.model_path
            try:
                critic = ScalarModel.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            except ShifuError:
                critic = None
            if critic is None or not critic.is_causal or not same_tokenizer(critic.tokenizer, tok):
                print(
                    "shifu ppo: the reward model cannot be a critic (it needs a causal trunk with the policy's "
                    "tokenizer to value each token); using critic.init=sft",
                    file=sys.stderr,
                )
                init, critic = "sft", None
            else:
                critic.gain.fill_(1.0), critic.bias.fill_(0.0)
        if init == "sft":
            critic = ScalarModel.from_backbone(
                cfg.critic.path or cfg.actor_path, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code
            )
        if init == "shared":
            value_head = new_value_head(actor.config.get_text_config().hidden_size, cfg.seed).to(device)
    if critic is not None:
        from shifu.models import disable_dropout

        critic = disable_dropout(critic).to(device)
    del zero3
    ptx = _Counted(_ptx_stream(cfg, tok)) if cfg.ptx_coef > 0 else None
    trainer = PPOTrainer(
        actor, critic, ref, reward, tok, cfg, value_head=value_head, ptx_batches=ptx, device=device
    )
    modules = {"actor": actor}
    if critic is not None:
        modules["critic"] = critic
    if value_head is not None:
        modules["value_head"] = value_head
    return trainer, modules


@torch.no_grad()
def evaluate(
    trainer: PPOTrainer, ids: list[list[int]], rows: list[dict], gold_fn, cfg: Config
) -> tuple[dict, list]:
    """Held-out prompts, a low-temperature sample each: reward-model score, KL to the reference, gold score.

    ``eval/kl`` is the k1 estimate (nats per response) between the actor and the reference, both with
    logits divided by the evaluation temperature, on the evaluation samples. A private generator makes
    evaluation leave the training RNG untouched.
    """
    tok, T = trainer.tok, cfg.eval.temperature
    gen = torch.Generator().manual_seed(D.rank_seed(cfg.seed + 4242))
    params = SamplingParams(cfg.generation.max_new_tokens, T, cfg.generation.top_k, cfg.generation.top_p)
    trainer.actor.eval()
    W = D.world_size()
    if W > 1:  # every rank evaluates the prompts rank::W, padded (repeats) to the same count: same forwards
        n_all, per = len(ids), -(-len(ids) // W)
        mine = list(range(D.rank(), n_all, W))
        n_mine = len(mine)
        mine += [mine[-1] if mine else 0] * (per - n_mine)
        all_rows = rows
        ids, rows = [ids[i] for i in mine], [rows[i] for i in mine]
    actor = trainer.actor_module
    reuse = trainer.reuses_decode_log_probs(bf16_autocast=False)  # evaluation runs without autocast
    responses, scores, kls = [], [], []
    for i in range(0, len(ids), cfg.micro_batch_size):
        b = pad_left(ids[i : i + cfg.micro_batch_size], tok.pad_token_id)
        pids, pmask = b["input_ids"].to(trainer.device), b["attention_mask"].to(trainer.device)
        out = sample(
            actor,
            pids,
            pmask,
            params,
            tok.eos_token_id,
            tok.pad_token_id,
            generator=gen,
            with_log_probs=reuse,
            **trainer._gen_kwargs(),
        )
        rids, rmask = out.response_ids, out.response_mask
        full, am = torch.cat([pids, rids], 1), torch.cat([pmask, rmask.long()], 1)
        P = pids.shape[1]
        lp = out.log_probs if out.log_probs is not None else policy_forward(actor, full, am, P, T)[0]
        with trainer.reference() as ref:
            ref_lp = policy_forward(ref, full, am, P, T)[0]
        kls.append(((lp - ref_lp) * rmask).sum(1).float().cpu())
        texts = [tok.decode(rids[j][rmask[j]], skip_special_tokens=True) for j in range(len(rids))]
        part_rows = rows[i : i + cfg.micro_batch_size]
        scores.append(trainer.reward([r["prompt"] for r in part_rows], texts, part_rows, full, am).float())
        responses += texts
    scores_t, kl_t = torch.cat(scores), torch.cat(kls)
    if W > 1:  # back to the global order 0..n-1 on every rank (rank r held r, r+W, ...)
        parts = D.gather_object((responses[:n_mine], scores_t[:n_mine].cpu(), kl_t[:n_mine], mine[:n_mine]))
        order = [i for p in parts for i in p[3]]
        rank_of = sorted(range(n_all), key=lambda j: order[j])
        responses = [r for p in parts for r in p[0]]
        responses = [responses[j] for j in rank_of]
        scores_t = torch.cat([p[1] for p in parts])[rank_of]
        kl_t = torch.cat([p[2] for p in parts])[rank_of]
        rows = all_rows
    metrics = {"eval/score": float(scores_t[torch.isfinite(scores_t)].mean()), "eval/kl": float(kl_t.mean())}
    golds = [None] * len(rows)
    if gold_fn is not None:
        golds = [float(g) for g in gold_fn([r["prompt"] for r in rows], responses, rows)]
        metrics["gold/score"] = sum(golds) / len(golds)
    samples = [
        {"prompt": r["prompt"], "response": y, "score": float(s), "gold": g}
        for r, y, s, g in zip(rows, responses, scores_t.tolist(), golds)
    ]
    return metrics, samples


def run(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    from shifu.data import load_rows

    seed_everything(cfg.seed)  # the shared seed on every rank (init, data order); sampling uses rank_seed
    if D.planned_world_size() > 1 or cfg.distributed.strategy == "deepspeed":
        device = D.init(timeout_s=cfg.distributed.timeout_s)
    else:
        device = resolve_device(cfg.device)
    main, W = D.is_main(), D.world_size()
    # 0. validate all input before touching the output directory
    rows = load_rows(cfg.data.prompts, "prompt", skip_bad=cfg.data.skip_bad)
    if cfg.data.eval_prompts:
        eval_rows = load_rows(cfg.data.eval_prompts, "prompt", skip_bad=cfg.data.skip_bad)
    else:
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        n_eval = max(1, int(len(rows) * cfg.data.eval_fraction)) if len(rows) > 1 else 0
        eval_rows, rows = [rows[i] for i in perm[:n_eval]], [rows[i] for i in sorted(perm[n_eval:])]
    tok = load_tokenizer(cfg.actor_path, trust_remote_code=cfg.trust_remote_code)
    tok.padding_side = "left"
    ids, rows, dropped = encode_prompts(
        tok, rows, cfg.data.max_prompt_len, cfg.data.prompt_policy, cfg.data.prompts
    )
    eval_ids, eval_rows, _ = encode_prompts(
        tok,
        eval_rows[: cfg.eval.num_prompts],
        cfg.data.max_prompt_len,
        cfg.data.prompt_policy,
        cfg.data.eval_prompts or cfg.data.prompts,
    )
    gold_fn = load_function(cfg.eval.gold_function, "eval.gold_function") if cfg.eval.gold_function else None
    if W == 1:
        out = ckpt.prepare_run_dir(cfg.out_dir, resume=resume, overwrite=overwrite)
        latest = ckpt.latest_checkpoint(out) if resume else None
    else:  # rank 0 prepares the directory; an error there stops every rank (no rank waits forever)
        answer: Any = None
        if main:
            try:
                out = ckpt.prepare_run_dir(cfg.out_dir, resume=resume, overwrite=overwrite)
                answer = (str(out), str(ckpt.latest_checkpoint(out) or "") if resume else "")
            except ShifuError as e:
                answer = e
        answer = D.broadcast_object(answer)
        if isinstance(answer, ShifuError):
            raise answer
        out, latest = Path(answer[0]), (Path(answer[1]) if answer[1] else None)
    if resume and latest is None and main:
        print(
            f"shifu ppo: --resume: no checkpoint in '{out}' yet; starting from the beginning", file=sys.stderr
        )

    trainer, modules = build_trainer(cfg, tok, device)
    stream = PromptStream(len(ids), cfg.batch_size, cfg.seed)
    state: dict[str, Any] = {"iteration": 0, "best": None, "best_iteration": None, "evals": []}
    if latest is not None:
        sharded = trainer.sharded()
        tensors, js = ckpt.load_checkpoint(latest, {} if sharded else modules)
        if sharded:  # FSDP2 / DeepSpeed: every rank loads its shards of weights and optimiser states
            trainer.load_shards(latest / "sharded")
        changed = [
            k
            for k in ckpt.config_diff(js["config"], to_dict(cfg))
            if k not in SAFE_ON_RESUME and k != "out_dir"
        ]
        if changed:
            raise ConfigError(
                f"--resume: the config differs from the checkpoint's in {', '.join(changed)}; "
                f"only {', '.join(sorted(SAFE_ON_RESUME))} may change on resume"
            )
        trainer.load_state_dict(tensors, js["trainer"])
        stream.epoch, stream.index = js["data"]["epoch"], js["data"]["index"]
        for _ in range(js["data"].get("ptx_served", 0)):  # the ptx stream continues where it was
            next(trainer.ptx_batches)
        state = js["loop"]
        ckpt.set_rng_state(js["rng_ranks"][D.rank()] if W > 1 else js["rng"])
        if main:
            print(f"shifu ppo: resumed from {latest} at iteration {state['iteration']}", file=sys.stderr)
    if main:
        write_config(out, cfg)
    # resuming: drop what the interrupted run logged after its checkpoint (-1: no checkpoint, start over)
    resume_step = state["iteration"] if latest is not None else (-1 if resume else None)
    tracker = Tracker(out, resume_step=resume_step, enabled=main)  # only rank 0 writes logs
    if main and resume_step is not None and (out / "samples.jsonl").exists():
        kept = [
            line
            for line in (out / "samples.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line)["iteration"] <= resume_step
        ]
        (out / "samples.jsonl").write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    if latest is None:
        tracker.log(
            0, {f"sizes/{k}": v for k, v in derived_sizes(cfg).items()} | {"data/prompts_dropped": dropped}
        )

    def save(iteration: int) -> None:
        tensors, js = trainer.state_dict()  # (every rank: per-rank generators are gathered)
        rngs = D.gather_object(ckpt.rng_state()) if W > 1 else None
        shards = None
        if trainer.sharded():  # every rank writes its shards, then rank 0 adopts them into the checkpoint
            shards = out / ckpt.CKPT_DIR / f".shards-step-{iteration:08d}"
            trainer.save_shards(shards)
            D.barrier()
        if main:
            _save_checkpoint(iteration, tensors, js, rngs, shards)
        if W > 1:
            D.barrier()

    def _save_checkpoint(iteration, tensors, js, rngs, shards) -> None:
        save_fn = ckpt.save_checkpoint if shards is None else ckpt.save_checkpoint_with_shards
        extra = {"shards": shards} if shards is not None else {}
        save_fn(
            out,
            iteration,
            modules if shards is None else {},  # sharded weights are in shards/
            tensors,
            {
                "trainer": js,
                "data": {
                    "epoch": stream.epoch,
                    "index": stream.index,
                    "ptx_served": trainer.ptx_batches.served if trainer.ptx_batches is not None else 0,
                },
                "loop": state,
                "rng": ckpt.rng_state(),
                **({"rng_ranks": rngs} if rngs is not None else {}),
                "config": to_dict(cfg),
            },
            keep_last=cfg.keep_last,
            **extra,
        )

    def do_eval(iteration: int) -> dict[str, float]:
        metrics, samples = evaluate(trainer, eval_ids, eval_rows, gold_fn, cfg)
        if main:
            with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps({"iteration": iteration, **s}) + "\n")
        value = metrics.get(cfg.eval.best_metric)  # the same value on every rank (global evaluation)
        if value is not None and (state["best"] is None or value > state["best"]):
            state["best"], state["best_iteration"] = value, iteration
            save_actor(trainer, tok, cfg, out / "best")
        state["evals"].append({"iteration": iteration, **metrics})
        return metrics

    stop_reason = None
    if state["iteration"] == 0 and cfg.eval.every > 0:
        tracker.log(0, do_eval(0))
    bar = progress(cfg.iterations, "ppo", initial=state["iteration"], enabled=main)
    with GracefulStop() as stop:
        while state["iteration"] < cfg.iterations:
            batch = stream.next()  # the global batch, the same on every rank
            if W > 1:
                batch = batch[D.rank() :: W]  # this rank's batch_size / W prompts
            b = pad_left([ids[i] for i in batch], tok.pad_token_id)
            metrics = trainer.step(b["input_ids"], b["attention_mask"], [rows[i] for i in batch])
            metrics.pop("_exp")
            state["iteration"] += 1
            it = state["iteration"]
            if cfg.eval.every > 0 and (it % cfg.eval.every == 0 or it == cfg.iterations):
                metrics.update(do_eval(it))
            tracker.log(it, metrics)
            bar.update(1)
            bar.set_postfix(
                score=f"{metrics['objective/score']:.3f}",
                kl=f"{metrics['objective/kl']:.2f}",
                beta=f"{metrics['objective/kl_coef']:.3g}",
            )
            if trainer.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
                bar.close(), tracker.close()
                last = ckpt.latest_checkpoint(out)
                raise ShifuError(
                    f"iteration {it}: {trainer.nonfinite_in_a_row} consecutive optimiser steps had a NaN/Inf "
                    f"loss or gradient (max_nonfinite_steps={cfg.max_nonfinite_steps}); stopping. "
                    + (
                        f"The last good checkpoint is {last}; lower optim.lr or check the reward, then --resume"
                        if last
                        else "No checkpoint was written; lower optim.lr or check the reward"
                    )
                )
            stop_reason = _guard(cfg, metrics, state)
            if W > 1:  # a signal seen by any rank stops all of them at the same iteration
                stop.requested = D.any_true(stop.requested)
            if stop_reason or stop.requested or (cfg.save_every and it % cfg.save_every == 0):
                save(it)
            if stop_reason:
                break
            if stop.requested:
                bar.close(), tracker.close()
                announce_stop("ppo", f"iteration {it}", out)
                return {"stopped": True, "iteration": it}
    bar.close()
    if stop_reason is not None and (out / "best").exists():
        print(
            f"shifu ppo: guard stopped the run: {stop_reason}; restoring best/ (iteration "
            f"{state['best_iteration']}) as final/",
            file=sys.stderr,
        )
        from shifu.models import load_causal_lm as _load

        best = _load(out / "best", dropout=False)
        if cfg.lora.enabled:
            D.warn0(
                "shifu ppo: a LoRA actor cannot be restored from the merged best/; final/ is the last actor"
            )
        elif W > 1:
            D.load_full_state_dict(trainer.actor, best.state_dict())
        else:
            trainer.actor.load_state_dict(best.state_dict())
    elif stop_reason is not None:
        print(f"shifu ppo: guard stopped the run: {stop_reason} (no best/ to restore)", file=sys.stderr)
    save(state["iteration"])
    save_actor(trainer, tok, cfg, out / "final")
    if trainer.critic is not None:
        save_critic(trainer, cfg, out / "critic")
    summary = {
        "iterations": state["iteration"],
        "best": state["best"],
        "best_iteration": state["best_iteration"],
        "guard": stop_reason,
        "evals": state["evals"],
        "skipped_steps": trainer.skipped_steps,
        "kl_coef": trainer.kl_ctl.value,
    }
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    tracker.close()
    if W > 1:
        D.barrier()
    return summary


def save_actor(trainer: PPOTrainer, tok, cfg: Config, path: Path) -> None:
    """The actor as an HF directory on rank 0 (call on every rank: sharded weights are gathered first).

    LoRA: the adapters merged into a plain copy. FSDP2 / DeepSpeed: the full state dict gathered on rank
    0 and loaded into a CPU copy built from ``actor_path``."""
    model = D.unwrap(trainer.actor)
    if D.is_sharded(trainer.actor):
        sd = D.full_state_dict(trainer.actor)
        if D.is_main():
            plain = load_causal_lm(cfg.actor_path, trust_remote_code=cfg.trust_remote_code, dropout=False)
            plain.load_state_dict(sd)
            ckpt.save_hf_dir(plain, tok, path)
    elif D.is_main():
        ckpt.save_hf_dir(L.merged_copy(model) if L.is_lora(model) else model, tok, path)
    D.barrier()


def save_critic(trainer: PPOTrainer, cfg: Config, path: Path) -> None:
    """The critic as a ScalarModel directory on rank 0 (call on every rank; see :func:`save_actor`)."""
    if D.is_sharded(trainer.critic):
        sd = D.full_state_dict(trainer.critic)
        if D.is_main():
            plain = ScalarModel.from_backbone(
                cfg.critic.path or cfg.actor_path, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code
            )
            plain.load_state_dict(sd)
            ckpt.save_scalar_dir(plain, path)
    elif D.is_main():
        ckpt.save_scalar_dir(D.unwrap(trainer.critic), path)
    D.barrier()


def _guard(cfg: Config, metrics: dict[str, float], state: dict[str, Any]) -> str | None:
    """Reward-hacking guard: a KL ceiling, or gold falling while the training score rises N evaluations."""
    g = cfg.guard
    if g.kl_ceiling is not None and metrics["objective/kl"] > g.kl_ceiling:
        return f"objective/kl {metrics['objective/kl']:.2f} nats > guard.kl_ceiling {g.kl_ceiling}"
    evals = [e for e in state["evals"] if "gold/score" in e]
    if g.divergence_patience > 0 and "gold/score" in metrics and len(evals) > g.divergence_patience:
        recent = evals[-(g.divergence_patience + 1) :]
        pairs = list(zip(recent, recent[1:]))
        if all(b["gold/score"] < a["gold/score"] and b["eval/score"] > a["eval/score"] for a, b in pairs):
            return (
                f"gold/score fell while eval/score rose for {g.divergence_patience} evaluations "
                f"(gold {recent[0]['gold/score']:.3f} -> {recent[-1]['gold/score']:.3f})"
            )
    return None

"""``shifu dpo``: Direct Preference Optimisation on the same (prompt, chosen, rejected) pairs as ``shifu rm``.

Loss (Rafailov et al. 2023, eq. 7; :func:`shifu.core.dpo_loss`)::

    -log sigmoid(beta * ((log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x))))

with ``log pi(y|x)`` the **sum** over the response tokens (EOS included, as SFT appends it) of the
token log-probs at temperature 1; the step's loss is the mean over its pairs. ``beta * (log pi - log
pi_ref)`` is the implicit reward; its held-out accuracy (chosen > rejected) and margin are the quality
signals (``eval/dpo/accuracy``, ``eval/dpo/margin``). Token layout is the rollout's: left-padded prompt +
right-padded response, log-probs read by :func:`shifu.generation.rollout.policy_forward`, so DPO, PPO and the
gold/KL evaluation see the same numbers.

The reference is a frozen copy (``model.ref_path``, default ``model.path``) loaded separately; its
log-probs are computed once, before training, for every pair. Dropout is disabled in both models, so the
implicit reward is exactly 0 before the first step. Output: ``OUT/final/`` (HF model + tokenizer),
``summary.json``, ``metrics.jsonl``. The loop (resume, signals, cadence, skipped steps, torchrun) is
:mod:`shifu.trainers.loop`.
"""

from __future__ import annotations

from collections import Counter

import torch

from shifu.config.schema import DPOConfig, check_world_size
from shifu.config.sections import TextDataConfig
from shifu.core import dpo_loss, masked_sum
from shifu.data.batches import encode_sft
from shifu.data.rows import load_train_eval, prompt_text
from shifu.errors import ConfigError
from shifu.generation.rollout import policy_forward
from shifu.models.loading import (
    check_length,
    check_own_tokenizer,
    check_vocab,
    load_causal_lm,
    load_tokenizer,
)
from shifu.models.padding import pad_left, pad_right
from shifu.parallel import build_strategy
from shifu.parallel.strategy import Strategy
from shifu.trainers import common, loop
from shifu.trainers.common import autocast, report_counts, seed_everything

Config = DPOConfig
STATS = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


def encode_pairs(tokenizer, rows: list[dict], d: TextDataConfig) -> tuple[list[dict], Counter]:
    """Preference rows -> ([{"prompt_ids", "chosen_ids", "rejected_ids"}], counts), SFT tokenisation.

    Each side is tokenised like an SFT example (:func:`shifu.data.batches.encode_sft`: prompt and response
    separately, EOS appended, long prompts cut or dropped by ``d.prompt_policy``). Dropping depends only on
    the prompt, so both sides keep the same rows.
    """
    sides = {}
    counts: Counter = Counter()
    for side in ("chosen", "rejected"):
        # the prompt as the policy is prompted (prompt_text: a chat template, messages), then the response
        sft_rows = [{"prompt": prompt_text(tokenizer, r, d.chat_template), "response": r[side]} for r in rows]
        sides[side], c = encode_sft(tokenizer, sft_rows, d.max_prompt_len, d.max_len, d.prompt_policy, False)
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
def evaluate(model, pairs, ref_lp, pad: int, cfg: DPOConfig, strategy: Strategy) -> dict:
    """Held-out ``eval/dpo/{loss, accuracy, margin, chosen_reward, rejected_reward}`` (pair means). Each rank
    scores its share of every ``eval.batch_size`` chunk; the pair-weighted sums are added over ranks."""
    model.eval()
    totals = dict.fromkeys(STATS, 0.0)
    for i in range(0, len(pairs), cfg.eval.batch_size):
        idx, real = strategy.share(list(range(i, min(i + cfg.eval.batch_size, len(pairs)))))
        chunk, refs = [pairs[j] for j in idx], [ref_lp[j] for j in idx]
        loss, stats = pair_loss(model, chunk, refs, pad, cfg.beta, strategy.device, cfg.bf16)
        for k, v in {"loss": loss, **stats}.items():
            totals[k] += float(v) * len(chunk) * real
    model.train()
    totals = strategy.batch_sums(totals)
    return {f"eval/dpo/{k}": v / len(pairs) for k, v in totals.items()}


def train(cfg: DPOConfig, resume: bool = False, overwrite: bool = False) -> dict[str, float]:
    """Run DPO as ``cfg`` says; returns the final metrics (``dpo/*`` of the last window, ``eval/dpo/*``)."""
    cfg = common.policy_config(cfg)  # a run directory: its final/; a reward model: refused
    strategy = build_strategy(cfg.distributed)
    # 1. data: read and validate every pair before the output directory is touched
    train_rows, eval_rows = load_train_eval(cfg.data, "preference")
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    train_pairs, counts = encode_pairs(tokenizer, train_rows, cfg.data)
    eval_pairs, eval_counts = encode_pairs(tokenizer, eval_rows, cfg.data)
    if not train_pairs or not eval_pairs:
        raise ConfigError("no preference pairs left after the prompt policy; raise data.max_prompt_len")

    # 2. policy (trained) and reference (frozen, its log-probs computed once), optimiser, schedule
    seed_everything(cfg.seed)
    device, pad = strategy.launch(cfg.device), tokenizer.pad_token_id
    check_world_size(cfg, strategy.world)
    report_counts(cfg.data.train, counts, strategy.is_main)
    report_counts(cfg.data.eval or cfg.data.train + " (held out)", eval_counts, strategy.is_main)
    trust = cfg.model.trust_remote_code
    model = load_causal_lm(cfg.model.path, trust_remote_code=trust, dropout=False)
    ref = load_causal_lm(cfg.model.ref_path or cfg.model.path, trust_remote_code=trust, dropout=False)
    check_own_tokenizer(tokenizer, model, cfg.model.path, "model.path")
    longest = max(
        len(x["prompt_ids"]) + max(len(x["chosen_ids"]), len(x["rejected_ids"]))
        for x in train_pairs + eval_pairs
    )
    check_length(model, longest, cfg.data.train)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
        ref.resize_token_embeddings(len(tokenizer))
    if cfg.model.ref_path:  # another model family would crash mid-run or give meaningless log-ratios
        check_vocab(tokenizer, ref, cfg.model.ref_path, "model.ref_path")
    model.to(device).train()
    lengths = [len(x["prompt_ids"]) + max(len(x["chosen_ids"]), len(x["rejected_ids"])) for x in train_pairs]
    run = common.with_bf16_decision(cfg, model, lengths, strategy, "dpo", pairs=True)
    ref = strategy.frozen(ref)
    with strategy.offloaded(ref) as r:
        train_ref = reference_log_probs(r, train_pairs, pad, cfg.eval.batch_size, device, run.bf16)
        eval_ref = reference_log_probs(r, eval_pairs, pad, cfg.eval.batch_size, device, run.bf16)
    del ref, r
    model = strategy.wrap(model)  # before the optimiser (FSDP2 shards the parameters)
    trained = strategy.optimize(model, model.parameters(), cfg.optim, loop.steps_of(cfg, len(train_pairs)))

    def loss(rows: list[int], divisor: torch.Tensor):
        pairs, refs = [train_pairs[i] for i in rows], [train_ref[i] for i in rows]
        loss, stats = pair_loss(model, pairs, refs, pad, cfg.beta, device, run.bf16)
        w = len(rows) / float(divisor)  # this micro-batch's share of the step's pairs
        return loss * w, {k: w * float(v) for k, v in {"loss": loss.detach(), **stats}.items()}, len(rows)

    job = loop.Job(
        name="dpo",
        trained=trained,
        modules={"policy": strategy.unwrap(model)},
        n_rows=len(train_pairs),
        stat_keys=STATS,
        count=len,
        loss=loss,
        evaluate=lambda: evaluate(model, eval_pairs, eval_ref, pad, run, strategy),
        unit="pairs",
        seed=cfg.seed,
        lengths=lengths,
    )

    def fresh():  # the model unsharded, to gather the trained weights into
        return load_causal_lm(cfg.model.path, trust_remote_code=trust)

    def closing(summary: dict) -> str:
        acc, margin = (summary.get(f"eval/dpo/{k}", float("nan")) for k in ("accuracy", "margin"))
        return f"shifu dpo: {summary['step']} steps, held-out implicit-reward accuracy {acc:.3f}, margin {margin:.3f}"

    # 3. the loop, in the run directory (--resume continues its latest checkpoint); 4. the DPO policy in
    # final/, loadable by transformers
    return loop.train_policy(
        job, cfg, strategy, resume, overwrite, run.bf16, (model, fresh, tokenizer), closing
    )

"""Two policies compared on the same prompts with the same sampling seed, so the gain is paired: policy
directories loaded and sampled through the one evaluator (:func:`judge_policy`), the gold before and after with
standard errors and the gain with the standard error of its per-prompt differences (:func:`paired`,
:func:`shifu.core.stats.mean_se`), the KL of the second policy to the first, tool use where the source reports it
(:func:`paired_summary`), and one record per prompt (:func:`sample_records`: ``samples_before/after.jsonl``).

The quickstart's final evaluation (:mod:`shifu.evaluation.final`), ``shifu eval``
(:mod:`shifu.evaluation.measure`) and the end of ``shifu ppo`` (:func:`shifu.trainers.ppo_eval.final_evaluation`)
all report through these functions, so their figures mean the same thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shifu.core.stats import mean_se
from shifu.evaluation.evaluate import Evaluated, encode_prompts, evaluate, plain_reference, prompt_batches
from shifu.models.positions import position_limit
from shifu.rollout.batch import PromptBatch
from shifu.rollout.sources import Policy


def load_policy(policy_dir: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of a policy directory, in eval mode without dropout, on ``device``."""
    from shifu.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).eval()
    return model.to(device), tok


def judge_policy(
    policy_dir: str | Path,
    reference_dir: str | Path | None,
    rows: list[dict],
    source,
    params,
    seed: int,
    ev: dict[str, Any],
    on_batch=None,
) -> Evaluated:
    """:func:`shifu.evaluation.evaluate.evaluate` of the policy directory ``policy_dir`` (KL to ``reference_dir``
    when given) on ``rows`` with ``source`` (:func:`judge_loaded`)."""
    model, tok = load_policy(policy_dir)
    ref = load_policy(reference_dir)[0] if reference_dir else None
    return judge_loaded(model, tok, ref, rows, source, params, seed, ev, on_batch)


def judge_loaded(
    model: nn.Module,
    tok,
    ref: nn.Module | None,
    rows: list[dict],
    source,
    params,
    seed: int,
    ev: dict[str, Any],
    on_batch=None,
) -> Evaluated:
    """:func:`shifu.evaluation.evaluate.evaluate` of ``model`` (KL to ``ref`` when given) on ``rows`` with
    ``source``, sampled with ``params`` from a generator seeded ``seed``: prompts rendered and cut as PPO's
    (``ev``'s ``max_prompt_len``, ``chat_template``; a model with learned positions keeps room for
    ``params.max_new_tokens``), ``ev["batch_size"]`` prompts at a time (64 by default), on the model's device."""
    L = ev.get("max_prompt_len")
    n_positions = position_limit(model)  # prompt + response fit the model's positions
    if n_positions is not None:
        room = n_positions - params.max_new_tokens
        L = room if L is None else min(L, room)
    ids = encode_prompts(tok, rows, L, ev.get("chat_template", True))
    dev = next(model.parameters()).device
    batches = (
        PromptBatch(b.prompt_ids.to(dev), b.prompt_mask.to(dev), b.rows)
        for b in prompt_batches(tok, rows, ids, ev.get("batch_size", 64))
    )
    gen = torch.Generator().manual_seed(seed)
    return evaluate(Policy(model, tok), source, batches, params, gen, plain_reference(ref), on_batch)


def judge_scores(fn, res: Evaluated) -> list[float]:
    """A judge ``fn(prompts, responses, rows)`` (a gold judge or a reward function) on the trajectories of
    ``res``, one float each (a process reward's ``[[end, reward], ...]`` summed, as PPO totals it)."""
    from shifu.errors import ShifuError, function_name

    out = list(fn([r["prompt"] for r in res.rows], res.responses, res.rows))
    if len(out) != len(res):
        raise ShifuError(f"{function_name(fn)} returned {len(out)} scores for {len(res)} responses")
    return [sum(float(r) for _, r in x) if isinstance(x, (list, tuple)) else float(x) for x in out]


def paired(before: list[float], after: list[float]) -> dict[str, Any]:
    """Gold before and after (means, standard errors) and the paired gain: the same prompts and sampling seed."""
    (gb, gb_se), (ga, ga_se) = mean_se(before), mean_se(after)
    gain, gain_se = mean_se([a - b for a, b in zip(after, before)])
    return {
        "gold_before": gb,
        "gold_after": ga,
        "gold_gain": gain,
        "gold_before_se": gb_se,
        "gold_after_se": ga_se,
        "gold_gain_se": gain_se,
    }


def tool_use(res: Evaluated) -> tuple[float | None, float | None]:
    """Mean and standard error of the fraction of episodes that called a tool; None where not reported."""
    uses = res.tool_use()
    return (None, None) if uses is None else mean_se(uses)


def paired_summary(
    before: Evaluated, after: Evaluated, gold_before: list[float], gold_after: list[float], temperature: float
) -> dict[str, Any]:
    """The figures of a paired comparison (``after`` sampled with the KL to ``before``'s policy): gold before,
    after and the gain with standard errors (:func:`paired`); for episodes the fraction that called a tool
    (None where the environment does not report tool calls), turns and the fraction truncated; the mean KL
    (k3, never negative, and k1; nats per trajectory); the prompts and temperature; for single responses
    their mean lengths."""
    n, episodes = len(after), after.episodes
    out = paired(gold_before, gold_after)
    if episodes:
        (ub, ub_se), (ua, ua_se) = tool_use(before), tool_use(after)
        out |= {
            "tool_use_before": ub,
            "tool_use_after": ua,
            "tool_use_before_se": ub_se,
            "tool_use_after_se": ua_se,
        }
    out |= {"kl": sum(after.kl_k3) / n, "kl_k1": sum(after.kl) / n}  # (k3: the estimate never negative)
    if episodes:
        out |= {
            "turns_before": sum(before.counts["turns"]) / n,
            "turns_after": sum(after.counts["turns"]) / n,
            "truncated_after": sum(after.truncated) / n,
        }
    out |= {"eval_prompts": n, "eval_temperature": temperature}
    if not episodes:
        out |= {
            "response_len_before": sum(before.lengths) / n,
            "response_len_after": sum(after.lengths) / n,
        }
    return out


def sample_records(res: Evaluated, golds: list[float]) -> list[dict[str, Any]]:
    """One line per prompt of ``samples_before/after.jsonl``: the prompt, the response as a reader sees it and
    its gold; episodes also the first input as the policy read it, whether a tool was called (None: not
    reported) and the turns; with a KL (the
    ``after`` side) its k3 estimate as ``kl``, single responses also the k1 estimate as ``kl_k1``."""
    if res.episodes:
        uses = res.tool_use() or [None] * len(res)  # (None: the environment does not report tool calls)
        lines = [
            {
                "prompt": r["prompt"],
                "input": t.first_input,
                "response": t.response,
                "gold": g,
                "tool_use": u,
                "turns": n,
            }
            for r, t, g, u, n in zip(res.rows, res.transcripts, golds, uses, res.counts["turns"])
        ]
        return [x | {"kl": k} for x, k in zip(lines, res.kl_k3)] if res.kl_k3 else lines
    lines = [
        {"prompt": r["prompt"], "response": y, "gold": g} for r, y, g in zip(res.rows, res.responses, golds)
    ]
    if res.kl:
        lines = [x | {"kl": k3, "kl_k1": k1} for x, k3, k1 in zip(lines, res.kl_k3, res.kl)]
    return lines

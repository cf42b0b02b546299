"""The quickstart's final evaluation: the SFT policy and the final policy on the held-out prompts, judged by the
task's gold judge (sampled at the plan's temperature, and greedy for arith), with the KL to the reference
and paired standard errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shifu.core.stats import mean_se
from shifu.experiments.pipeline import (
    read_jsonl,
    write_jsonl,
)

GOLD = {"arith": "shifu.tasks.judges:exact_match", "imdb": "shifu.tasks.judges:vader_compound"}


def eval_settings(plan: dict[str, Any]) -> dict[str, Any]:
    """The final evaluation's settings (:func:`evaluate`'s ``ev``): the plan's ``eval`` keys, with the
    held-out prompts cut and rendered as PPO's were (``ppo.data.max_prompt_len``, ``chat_template``)."""
    data = plan["ppo"].get("data", {})
    return {
        "max_prompt_len": data.get("max_prompt_len"),
        "chat_template": data.get("chat_template", True),
        **plan["eval"],
    }


def evaluate(
    task: str,
    sft_dir: Path,
    final_dir: Path,
    prompts_path: str,
    ev: dict,
    seed: int,
    out: Path,
    gold: str | None = None,
) -> dict[str, Any]:
    """Gold before/after and KL on the held-out prompts (the first ``ev["num_prompts"]``, all by default);
    writes samples_before/after.jsonl. ``gold``: the judge (``package.module:function``; the task's own by
    default); ``ev["greedy"]`` false skips arith's greedy accuracies. One progress bar on stderr counts the
    prompts of every pass (sampled before and after, then greedy before and after)."""
    from shifu.config.imports import load_callable
    from shifu.runs.tracking import progress
    from shifu.tasks import evaluate_policy

    rows = read_jsonl(prompts_path)[: ev.get("num_prompts")]
    prompts = [r["prompt"] for r in rows]
    gold = gold or GOLD[task]
    gold_fn = load_callable(gold, "gold judge")
    T, R = ev["temperature"], ev["max_new_tokens"]
    # prompts cut to PPO's data.max_prompt_len (keeping their last tokens) as in training: an untruncated
    # long prompt + R new tokens can run past the model's positions (imdb small: 64)
    L, C = ev.get("max_prompt_len"), ev.get("chat_template", True)
    greedy = task == "arith" and ev.get("greedy", True)  # greedy decoding as well: the policy at its mode
    n = len(prompts)
    bar = progress(n * (4 if greedy else 2), "final evaluation")
    kw = {
        "max_prompt_len": L,
        "chat_template": C,
        "on_batch": bar.update,
        "batch_size": ev.get("batch_size", 64),
    }

    def run(what: str, policy: Path, ref: Path | None, sample_seed: int, is_greedy: bool = False) -> dict:
        bar.set_postfix_str(what, refresh=True)
        return evaluate_policy(
            str(policy), ref and str(ref), prompts, R, T, sample_seed, greedy=is_greedy, **kw
        )

    before = run(f"SFT policy, sampled T={T:g}", sft_dir, None, seed + 777)
    after = run(f"final policy, sampled T={T:g}", final_dir, sft_dir, seed + 777)
    g_before = [float(x) for x in gold_fn(prompts, before["responses"], rows)]
    g_after = [float(x) for x in gold_fn(prompts, after["responses"], rows)]
    write_jsonl(
        out / "samples_before.jsonl",
        [{"prompt": p, "response": y, "gold": g} for p, y, g in zip(prompts, before["responses"], g_before)],
    )
    write_jsonl(
        out / "samples_after.jsonl",
        [
            {"prompt": p, "response": y, "gold": g, "kl": k3, "kl_k1": k1}
            for p, y, g, k3, k1 in zip(prompts, after["responses"], g_after, after["kl_k3"], after["kl"])
        ],
    )
    gains = [a - b for a, b in zip(g_after, g_before)]  # paired: the same prompts and sampling seed
    summary: dict[str, Any] = {
        "gold_before": sum(g_before) / n,
        "gold_after": sum(g_after) / n,
        "gold_gain": sum(gains) / n,
        "gold_before_se": mean_se(g_before)[1],
        "gold_after_se": mean_se(g_after)[1],
        "gold_gain_se": mean_se(gains)[1],
        "kl": sum(after["kl_k3"]) / n,  # the k3 estimate: never negative
        "kl_k1": sum(after["kl"]) / n,
        "eval_prompts": n,
        "eval_temperature": T,
        "response_len_before": sum(before["lengths"]) / n,
        "response_len_after": sum(after["lengths"]) / n,
        "gold_judge": gold,
    }
    if greedy:
        gb = run("SFT policy, greedy", sft_dir, None, seed, True)["responses"]
        ga = run("final policy, greedy", final_dir, None, seed, True)["responses"]
        summary["gold_greedy_before"] = sum(gold_fn(prompts, gb, rows)) / n
        summary["gold_greedy_after"] = sum(gold_fn(prompts, ga, rows)) / n
    bar.close()
    return summary

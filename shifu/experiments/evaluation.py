"""The quickstart's final evaluation: the SFT policy and the final policy on the held-out prompts, through the one
evaluator (:func:`shifu.rollout.evaluate.evaluate`), with the same prompts and sampling seed, so the gain is
paired. A single-turn plan is judged by the task's gold judge on the responses (sampled at the plan's
temperature, and greedy for arith); a plan with an environment (``ppo.env``) or an agent (``ppo.agent``) runs
held-out episodes through it, the gold being the episode return, the environment's or agent's own count. Both report the KL to the SFT policy and
standard errors (:func:`shifu.core.stats.mean_se`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shifu.config.imports import load_callable
from shifu.core.stats import mean_se
from shifu.experiments.pipeline import read_jsonl, write_jsonl

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


def judge_policy(
    policy_dir: str | Path,
    reference_dir: str | Path | None,
    rows: list[dict],
    source,
    params,
    seed: int,
    ev: dict[str, Any],
    on_batch=None,
):
    """:func:`shifu.rollout.evaluate.evaluate` of the policy directory ``policy_dir`` (KL to ``reference_dir``
    when given) on ``rows`` with ``source``, sampled with ``params`` from a generator seeded ``seed``: prompts
    rendered and cut as PPO's (``ev``'s ``max_prompt_len``, ``chat_template``; a model with learned positions
    keeps room for ``params.max_new_tokens``), ``ev["batch_size"]`` prompts at a time (64 by default)."""
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.rollout.evaluate import encode_prompts, evaluate, plain_reference, prompt_batches
    from shifu.rollout.sources import Policy

    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).eval()
    ref = load_causal_lm(reference_dir, dropout=False).eval() if reference_dir else None
    L = ev.get("max_prompt_len")
    n_positions = getattr(model.config, "n_positions", None)  # GPT-2: prompt + response fit its positions
    if n_positions is not None:
        room = n_positions - params.max_new_tokens
        L = room if L is None else min(L, room)
    ids = encode_prompts(tok, rows, L, ev.get("chat_template", True))
    batches = prompt_batches(tok, rows, ids, ev.get("batch_size", 64))
    gen = torch.Generator().manual_seed(seed)
    return evaluate(Policy(model, tok), source, batches, params, gen, plain_reference(ref), on_batch)


def episode_source(ppo_plan: dict | None) -> str | None:
    """``"env"`` or ``"agent"``: the section of a plan's ``ppo`` stage whose factory makes episodes; else None."""
    for name in ("agent", "env"):
        section = (ppo_plan or {}).get(name)
        if isinstance(section, dict) and section.get("factory"):
            return name
    return None


def evaluate(
    task: str,
    sft_dir: Path,
    final_dir: Path,
    prompts_path: str,
    ev: dict,
    seed: int,
    out: Path,
    gold: str | None = None,
    ppo_plan: dict | None = None,
) -> dict[str, Any]:
    """Gold before/after and KL on the held-out prompts (the first ``ev["num_prompts"]``, all by default);
    writes samples_before/after.jsonl. ``ppo_plan`` with an ``env`` or ``agent`` factory: held-out episodes
    through that environment or agent (its ``generation`` budgets); else responses judged by ``gold`` (``package.module:function``;
    the task's own by default), and for arith greedy decoding as well unless ``ev["greedy"]`` is false. One
    progress bar on stderr counts the prompts of every pass."""
    from shifu.runs.tracking import progress

    rows = read_jsonl(prompts_path)[: ev.get("num_prompts")]
    episodes = episode_source(ppo_plan) is not None
    greedy = not episodes and task == "arith" and ev.get("greedy", True)  # the policy at its mode too
    bar = progress(len(rows) * (4 if greedy else 2), "final evaluation")
    if episodes:
        return _episodes(sft_dir, final_dir, rows, ppo_plan, ev, seed, out, bar)
    return _responses(task, sft_dir, final_dir, rows, gold, ev, seed, out, bar, greedy)


def _responses(task, sft_dir, final_dir, rows, gold, ev, seed, out, bar, greedy) -> dict[str, Any]:
    """Single-turn responses of both policies, judged by ``gold`` (:func:`evaluate`)."""
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.sources import SingleTurn

    gold = gold or GOLD[task]
    gold_fn = load_callable(gold, "gold judge")
    T, R = ev["temperature"], ev["max_new_tokens"]
    source = SingleTurn(None, name=f"gold judge {gold}")  # unscored: the gold judge reads the responses

    def run(what: str, policy: Path, ref: Path | None, sample_seed: int, is_greedy: bool = False):
        bar.set_postfix_str(what, refresh=True)
        params = SamplingParams(max_new_tokens=R, temperature=T, greedy=is_greedy)
        return judge_policy(policy, ref, rows, source, params, sample_seed, ev, bar.update)

    before = run(f"SFT policy, sampled T={T:g}", sft_dir, None, seed + 777)
    after = run(f"final policy, sampled T={T:g}", final_dir, sft_dir, seed + 777)
    prompts = [r["prompt"] for r in rows]
    g_before = [float(x) for x in gold_fn(prompts, before.responses, rows)]
    g_after = [float(x) for x in gold_fn(prompts, after.responses, rows)]
    write_jsonl(
        out / "samples_before.jsonl",
        [{"prompt": p, "response": y, "gold": g} for p, y, g in zip(prompts, before.responses, g_before)],
    )
    write_jsonl(
        out / "samples_after.jsonl",
        [
            {"prompt": p, "response": y, "gold": g, "kl": k3, "kl_k1": k1}
            for p, y, g, k3, k1 in zip(prompts, after.responses, g_after, after.kl_k3, after.kl)
        ],
    )
    n = len(rows)
    summary = _paired(g_before, g_after) | {
        "kl": sum(after.kl_k3) / n,  # the k3 estimate: never negative
        "kl_k1": sum(after.kl) / n,
        "eval_prompts": n,
        "eval_temperature": T,
        "response_len_before": sum(before.lengths) / n,
        "response_len_after": sum(after.lengths) / n,
        "gold_judge": gold,
    }
    if greedy:
        gb = run("SFT policy, greedy", sft_dir, None, seed, True).responses
        ga = run("final policy, greedy", final_dir, None, seed, True).responses
        summary["gold_greedy_before"] = sum(gold_fn(prompts, gb, rows)) / n
        summary["gold_greedy_after"] = sum(gold_fn(prompts, ga, rows)) / n
    bar.close()
    return summary


def _episodes(sft_dir, final_dir, rows, ppo_plan, ev, seed, out, bar) -> dict[str, Any]:
    """Held-out episodes of both policies through the plan's environment or agent (:func:`evaluate`)."""
    from shifu.config.imports import key_prefix
    from shifu.config.loader import from_dict
    from shifu.config.sections import AgentConfig, EnvConfig, GenerationConfig
    from shifu.envs.base import Environment
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.build import agent_source, episode_limits
    from shifu.rollout.episodes import Episodes

    with key_prefix("ppo."):  # a bad environment or agent is named by the plan's key
        generation = from_dict(GenerationConfig, ppo_plan.get("generation", {}))
        limits = episode_limits(generation)
        kind = episode_source(ppo_plan)
        section = from_dict(AgentConfig if kind == "agent" else EnvConfig, ppo_plan[kind])
        factory = section.factory
        if kind == "agent":  # (its forks are counted, not scored)
            source = agent_source(section, generation)
        else:
            chat, cut = ev.get("chat_template", True), ev.get("max_prompt_len")
            source = Episodes(Environment(section), limits, chat, cut)
    T = ev["temperature"]
    params = SamplingParams(limits.max_new_tokens, T)
    bar.set_postfix_str(f"SFT policy, episodes at T={T:g}", refresh=True)
    with key_prefix("ppo."):
        before = judge_policy(sft_dir, None, rows, source, params, seed + 777, ev, bar.update)
        bar.set_postfix_str(f"final policy, episodes at T={T:g}", refresh=True)
        after = judge_policy(final_dir, sft_dir, rows, source, params, seed + 777, ev, bar.update)
    bar.close()
    for name, res in (("samples_before.jsonl", before), ("samples_after.jsonl", after)):
        lines = [
            {"prompt": r["prompt"], "response": t.response, "gold": g, "tool_use": u, "turns": n}
            for r, t, g, u, n in zip(rows, res.transcripts, res.returns, res.tool_use(), res.counts["turns"])
        ]
        if res.kl_k3:
            lines = [x | {"kl": k} for x, k in zip(lines, res.kl_k3)]
        write_jsonl(out / name, lines)
    n = len(rows)
    (ub, ub_se), (ua, ua_se) = mean_se(before.tool_use()), mean_se(after.tool_use())
    return _paired(before.returns, after.returns) | {
        "tool_use_before": ub,
        "tool_use_after": ua,
        "tool_use_before_se": ub_se,
        "tool_use_after_se": ua_se,
        "kl": sum(after.kl_k3) / n,
        "kl_k1": sum(after.kl) / n,
        "turns_before": sum(before.counts["turns"]) / n,
        "turns_after": sum(after.counts["turns"]) / n,
        "truncated_after": sum(after.truncated) / n,
        "eval_prompts": n,
        "eval_temperature": T,
        "gold_judge": f"episode return of {factory}",
    }


def _paired(before: list[float], after: list[float]) -> dict[str, Any]:
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

"""The quickstart's final evaluation: the SFT policy and the final policy on the held-out prompts, through the one
evaluator (:func:`shifu.evaluation.evaluate.evaluate`), with the same prompts and sampling seed, so the gain is
paired. A single-turn plan is judged by the task's gold judge on the responses (sampled at the plan's
temperature, and greedy for arith); a plan with an environment (``ppo.env``) or an agent (``ppo.agent``) runs
held-out episodes through it, the gold being the episode return, the environment's or the agent's own count. Both report the KL to the SFT policy and
standard errors through the paired comparison of :mod:`shifu.evaluation.compare`, as ``shifu eval`` and the end of
``shifu ppo`` do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shifu.config.imports import load_callable
from shifu.evaluation.compare import judge_policy, paired_summary, sample_records
from shifu.evaluation.evaluate import Evaluated
from shifu.parallel.forked import map_forked
from shifu.runs.jsonfile import read_jsonl, write_jsonl

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
    ppo_plan: dict | None = None,
) -> dict[str, Any]:
    """Gold before/after and KL on the held-out prompts (the first ``ev["num_prompts"]``, all by default);
    writes samples_before/after.jsonl. ``ppo_plan`` with an ``env`` or ``agent`` factory: held-out episodes
    through that environment or agent (its ``generation`` budgets); else responses judged by ``gold`` (``package.module:function``;
    the task's own by default), and for arith greedy decoding as well unless ``ev["greedy"]`` is false. One
    progress bar on stderr counts the prompts of every pass."""
    from shifu.config.imports import key_prefix
    from shifu.rollout.build import describe, plan_prompts
    from shifu.runs.tracking import progress

    with key_prefix("ppo."):
        own = plan_prompts(ppo_plan or {}, seed)  # a verifiers taskset's held-out tasks
    rows = (own[1] if own else read_jsonl(prompts_path))[: ev.get("num_prompts")]
    episodes = describe(ppo_plan or {}).episodes
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
    source = SingleTurn(None, scored_by="gold judge", spec=gold)  # unscored: the judge reads the responses

    def run(what: str, sample_seed: int, is_greedy: bool = False):
        """The SFT and the final policy (its KL to the SFT), side by side on one thread each given two
        (:func:`shifu.parallel.forked.map_forked`: the same figures at any thread count)."""
        bar.set_postfix_str(what, refresh=True)
        params = SamplingParams(max_new_tokens=R, temperature=T, greedy=is_greedy)

        def judge(policies: tuple[Path, Path | None], on_batch) -> Evaluated:
            return judge_policy(*policies, rows, source, params, sample_seed, ev, on_batch)

        pair = [(sft_dir, None), (final_dir, None if is_greedy else sft_dir)]
        return map_forked(judge, pair, f"final evaluation ({what}): policy", bar.update)

    before, after = run(f"SFT and final policy, sampled T={T:g}", seed + 777)
    prompts = [r["prompt"] for r in rows]
    g_before = [float(x) for x in gold_fn(prompts, before.responses, rows)]
    g_after = [float(x) for x in gold_fn(prompts, after.responses, rows)]
    write_jsonl(out / "samples_before.jsonl", sample_records(before, g_before))
    write_jsonl(out / "samples_after.jsonl", sample_records(after, g_after))
    n = len(rows)
    summary = paired_summary(before, after, g_before, g_after, T) | {"gold_judge": gold}
    if greedy:
        gb, ga = (e.responses for e in run("SFT and final policy, greedy", seed, True))
        summary["gold_greedy_before"] = sum(gold_fn(prompts, gb, rows)) / n
        summary["gold_greedy_after"] = sum(gold_fn(prompts, ga, rows)) / n
    bar.close()
    return summary


def _episodes(sft_dir, final_dir, rows, ppo_plan, ev, seed, out, bar) -> dict[str, Any]:
    """Held-out episodes of both policies through the plan's environment or agent (:func:`evaluate`)."""
    from shifu.config.imports import key_prefix
    from shifu.config.loader import from_dict
    from shifu.config.sources import GenerationConfig
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.build import episodes_source, plan_section

    with key_prefix("ppo."):  # a bad environment or agent is named by the plan's key
        generation = from_dict(GenerationConfig, ppo_plan.get("generation", {}))
        chat, cut = ev.get("chat_template", True), ev.get("max_prompt_len")
        source = episodes_source(plan_section(ppo_plan), generation, chat, cut)  # (an agent's forks: counted)
    T = ev["temperature"]
    params = SamplingParams(generation.max_new_tokens, T)
    bar.set_postfix_str(f"SFT policy, episodes at T={T:g}", refresh=True)
    with key_prefix("ppo."):
        before = judge_policy(sft_dir, None, rows, source, params, seed + 777, ev, bar.update)
        bar.set_postfix_str(f"final policy, episodes at T={T:g}", refresh=True)
        after = judge_policy(final_dir, sft_dir, rows, source, params, seed + 777, ev, bar.update)
    bar.close()
    write_jsonl(out / "samples_before.jsonl", sample_records(before, before.returns))
    write_jsonl(out / "samples_after.jsonl", sample_records(after, after.returns))
    summary = paired_summary(before, after, before.returns, after.returns, T)
    return summary | {"gold_judge": source.description.judge, "source": source.description.record()}

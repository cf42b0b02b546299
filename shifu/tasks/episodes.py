"""A policy judged through an environment: held-out episodes before and after RL (task ``arith_tool``, and any
``shifu quickstart`` plan whose PPO stage sets ``ppo.env``).

:func:`evaluate_episodes` runs one episode per held-out row with a policy directory (the same episode rollout
PPO trains on, :mod:`shifu.generation.episodes`) and returns each episode's return, tool use and transcript,
and its KL to a reference over the sampled tokens. :func:`compare` runs it for the SFT and the final policy on
the same rows with the same sampling seed and writes ``samples_before.jsonl`` / ``samples_after.jsonl``; the
gold is the episode return, the environment's own count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def evaluate_episodes(
    policy_dir: str | Path,
    reference_dir: str | Path | None,
    rows: list[dict],
    env_cfg: Any,
    temperature: float,
    seed: int,
    chat_template: bool = True,
    max_prompt_len: int | None = None,
    batch_size: int = 64,
    on_batch: Callable[[int], object] | None = None,
) -> dict[str, list]:
    """One episode per row: ``returns``, ``tool_use`` (1 when the episode called a tool), ``turns``,
    ``truncated``, ``transcripts`` (policy turns between ``shifu.generation.episodes.MARKS``), and with a reference ``kl`` (k3) and
    ``kl_k1`` (nats per episode, over its sampled tokens, both models at ``temperature``). ``on_batch(n)`` (a
    progress bar's ``update``) is called after each batch of ``n`` episodes."""
    from shifu.core import kl_estimate, masked_sum
    from shifu.envs.base import Environment
    from shifu.generation.episodes import run_episodes
    from shifu.generation.rollout import SamplingParams, policy_forward
    from shifu.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).eval()
    ref = load_causal_lm(reference_dir, dropout=False).eval() if reference_dir else None
    env, gen = Environment(env_cfg), torch.Generator().manual_seed(seed)
    params = SamplingParams(env_cfg.max_tokens_per_turn, temperature)
    out: dict[str, list] = {
        k: [] for k in ("returns", "tool_use", "turns", "truncated", "transcripts", "kl", "kl_k1")
    }
    for i in range(0, len(rows), batch_size):
        eps = run_episodes(
            model, tok, env, rows[i : i + batch_size], params, gen, chat_template, max_prompt_len
        )
        out["returns"] += eps.returns.tolist()
        out["tool_use"] += [int(n > 0) for n in eps.counts["tool_calls"]]
        out["turns"] += eps.counts["turns"]
        out["truncated"] += eps.truncated.tolist()
        out["transcripts"] += eps.transcripts()
        if ref is not None:
            P, mask = eps.prompt_ids.shape[1], eps.sample.response_mask
            ids = torch.cat([eps.prompt_ids, eps.sample.response_ids], 1)
            am = torch.cat([eps.prompt_mask, eps.attention.long()], 1)
            lp, ref_lp = (policy_forward(m, ids, am, P, temperature)[0] for m in (model, ref))
            out["kl"] += masked_sum(kl_estimate(lp, ref_lp, "k3"), mask, dim=1).tolist()
            out["kl_k1"] += masked_sum(lp - ref_lp, mask, dim=1).tolist()
        if on_batch is not None:
            on_batch(len(rows[i : i + batch_size]))
    return out


def compare(
    sft_dir: Path, final_dir: Path, rows: list[dict], env: dict, ev: dict, seed: int, out: Path
) -> dict[str, Any]:
    """Held-out episodes of the SFT policy and of the final policy (same rows, same sampling seed) with the
    environment ``env`` (a plan's ``ppo.env`` section): the quickstart summary's gold before/after (mean return,
    standard errors, the paired gain), tool use before/after, KL to the SFT policy; writes
    ``out/samples_before.jsonl`` and ``samples_after.jsonl``. ``ev``: the plan's final evaluation settings."""
    from shifu.config.loader import from_dict
    from shifu.config.sections import EnvConfig
    from shifu.core.stats import mean_se
    from shifu.runs.tracking import progress

    env_cfg = from_dict(EnvConfig, env)
    T, L, C = ev["temperature"], ev.get("max_prompt_len"), ev.get("chat_template", True)
    bar = progress(2 * len(rows), "final evaluation")
    kw = {"batch_size": ev.get("batch_size", 64), "on_batch": bar.update}
    bar.set_postfix_str(f"SFT policy, episodes at T={T:g}", refresh=True)
    before = evaluate_episodes(sft_dir, None, rows, env_cfg, T, seed + 777, C, L, **kw)
    bar.set_postfix_str(f"final policy, episodes at T={T:g}", refresh=True)
    after = evaluate_episodes(final_dir, sft_dir, rows, env_cfg, T, seed + 777, C, L, **kw)
    bar.close()
    for name, res in (("samples_before.jsonl", before), ("samples_after.jsonl", after)):
        lines = [
            {"prompt": r["prompt"], "response": t, "gold": g, "tool_use": u, "turns": n}
            for r, t, g, u, n in zip(rows, res["transcripts"], res["returns"], res["tool_use"], res["turns"])
        ]
        if res["kl"]:
            lines = [x | {"kl": k} for x, k in zip(lines, res["kl"])]
        (out / name).write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    (gb, gb_se), (ga, ga_se) = mean_se(before["returns"]), mean_se(after["returns"])
    gain, gain_se = mean_se([a - b for a, b in zip(after["returns"], before["returns"])])
    (ub, ub_se), (ua, ua_se) = mean_se(before["tool_use"]), mean_se(after["tool_use"])
    n = len(rows)
    return {
        "gold_before": gb,
        "gold_after": ga,
        "gold_gain": gain,
        "gold_before_se": gb_se,
        "gold_after_se": ga_se,
        "gold_gain_se": gain_se,
        "tool_use_before": ub,
        "tool_use_after": ua,
        "tool_use_before_se": ub_se,
        "tool_use_after_se": ua_se,
        "kl": sum(after["kl"]) / n,
        "kl_k1": sum(after["kl_k1"]) / n,
        "turns_before": sum(before["turns"]) / n,
        "turns_after": sum(after["turns"]) / n,
        "truncated_after": sum(after["truncated"]) / n,
        "eval_prompts": n,
        "eval_temperature": T,
        "gold_judge": f"episode return of {env_cfg.factory}",
    }

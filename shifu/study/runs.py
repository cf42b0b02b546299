"""The runs of ``shifu study frontier``: the shared stages every method starts from (prepare, SFT, preference
pairs, the imdb reward model), one trained point per (method, point, seed) with its ``RESULT.json``, and the
one measurement of gold and KL every policy gets (:func:`measure`).

Arith preference pairs: ``samples_per_prompt`` SFT samples per training prompt, ranked by exact match;
a prompt with at least one right and one wrong (non-empty) sample gives the pair (first right, first
wrong). Both sides are samples of the SFT policy, as in the imdb task's protocol, so DPO sees the same
kind of data as the reward model would; using the answer key as ``chosen`` would hand DPO supervised
targets that PPO only discovers through its samples.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError
from shifu.pipelines.quickstart import PLANS
from shifu.pipelines.stages import (
    Stages,
    as_recorded,
    check_plan,
    digest,
    log,
    ppo_overrides,
    train_stage,
)
from shifu.pipelines.stages import (
    merge as _merge,  # a budget's keys on top of quickstart's plan (private here)
)
from shifu.runs.jsonfile import read_jsonl, write_jsonl

# ------------------------------------------------------------------------------------- the measurement


def measure(
    policy_dir: str | Path,
    ref_dir: str | Path,
    rows: list[dict],
    gold_fn,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_prompt_len: int | None = None,
) -> dict[str, Any]:
    """Gold and KL of one policy on held-out prompt ``rows`` — the one measurement every method gets.

    One sample per prompt at ``temperature`` (sampling generator seeded with ``seed``: every policy is
    drawn with the same random numbers); ``gold`` = mean of ``gold_fn`` over the samples; ``kl`` = mean
    over prompts of the k1 sum over response tokens of ``log pi - log pi_ref`` (nats per response,
    :func:`shifu.evaluation.evaluate.evaluate`); ``response_len`` = mean real tokens, EOS included.
    ``max_prompt_len`` keeps each prompt's last tokens, as the RL trainers' ``data.max_prompt_len``.
    """
    from shifu.evaluation.compare import judge_policy
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.sources import SingleTurn
    from shifu.runs.tracking import progress

    prompts = [r["prompt"] for r in rows]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    bar = progress(len(rows), f"measuring {Path(policy_dir).parent.name}", leave=False)
    ev = judge_policy(
        policy_dir,
        ref_dir,
        rows,
        SingleTurn(None),
        params,
        seed,
        {"max_prompt_len": max_prompt_len},
        bar.update,
    )
    bar.close()
    gold = [float(g) for g in gold_fn(prompts, ev.responses, rows)]
    n = len(prompts)
    return {
        "gold": sum(gold) / n,
        "kl": sum(ev.kl) / n,
        "response_len": sum(ev.lengths) / n,
        "samples": [
            {"prompt": p, "response": y, "gold": g} for p, y, g in zip(prompts[:8], ev.responses, gold)
        ],
    }


# ------------------------------------------------------------------------------------- shared stages


def arith_pairs(sft_dir: Path, prompt_rows: list[dict], out: Path, pp: dict, seed: int) -> dict[str, Any]:
    """Preference pairs from SFT samples ranked by exact match (see the module docstring)."""
    import torch

    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.tasks import sample_responses
    from shifu.tasks.judges import exact_match

    rows = list(prompt_rows)
    random.Random(seed).shuffle(rows)
    rows = rows[: pp["num_prompts"]]
    tok, model = load_tokenizer(sft_dir), load_causal_lm(sft_dir, dropout=False).eval()
    gen = torch.Generator().manual_seed(seed)
    prompts = [r["prompt"] for r in rows]
    draws = [
        sample_responses(model, tok, prompts, pp["max_new_tokens"], pp["temperature"], gen)
        for _ in range(pp["samples_per_prompt"])
    ]
    pairs = []
    for i, row in enumerate(rows):
        samples = [d[i] for d in draws]
        right = exact_match([row["prompt"]] * len(samples), samples, [row] * len(samples))
        good = [s for s, r in zip(samples, right) if r == 1.0]
        bad = [s for s, r in zip(samples, right) if r == 0.0 and s.strip()]
        if good and bad:
            pairs.append(
                {"prompt": row["prompt"], "chosen": good[0], "rejected": bad[0], "answer": row["answer"]}
            )
    if len(pairs) < 20:
        raise ShifuError(
            f"only {len(pairs)} preference pairs from {len(rows)} prompts: the SFT policy is almost always "
            "right or always wrong; raise pairs.num_prompts or change sft.max_steps"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "pairs.jsonl", pairs)
    n_right = sum(exact_match(prompts, d, rows).count(1.0) for d in draws)
    return {
        "pairs": len(pairs),
        "prompts": len(rows),
        "sft_sample_accuracy": n_right / (len(rows) * len(draws)),
    }


def shared_stages(task: str, plan: dict, out: Path, sets_seed: int = 0) -> dict[str, Any]:
    """prepare -> SFT -> pairs (-> reward model for imdb) in ``out/shared``: quickstart's stages and plan for
    the budget's preset, with the budget's overrides on top; every stage is seeded with ``sets_seed``."""
    from shifu.pipelines.quickstart import preference_prompts

    qs = PLANS[(task, plan["preset"])]
    stages = Stages(out / "shared", sets_seed, "study")
    quiet = {"progress": False}
    files = stages.prepare(task, plan["preset"])
    sft_final = stages.sft(_merge(_merge(qs["sft"], plan["sft"]), quiet), files)
    info: dict[str, Any] = {"files": files, "sft": str(sft_final)}
    pairs_dir = stages.root / "pairs"
    pp = _merge(qs.get("pairs", {}), plan["pairs"])
    if task == "arith":

        def work(stage_dir: Path) -> dict[str, Any]:
            return arith_pairs(sft_final, read_jsonl(files["prompts_train"]), stage_dir, pp, sets_seed)

        note, inputs = "stage pairs: SFT samples ranked by exact match", {"policy": str(sft_final)}
        pairs = stages.run("pairs", pairs_dir, note, work, plan={**pp, **inputs, "seed": sets_seed})
        info["pairs"] = {"train": str(pairs_dir / "pairs.jsonl"), "eval": ""}
        info["reward"] = {"function": "shifu.tasks.judges:exact_match"}
    else:
        # the task's preference prompts topped up to pp["num_prompts"] with PPO's training prompts
        pairs = stages.imdb_pairs(sft_final, preference_prompts(files, pp.get("num_prompts")), pp)
        info["pairs"] = {
            "train": str(pairs_dir / "pairs_train.jsonl"),
            "eval": str(pairs_dir / "pairs_eval.jsonl"),
        }
        rm = stages.rm(_merge(_merge(qs["rm"], plan.get("rm", {})), quiet), sft_final)
        rm_final = stages.root / "rm" / "final"
        info["reward"] = {"model_path": str(rm_final)}
        info["rm"] = {
            "accuracy": rm.get("rm_accuracy"),
            **rm_gold_accuracy(rm_final, read_jsonl(info["pairs"]["eval"])),
        }
    info["pairs_info"] = {k: v for k, v in pairs.items() if k not in ("seconds", "cpu_seconds")}
    info["seconds"] = stages.seconds()
    return info


def rm_gold_accuracy(rm_path: Path, pairs: list[dict]) -> dict[str, Any]:
    """The reward model against the noiseless judge on held-out pairs: the fraction of pairs whose
    gold-better response it scores higher (pairs with equal gold scores left out). ``accuracy`` from the RM
    trainer is against the noisy (Bradley-Terry) labels it was trained to predict."""
    import torch

    from shifu.rewards.sources import load_reward_model

    decided = [r for r in pairs if r["gold_chosen"] != r["gold_rejected"]]
    if not decided:
        return {"gold_accuracy": None, "gold_pairs": 0}
    model = load_reward_model(rm_path).eval()
    prompts = [r["prompt"] for r in decided]
    with torch.no_grad():
        chosen = model.score_texts(prompts, [r["chosen"] for r in decided]).float().tolist()
        rejected = model.score_texts(prompts, [r["rejected"] for r in decided]).float().tolist()
    right = [
        (c > rj) == (r["gold_chosen"] > r["gold_rejected"]) for c, rj, r in zip(chosen, rejected, decided)
    ]
    return {"gold_accuracy": sum(right) / len(right), "gold_pairs": len(right)}


# ------------------------------------------------------------------------------------- one point


def _trainer_overrides(method: str, plan: dict, point: dict, shared: dict, seed: int) -> dict:
    """The config of one run: the budget's ``plan[method]`` from the SFT policy, then the point's own keys."""
    if method == "dpo":
        data = {"train": shared["pairs"]["train"]}
        if shared["pairs"]["eval"]:
            data["eval"] = shared["pairs"]["eval"]
        base = {
            "seed": seed,
            "model": {"path": shared["sft"]},
            "progress": False,
            "tensorboard": False,
            "data": data,
        }
        over = _merge(plan[method], base)
    else:
        over = ppo_overrides(plan[method], shared["sft"], shared["files"], shared["reward"], seed)
    return _merge(over, point)


def run_point(method: str, label: str, seed: int, plan: dict, shared: dict, out: Path, ev: dict) -> dict:
    """Train one (method, point, seed) from the SFT policy and measure it; cached in RESULT.json."""
    from shifu.config.imports import load_callable

    run_dir = out / "runs" / f"{method}-{label.replace('=', '')}-s{seed}"
    result_file = run_dir / "RESULT.json"
    name = f"{method} {label} seed {seed}"
    over = _trainer_overrides(method, plan, plan["points"][method][label], shared, seed)
    prompts = digest([r["prompt"] for r in ev["rows"]])  # which held-out prompts measure it
    measured = {**{k: v for k, v in ev.items() if k != "rows"}, "prompts": prompts}
    recorded = as_recorded({"train": over, "eval": measured}, out)
    if result_file.exists():
        result = json.loads(result_file.read_text(encoding="utf-8"))
        check_plan(f"run {name}", run_dir, result, recorded, lambda msg: log("study", msg))
        return result
    log("study", name)
    module = "shifu.trainers.dpo" if method == "dpo" else "shifu.trainers.ppo"
    t0, c0 = time.time(), time.process_time()
    train_stage(module, run_dir, over)
    seconds, cpu_seconds = time.time() - t0, time.process_time() - c0
    rows = ev["rows"]
    m = measure(
        run_dir / "final",
        shared["sft"],
        rows,
        load_callable(ev["gold"], "gold judge"),
        ev["max_new_tokens"],
        ev["temperature"],
        ev["seed"],
        ev["max_prompt_len"],
    )
    result = {
        "method": method,
        "point": label,
        "seed": seed,
        "gold": m["gold"],
        "kl": m["kl"],
        "response_len": m["response_len"],
        "train_seconds": round(seconds, 2),
        "train_cpu_seconds": round(cpu_seconds, 2),  # every thread of the process: the critic's cost counts
        "proxy": _proxy(method, run_dir),
        "samples": m["samples"],
        "plan": recorded,
    }
    result_file.write_text(json.dumps(result, indent=2), encoding="utf-8")
    log("study", f"{name}: gold {m['gold']:.3f} at KL {m['kl']:.2f} nats ({seconds:.0f} s)")
    return result


def _proxy(method: str, run_dir: Path) -> float | None:
    """What the method optimised, at its end: mean objective/score of the last 5 iterations (PPO,
    REINFORCE), or the held-out implicit-reward margin (DPO)."""
    from shifu.runs.tracking import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if method == "dpo":
        vals = [r["eval/dpo/margin"] for r in rows if "eval/dpo/margin" in r]
        return vals[-1] if vals else None
    vals = [r["objective/score"] for r in rows if isinstance(r.get("objective/score"), (int, float))][-5:]
    return sum(vals) / len(vals) if vals else None

"""How far the imdb quickstart's RL is from what its SFT policy and reward model allow (diagnostics for the
"+0.6 gold at KL <= 6 nats" bar). Each mode reads a finished quickstart run directory ``RUN``
(``shifu quickstart --task imdb --seed S --out RUN``: data/, sft/, rm/) and prints JSON:

    python benchmarks/imdb_headroom.py best-of-n RUN --n 64 --prompts 64
        best of n SFT samples per held-out prompt, chosen by the reward model and by the gold judge, for
        n = 1, 2, 4, ... (the KL of best-of-n to the SFT policy is at most log n - (n - 1) / n nats)
    python benchmarks/imdb_headroom.py gold-reward RUN --out DIR [--set ppo.key=value ...]
        the quickstart's RL stage (its plan plus --set) rewarded by the gold judge itself instead of the
        reward model: what a perfect reward model would give at the same settings
    python benchmarks/imdb_headroom.py raft RUN --out DIR --n 16 --prompts 512 --lr 1e-3 --epochs 8
        offline rejection-sampling fine-tuning (RAFT, Dong et al. 2023): SFT of the SFT policy on the best (by
        the reward model) of n samples for the first training prompts

    python benchmarks/imdb_headroom.py rm-screen RUN --out DIR --judge RUN0 RUN1 RUN2 [--set rm.key=value ...]
        a reward-model variant (the plan's pairs and rm stages plus --set) trained on RUN's SFT policy, judged
        against the gold judge where it matters for RL: pair accuracy and Spearman correlation on the
        held-out samples of the SFT policy and of the *trained* policies of the --judge runs
        (samples_before/after.jsonl), and accuracy against the noiseless judge on its own held-out pairs

    python benchmarks/imdb_headroom.py judge RUN --policy DIR --out DIR2 --seed S
        the quickstart's held-out evaluation of any policy from RUN's SFT policy (e.g. a `shifu merge` of
        several of its PPO runs: `shifu merge --base RUN/sft/final --out DIR RUN/ppo RUN/ppo-2`)

gold-reward and raft end with the quickstart's held-out evaluation (gain paired over the held-out prompts,
k3 KL per response) in DIR. One thread (``SHIFU_THREADS``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)
import torch

from shifu.config.imports import load_callable
from shifu.evaluation import final as ev_mod
from shifu.generation.rollout import SamplingParams
from shifu.pipelines import quickstart as qs
from shifu.pipelines.stages import Stages, ppo_overrides, train_stage
from shifu.rewards.sources import load_reward_model
from shifu.rollout.sources import SingleTurn
from shifu.runs.jsonfile import read_jsonl, write_jsonl

PRESET = "small"


def held_out_eval(run: Path, policy: Path, out: Path, plan: dict, seed: int) -> dict:
    """The quickstart's final evaluation of ``policy`` against run's SFT policy (samples in ``out``)."""
    ev = ev_mod.eval_settings(plan)
    s = ev_mod.evaluate(
        "imdb", run / "sft" / "final", policy, str(run / "data" / "prompts_eval.jsonl"), ev, seed, out
    )
    return {k: s[k] for k in ("gold_before", "gold_after", "gold_gain", "gold_gain_se", "kl", "kl_k1")}


def sample(run: Path, prompts: list[str], n: int, plan: dict, seed: int) -> list[str]:
    """n responses per prompt from run's SFT policy (prompt-major: response j of prompt i at i * n + j)."""
    ev = ev_mod.eval_settings(plan)
    rep = [p for p in prompts for _ in range(n)]
    params = SamplingParams(ev["max_new_tokens"], ev["temperature"])
    rows = [{"prompt": p} for p in rep]
    return ev_mod.judge_policy(
        run / "sft" / "final", None, rows, SingleTurn(None), params, seed, ev
    ).responses


def best_of_n(run: Path, n: int, num_prompts: int, plan: dict, seed: int) -> list[dict]:
    prompts = [r["prompt"] for r in read_jsonl(run / "data" / "prompts_eval.jsonl")][:num_prompts]
    responses = sample(run, prompts, n, plan, seed + 777)
    rep = [p for p in prompts for _ in range(n)]
    gold = torch.tensor(load_callable(qs.GOLD["imdb"], "gold judge")(rep, responses, None)).view(-1, n)
    score = load_reward_model(run / "rm" / "final").score_texts(rep, responses).view(-1, n)
    rows, k = [], 1
    while k <= n:
        g, s = gold[:, :k], score[:, :k]
        rows.append(
            {
                "n": k,
                "kl_bound": round(math.log(k) - (k - 1) / k, 3),
                "prompts": len(prompts),
                "gold_chosen_by_rm": round(g.gather(1, s.argmax(1, keepdim=True)).mean().item(), 4),
                "gold_chosen_by_gold": round(g.max(1).values.mean().item(), 4),
            }
        )
        k *= 2
    return rows


def from_sft_of(run: Path, out: Path, plan: dict, seed: int, name: str) -> tuple[Stages, dict, Path]:
    """A pipeline in ``out`` that starts from ``run``'s finished data and SFT stages (copied, then skipped):
    (its stages, the task files, the SFT policy)."""
    out.mkdir(parents=True, exist_ok=True)
    for stage in ("data", "sft"):
        if not (out / stage).exists():
            shutil.copytree(run / stage, out / stage, symlinks=True)
    stages = Stages(out, seed, name)
    files = stages.prepare("imdb", PRESET)
    return stages, files, stages.sft(plan["sft"], files)


def gold_reward(run: Path, out: Path, plan: dict, seed: int) -> dict:
    stages, files, sft_final = from_sft_of(run, out, plan, seed, "headroom")  # the RL stage starts here
    reward = {"function": qs.GOLD["imdb"]}
    stages.train("ppo", "shifu.trainers.ppo", ppo_overrides(plan["ppo"], sft_final, files, reward, seed))
    return held_out_eval(out, out / "ppo" / "final", out, plan, seed) | {"cpu_seconds": stages.cpu_seconds()}


def raft(
    run: Path, out: Path, n: int, num_prompts: int, lr: float, epochs: float, plan: dict, seed: int
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.process_time()
    prompts = [r["prompt"] for r in read_jsonl(run / "data" / "prompts_train.jsonl")][:num_prompts]
    responses = sample(run, prompts, n, plan, seed + 1)
    rep = [p for p in prompts for _ in range(n)]
    best = load_reward_model(run / "rm" / "final").score_texts(rep, responses).view(-1, n).argmax(1)
    write_jsonl(
        out / "best.jsonl",
        [{"prompt": p, "response": responses[i * n + int(best[i])]} for i, p in enumerate(prompts)],
    )
    t1 = time.process_time()
    sft_data = {k: plan["sft"]["data"][k] for k in ("max_prompt_len", "max_len")}
    over = {
        "seed": seed,
        "model": {"path": str(run / "sft" / "final")},
        "data": {"train": str(out / "best.jsonl"), "eval": str(run / "data" / "sft_eval.jsonl"), **sft_data},
        "batch_size": 32,
        "epochs": epochs,
        "max_steps": 0,
        "optim": {"lr": lr, "warmup_steps": 5},
        "eval": {"every": 0},
        "progress": False,
        "tensorboard": False,
    }
    train_stage("shifu.trainers.sft", out / "raft", over)
    t2 = time.process_time()
    result = held_out_eval(run, out / "raft" / "final", out, plan, seed)
    return result | {
        "n": n,
        "prompts": num_prompts,
        "lr": lr,
        "epochs": epochs,
        "cpu_seconds": {"sample_and_score": round(t1 - t0, 1), "sft": round(t2 - t1, 1)},
    }


def agreement(scores: list[float], gold: list[float], pairs: int = 20000) -> dict:
    """Pearson / Spearman of scores with gold, and the accuracy of score order on random pairs of unequal
    gold (seeded)."""
    s, g = torch.tensor(scores), torch.tensor(gold)
    rank = lambda x: torch.argsort(torch.argsort(x)).float()  # noqa: E731
    i, j = torch.randint(len(g), (2, pairs), generator=torch.Generator().manual_seed(0))
    keep = g[i] != g[j]
    right = ((s[i] > s[j]) == (g[i] > g[j]))[keep].float().mean()
    return {
        "pearson": round(float(torch.corrcoef(torch.stack([s, g]))[0, 1]), 4),
        "spearman": round(float(torch.corrcoef(torch.stack([rank(s), rank(g)]))[0, 1]), 4),
        "pair_acc": round(float(right), 4),
    }


def rm_screen(run: Path, out: Path, judge: list[Path], plan: dict, seed: int) -> dict:
    stages, files, sft_final = from_sft_of(run, out, plan, seed, "rm-screen")
    pairs = stages.imdb_pairs(
        sft_final, qs.preference_prompts(files, plan["pairs"].get("num_prompts")), plan["pairs"]
    )
    marker = stages.rm(plan["rm"], sft_final)
    rm = load_reward_model(out / "rm" / "final")
    result = {
        "rm_accuracy": marker.get("rm_accuracy"),
        "pairs": pairs.get("pairs"),
        "cpu_seconds": {"pairs": pairs.get("cpu_seconds"), "rm": marker.get("cpu_seconds")},
    }
    for which in ("before", "after"):
        rows = [r for d in judge for r in read_jsonl(d / f"samples_{which}.jsonl")]
        scores = rm.score_texts([r["prompt"] for r in rows], [r["response"] for r in rows]).tolist()
        result[f"samples_{which}"] = agreement(scores, [r["gold"] for r in rows]) | {"n": len(rows)}
    held = read_jsonl(out / "pairs" / "pairs_eval.jsonl")
    margin = rm.score_texts([r["prompt"] for r in held], [r["chosen"] for r in held]) - rm.score_texts(
        [r["prompt"] for r in held], [r["rejected"] for r in held]
    )
    gold = torch.tensor([r["gold_chosen"] - r["gold_rejected"] for r in held])
    result["noiseless_accuracy"] = round(float(((margin > 0) == (gold > 0))[gold != 0].float().mean()), 4)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["best-of-n", "gold-reward", "raft", "rm-screen", "judge"])
    ap.add_argument("run", type=Path, help="a finished imdb quickstart run directory")
    ap.add_argument("--out", type=Path, help="gold-reward / raft: where the new run goes; judge: the samples")
    ap.add_argument("--policy", type=Path, help="judge: the policy directory (e.g. written by shifu merge)")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    ap.add_argument("--n", type=int, default=64, help="samples per prompt")
    ap.add_argument(
        "--prompts", type=int, default=64, help="prompts (held-out for best-of-n, training for raft)"
    )
    ap.add_argument("--lr", type=float, default=1e-3, help="raft: SFT learning rate")
    ap.add_argument("--epochs", type=float, default=8.0, help="raft: SFT epochs over the chosen samples")
    ap.add_argument(
        "--set", action="append", default=[], help="gold-reward, rm-screen: stage.key=value on the plan"
    )
    ap.add_argument(
        "--judge", type=Path, nargs="*", default=[], help="rm-screen: finished runs whose samples judge"
    )
    provenance.add_arguments(ap)
    args = ap.parse_args(argv)
    plan = qs._plan("imdb", PRESET, args.set)
    if args.mode != "best-of-n" and args.out is None:
        ap.error(f"{args.mode} needs --out")
    if args.mode == "best-of-n":
        results = best_of_n(args.run, args.n, args.prompts, plan, args.seed)
    elif args.mode == "judge":
        if args.policy is None:
            ap.error("judge needs --policy DIR")
        results = [
            {"run": str(args.run), "policy": str(args.policy)}
            | held_out_eval(args.run, args.policy, args.out, plan, args.seed)
        ]
    elif args.mode == "gold-reward":
        results = [gold_reward(args.run, args.out, plan, args.seed)]
    elif args.mode == "rm-screen":
        if not args.judge:
            ap.error("rm-screen needs --judge RUN ... (finished quickstart runs)")
        results = [rm_screen(args.run, args.out, args.judge, plan, args.seed) | {"sets": args.set}]
    else:
        results = [raft(args.run, args.out, args.n, args.prompts, args.lr, args.epochs, plan, args.seed)]
    params = {"mode": args.mode, "run": args.run, "seed": args.seed, "sets": args.set}
    params |= {"n": args.n, "prompts": args.prompts} if args.mode in ("best-of-n", "raft") else {}
    params |= {"lr": args.lr, "epochs": args.epochs} if args.mode == "raft" else {}
    params |= {"policy": args.policy} if args.mode == "judge" else {}
    for row in results:
        print(json.dumps(row), flush=True)
        provenance.record(
            args, "imdb_headroom", row, params=params | ({"n": row["n"]} if "n" in row else {}), config=plan
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

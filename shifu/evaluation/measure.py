"""``shifu eval A [B]``: measure a policy on your own task, or two policies paired.

Each policy (a policy directory, or a run directory whose policy is found as ``shifu sample`` finds it) samples
one response (or one episode) per prompt of a prompt file (JSONL rows as ``shifu ppo`` reads them), judged by a
reward function (``--reward-function``, on the responses), a reward model (``--reward-model``), an environment
(``--env``: the episode's return) or an agent (``--agent``: episodes of an outside agent over the policy gateway,
as ``agent.factory`` runs them; the agent's return). With two, both sample the same prompts from the same sampling seed, so the
gain of B over A is paired: its standard error is that of the per-prompt differences
(:mod:`shifu.evaluation.compare`), and B's KL to A is measured over B's sampled tokens.

``--run RUN_DIR`` takes every setting from a ``shifu ppo`` run's ``config.yaml``: its judge (the environment or
the agent, episodes scored by their return; else ``eval.gold_function``, else its reward), the sampling
(``eval.temperature``, ``generation.*`` with the episode budgets, ``data.max_prompt_len``,
``data.chat_template``) and its held-out prompts (``data.eval``, or the held-out split of ``data.train``; the
first ``eval.final_prompts``); flags override any of them. Without policies it compares the run's start
(``model.path``) with its final policy.

The result is printed (mean ± standard error of each policy, the paired gain ± its standard error, the KL) and
written as a JSON record (``--out``; never over an existing file without ``--overwrite``) with the per-prompt
returns and responses, the settings and the command, from which every printed figure can be recomputed.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from shifu.core.stats import mean_se
from shifu.errors import ShifuError
from shifu.evaluation.evaluate import Evaluated
from shifu.evaluation.setup import Setup, setup

# ------------------------------------------------------------------------------------------ the measure


def measure(s: Setup, bar) -> tuple[list[Evaluated], list[list[float]], bool]:
    """Each policy's trajectories and scores (the same prompts and sampling seed), B with its KL to A when
    both read the same tokens; and whether the KL was measured."""
    from shifu.evaluation.compare import judge_loaded, load_policy
    from shifu.rewards.sources import same_tokenizer

    results, scores, first, with_kl = [], [], None, False
    for label, (given, path) in zip("AB", s.policies):
        bar.set_postfix_str(f"{label}: {given}", refresh=True)
        model, tok = load_policy(path, s.device)
        ref = None
        if first is not None and same_tokenizer(first[1], tok):
            ref, with_kl = first[0], True
        res = judge_loaded(model, tok, ref, s.rows, s.judge.source(tok), s.params, s.seed, s.ev, bar.update)
        results.append(res)
        scores.append([float(x) for x in (s.judge.score(res) if s.judge.score else res.returns)])
        first = first or (model, tok)
    return results, scores, with_kl


def finite_pairs(a: list[float], b: list[float]) -> list[float]:
    """The per-prompt differences ``b - a`` where both scores are finite (a failed reward is NaN)."""
    return [y - x for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]


def record(
    s: Setup, results: list[Evaluated], scores: list[list[float]], with_kl: bool, argv: list[str]
) -> dict:
    """The JSON record: the command, the judge, the prompts, the settings, per policy its mean and standard
    error, the paired gain and KL, and per prompt each policy's response and score (B's KL)."""
    out: dict[str, Any] = {
        "command": shlex.join(["shifu", "eval", *argv]),
        "judge": s.judge.name,
        "prompts": {"from": s.prompts, "count": len(s.rows)},
        "settings": s.settings,
        "policies": {},
    }
    for label, (given, path), res, sc in zip("AB", s.policies, results, scores):
        finite = [x for x in sc if math.isfinite(x)]
        mean, se = mean_se(finite) if finite else (None, None)
        entry = {
            "path": given,
            "directory": str(path),
            "mean": mean,
            "se": se,
            "not_finite": len(sc) - len(finite),
        }
        entry |= {"response_len": sum(res.lengths) / len(res)} | _episode_figures(res)
        out["policies"][label] = entry
    if len(results) == 2:
        diffs = finite_pairs(*scores)
        gain, gain_se = mean_se(diffs) if diffs else (None, None)
        after = results[1]
        out["paired"] = {
            "gain": gain,
            "gain_se": gain_se,
            "pairs": len(diffs),
            "kl": sum(after.kl_k3) / len(after) if with_kl else None,
            "kl_k1": sum(after.kl) / len(after) if with_kl else None,
        }
    out["rows"] = [
        {"prompt": row["prompt"]}
        | {
            label: {"response": res.transcripts[i].response, "score": sc[i]}
            | ({"kl": res.kl_k3[i], "kl_k1": res.kl[i]} if res.kl else {})
            for label, res, sc in zip("AB", results, scores)
        }
        for i, row in enumerate(s.rows)
    ]
    return out


def _episode_figures(res: Evaluated) -> dict[str, Any]:
    """Episodes: mean turns, the fraction truncated, and the fraction that called a tool where reported."""
    if not res.episodes:
        return {}
    n, uses = len(res), res.tool_use()
    out = {"turns": sum(res.counts["turns"]) / n, "truncated": sum(res.truncated) / n}
    if uses is not None:
        out["tool_use"], out["tool_use_se"] = mean_se(uses)
    return out


def result_lines(rec: dict[str, Any]) -> list[str]:
    """The record in words: what was measured, each policy's mean ± standard error, the paired gain, the KL."""
    st = rec["settings"]
    how = "greedy" if st["temperature"] == 0 else f"sampled at T={st['temperature']:g}"
    head = (
        f"shifu eval: {rec['prompts']['count']} prompts of {rec['prompts']['from']}, judged by {rec['judge']}, "
        f"{how} (seed {st['seed']})"
    )
    shown: list[tuple[str, str]] = []
    for label, p in rec["policies"].items():
        value = "no finite score" if p["mean"] is None else _pm(p["mean"], p["se"], " ")
        value += f" ({p['not_finite']} not finite, left out)" if p["not_finite"] else ""
        if "tool_use" in p:
            value += f"; tool use {_pm(p['tool_use'], p['tool_use_se'])}"
        shown.append((f"{label}  {p['path']}", value))
    paired = rec.get("paired")
    if paired is not None and paired["gain"] is not None:
        value = _pm(paired["gain"], paired["gain_se"], "+")
        shown.append(
            ("B - A", f"{value} (paired over {paired['pairs']} prompts: same prompts, same sampling seed)")
        )
    if paired is not None:
        kl = "not measured (A and B read different tokens)"
        if paired["kl"] is not None:
            kl = f" {paired['kl']:.4f} nats per response (k3; k1 {paired['kl_k1']:.4f})"
        shown.append(("KL(B || A)", kl))
    width = max(len(name) for name, _ in shown)
    return [head] + [f"  {name:<{width}}  {value}" for name, value in shown]


def _pm(mean: float, se: float | None, sign: str = "") -> str:
    return f"{mean:{sign}.4f}" + (f" ± {se:.4f}" if se is not None else "")


def default_out(s: Setup) -> Path:
    """``shifu-eval-<name>.json`` in the working directory, named after the last policy measured (a run
    directory's name rather than its ``final``)."""
    p = Path(s.policies[-1][0]).resolve()
    name = p.parent.name if p.name in ("final", "best") else p.name
    return Path(f"shifu-eval-{name or 'policy'}.json")


# ------------------------------------------------------------------------------------------ the command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shifu eval",
        description="measure a policy on your own prompts and judge, or two paired (B against A): mean ± "
        "standard error, the paired gain ± its standard error, B's KL to A; a JSON record of every prompt",
    )
    p.add_argument("policies", nargs="*", metavar="A [B]", help="policy or run directories (B compared to A)")
    p.add_argument(
        "--run", metavar="RUN_DIR", help="take the judge, sampling and held-out prompts of a shifu ppo run"
    )
    p.add_argument(
        "--prompts", metavar="FILE", help="prompt rows (JSONL with 'prompt', as shifu ppo reads them)"
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        metavar="N",
        help="the first N prompts (default: all; --run: eval.final_prompts)",
    )
    judge = p.add_mutually_exclusive_group()
    judge.add_argument(
        "--reward-function", metavar="PKG.MOD:FN", help="score responses with fn(prompts, responses, rows)"
    )
    judge.add_argument(
        "--reward-model", metavar="DIR", help="score responses with a reward model (a shifu rm run or final/)"
    )
    judge.add_argument(
        "--env", metavar="PKG.MOD:NAME", help="run episodes with an environment; the return is the score"
    )
    judge.add_argument(
        "--agent",
        metavar="PKG.MOD:FN",
        help="run episodes through an agent (async fn(client, row), as agent.factory); its return is the score",
    )
    p.add_argument(
        "--env-kwargs", metavar="JSON", help="keyword arguments of the environment (a JSON object)"
    )
    p.add_argument("--agent-kwargs", metavar="JSON", help="keyword arguments of the agent (a JSON object)")
    p.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature (0: greedy; default 0.7 or the run's eval.temperature)",
    )
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (1: off)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per response or turn (default 48 or the run's)")
    p.add_argument(
        "--stop", action="append", metavar="TEXT", help="a string that ends a response or turn (repeatable)"
    )
    p.add_argument("--max-turns", type=int, help="episodes: turns per episode (default 3 or the run's)")
    p.add_argument(
        "--max-total-tokens",
        type=int,
        help="episodes: sampled plus observation tokens (default 128 or the run's)",
    )
    p.add_argument(
        "--max-prompt-len", type=int, help="keep each prompt's last N tokens (default: the run's, else all)"
    )
    p.add_argument(
        "--no-chat-template", action="store_true", help="feed prompts as is, without the chat template"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every policy (default 0)")
    p.add_argument(
        "--batch-size", type=int, help="prompts sampled together (default 16 or the run's micro_batch_size)"
    )
    p.add_argument(
        "--out", metavar="FILE.json", help="the JSON record (default shifu-eval-<policy>.json here)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: SHIFU_THREADS)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``shifu eval A [B] (--prompts FILE | --run RUN) (--reward-function | --reward-model | --env | --agent |
    --run)``."""
    from shifu.parallel.threads import set_threads
    from shifu.runs import jsonfile
    from shifu.runs.tracking import progress

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    set_threads(args.threads)
    s = setup(args)
    out = Path(args.out) if args.out else default_out(s)
    if out.exists() and not args.overwrite:
        raise ShifuError(f"{out} exists: pass --overwrite to replace it, or another --out FILE")
    bar = progress(len(s.rows) * len(s.policies), "shifu eval", enabled=not args.no_progress)
    results, scores, with_kl = measure(s, bar)
    bar.close()
    rec = record(s, results, scores, with_kl, argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(jsonfile.dumps(rec, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print("\n".join(result_lines(rec)), flush=True)
    print(f"shifu eval: wrote {out} (every prompt's responses and scores)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

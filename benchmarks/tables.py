"""The results tables of the docs, generated from the records in ``benchmarks/results/*.jsonl``.

    python benchmarks/tables.py            # rewrite every generated block in README.md and docs/benchmarks/
    python benchmarks/tables.py --check    # exit 1 and name the stale blocks instead (what the test runs)
    python benchmarks/tables.py --print quickstart   # one table on stdout

A page holds a generated table between two marker comments; everything outside them is prose:

    <!-- BEGIN results:NAME -->
    ...generated, never edited by hand...
    <!-- END results:NAME -->

Every table names the CPU and the commit of each figure, and ends with where its records are and the command
that made them (``make docs-tables`` runs this script).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

ROOT = provenance.ROOT
PAGES = ("README.md", "docs/benchmarks/*.md")
BLOCK = re.compile(r"(<!-- BEGIN results:([\w-]+) -->\n)(.*?)(<!-- END results:\2 -->)", re.S)
TABLES: dict[str, Callable[[list[dict]], str]] = {}


def table(name: str):
    def register(fn):
        TABLES[name] = fn
        return fn

    return register


# ------------------------------------------------------------------------------------------------ helpers
def cpu_label(rec: dict) -> str:
    """The CPU in a few words: model, the widest vector ISA with native bf16 or AMX, cores."""
    cpu = rec.get("cpu")
    if cpu is None:
        return "unknown"
    flags = set(cpu["flags"])
    if {"amx_bf16", "amx_tile"} & flags:
        isa = "AMX"
    elif "avx512_bf16" in flags:
        isa = "AVX-512 + bf16"
    elif "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2"
    else:
        isa = "+".join(sorted(flags)) or "no vector flags"
    return f"{cpu['model']}, {isa}, {cpu['cores']} cores"


def commit_label(rec: dict) -> str:
    return rec["commit"][:7] + ("+" if rec.get("dirty") else "")


def md(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def footer(recs: list[dict], what: str = "") -> str:
    """Where the records are and the command(s) that made them."""
    files = sorted({f"benchmarks/results/{r['benchmark']}.jsonl" for r in recs})
    series = (
        sorted({r["series"] for r in recs if r.get("series")}) if all(r.get("series") for r in recs) else []
    )
    where = ", ".join(f"`{f}`" for f in files) + (f" (series {', '.join(series)})" if series else "")
    commands = list(dict.fromkeys(r["command"] for r in recs))
    if len(commands) <= 2:
        cmd = "; ".join(f"`{c}`" for c in commands)
    else:
        cmd = f"{len(commands)} commands, each in its record's `command`"
    migrated = sum("migrated" in r for r in recs)
    note = f"; {migrated} of them migrated from older files (their `migrated` field)" if migrated else ""
    n = f"{len(recs)} record{'s' if len(recs) != 1 else ''}"
    return f"\n\n{what}{n} in {where}{note}. Command: {cmd}."


def span(xs: list[float], spec: str) -> str:
    lo, hi = format(min(xs), spec), format(max(xs), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def none_yet(benchmark: str, command: str, what: str = "") -> str:
    return f"No {what}record in `benchmarks/results/{benchmark}.jsonl` yet: `{command}` writes them."


def se(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def pm(x: float, e: float | None = None, signed: bool = True, digits: int = 3) -> str:
    s = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return s if e is None or math.isnan(e) else f"{s} ± {e:.{digits}f}"


def select(
    records: list[dict], benchmark: str, series: str | tuple[str, ...] | None = None, **params
) -> list:
    series = (series,) if isinstance(series, str) else series
    return [
        r
        for r in records
        if r["benchmark"] == benchmark
        and (series is None or r.get("series") in series)
        and all(r["params"].get(k) == v for k, v in params.items())
    ]


def metric(rec: dict, *names: str, default=None):
    for n in names:
        if rec["metrics"].get(n) is not None:
            return rec["metrics"][n]
    return default


def sets_label(sets: list[str], drop: tuple[str, ...] = ()) -> str:
    """``--set`` values for a table cell: a key set twice shows its last value, ``drop`` prefixes (settings
    equal to the plan's, named in the table's footer) are left out, and so is ``ppo.``."""
    last = {s.split("=", 1)[0]: s for s in sets}
    keep = [s.removeprefix("ppo.") for s in last.values() if not s.startswith(drop)]
    return " ".join(f"`{s}`" for s in keep) or "defaults"


# settings the imdb `small` plan (MiniLM era) already had, recorded in full by some runs
PLAN_IMDB = (
    "ppo.batch_size=64",
    "ppo.minibatch_size=32",
    "ppo.ppo_epochs=4",
    "ppo.algo=ppo",
    "ppo.loss_aggregation=token_mean",
    "ppo.ent_coef=0.0",
    "ppo.optim.warmup_steps=0",
    "ppo.optim.betas=[0.9,0.95]",
    "ppo.kl.target=7.0",
    "ppo.kl.horizon=2000",
    "ppo.lora.alpha=32.0",
    "ppo.lora.dropout=0.0",
    "ppo.lora.critic=false",
    "ppo.lora.enabled=true",
)


METHOD = {
    "ppo": "PPO",
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "rloo": "RLOO",
    "reinforce_pp": "REINFORCE++",
    "reinforce_pp_baseline": "REINFORCE++ baseline",
    "gspo": "GSPO",
    "reinforce": "REINFORCE",
    "dpo": "DPO",
    "bon": "best-of-G",
}
GOLD = {"arith": "exact match", "imdb": "VADER"}


# ------------------------------------------------------------------------------------------- quickstart
def default_runs(records: list[dict]) -> list[dict]:
    """Runs of a task's default plan; the SmolLM2 presets have a table of their own (``smollm2``)."""
    return [
        r
        for r in select(records, "quickstart")
        if r["params"].get("plan") == "default"
        and not r["params"].get("rejudged")
        and r["params"].get("preset") != "smollm2"
    ]


def by_key(recs: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        out[key(r)].append(r)
    return out


def time_cell(recs: list[dict]) -> str:
    cpu = [metric(r, "cpu_seconds_total") for r in recs]
    if all(c is not None for c in cpu):
        return f"{min(cpu):.0f}-{max(cpu):.0f} CPU s" if len(cpu) > 1 else f"{cpu[0]:.0f} CPU s"
    wall = [metric(r, "seconds_total") for r in recs]
    if any(w is None for w in wall):
        return "-"
    return f"{min(wall):.0f}-{max(wall):.0f} s wall" if len(wall) > 1 else f"{wall[0]:.0f} s wall"


def task_cell(r: dict) -> str:
    p = r["params"]
    label = p.get("plan_label")
    return f"{p['task']} `{p['preset']}`" + (f" ({label})" if label else "")


@table("quickstart")
def quickstart(records: list[dict]) -> str:
    """Per task and CPU: the default plan of the newest commit measured on >= 3 seeds (else the newest)."""
    groups = by_key(default_runs(records), lambda r: (r["params"]["task"], cpu_label(r), r["commit"]))
    chosen: dict[tuple, list[dict]] = {}
    for (task, cpu, _), recs in sorted(groups.items(), key=lambda kv: max(r["date"] for r in kv[1])):
        seeds = {r["params"]["seed"] for r in recs}
        old = chosen.get((task, cpu))
        if old is None or len(seeds) >= 3 or len({r["params"]["seed"] for r in old}) < 3:
            chosen[(task, cpu)] = sorted(recs, key=lambda r: r["params"]["seed"])
    rows = []
    for (task, cpu), recs in sorted(chosen.items()):
        gains = [metric(r, "gold_gain") for r in recs]
        ses = [metric(r, "gold_gain_se") for r in recs]
        before = [metric(r, "gold_before") for r in recs]
        after = [metric(r, "gold_after") for r in recs]
        kls = [metric(r, "kl") for r in recs]
        rows.append(
            [
                task_cell(recs[0]),
                ", ".join(str(r["params"]["seed"]) for r in recs),
                f"{GOLD[task]} {statistics.mean(before):.3f} → {statistics.mean(after):.3f}",
                f"{pm(statistics.mean(gains), se(gains))} (each ± {span(ses, '.3f')})",
                f"{min(kls):.2f}-{max(kls):.2f}",
                time_cell(recs),
                cpu,
                commit_label(recs[0]),
            ]
        )
    used = [r for recs in chosen.values() for r in recs]
    return md(
        [
            "task (plan)",
            "seeds",
            "gold before → after (mean)",
            "gain: mean ± s.e. over seeds",
            "KL (nats)",
            "time per run",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(used)


@table("quickstart-runs")
def quickstart_runs(records: list[dict]) -> str:
    """Every recorded run of a default plan, one row per seed: what one run of yours can be compared with."""
    recs = sorted(
        default_runs(records),
        key=lambda r: (r["params"]["task"], cpu_label(r), r["date"], r["params"]["seed"]),
    )
    rows = [
        [
            task_cell(r),
            r["params"]["seed"],
            f"{metric(r, 'gold_before'):.3f} → {metric(r, 'gold_after'):.3f}"
            if metric(r, "gold_before") is not None and metric(r, "gold_after") is not None
            else "-",
            pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
            f"{metric(r, 'kl'):.2f}",
            metric(r, "eval_prompts", default="-"),
            time_cell([r]),
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    return md(
        [
            "task (plan)",
            "seed",
            "gold before → after",
            "gain ± paired s.e.",
            "KL (nats)",
            "held-out prompts",
            "time",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


@table("smollm2")
def smollm2(records: list[dict]) -> str:
    """The SmolLM2-135M recipe (``benchmarks/smollm2_recipe.py --record``), one row per run."""
    recs = sorted(
        select(records, "quickstart", preset="smollm2"),
        key=lambda r: (r["params"]["task"], r["date"], r["params"]["seed"]),
    )
    if not recs:
        return none_yet("quickstart", "python benchmarks/smollm2_recipe.py --jobs 2 --record", "`smollm2` ")
    rows = [
        [
            r["params"]["task"],
            r["params"]["seed"],
            f"{metric(r, 'gold_before'):.3f} → {metric(r, 'gold_after'):.3f}",
            pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
            fmt(metric(r, "gain_in_se"), ".1f"),
            f"{metric(r, 'kl'):.2f}",
            tool_use_cell(r),
            time_cell([r]),
            fmt(metric(r, "peak_rss_mb"), ".0f"),
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    headers = [
        "task",
        "seed",
        "gold before → after",
        "gain ± paired s.e.",
        "gain / s.e.",
        "KL (nats)",
        "tool use before → after",
        "time",
        "peak RSS (MiB)",
        "CPU",
        "commit",
    ]
    return md(headers, rows) + footer(recs)


def tool_use_cell(r: dict) -> str:
    before, after = metric(r, "tool_use_before"), metric(r, "tool_use_after")
    return "-" if before is None or after is None else f"{before:.3f} → {after:.3f}"


@table("arith-tool")
def arith_tool(records: list[dict]) -> str:
    """``shifu quickstart --task arith_tool`` per method and environment: the seeds' mean accuracy before and
    after, the gain's mean ± its standard error over seeds, the calculator use, the CPU time of each run."""
    recs = select(records, "arith_tool")
    if not recs:
        return none_yet("arith_tool", "python -m shifu quickstart --task arith_tool", "")
    groups = by_key(recs, lambda r: (r["params"]["env"], r["params"]["method"], cpu_label(r), r["commit"]))
    rows = []
    for (env, method, cpu, _), rs in sorted(
        groups.items(),
        key=lambda kv: (kv[0][0] != "shifu.tasks.arith_tool:calculator_env", kv[0][1] != "ppo"),
    ):
        rs = sorted(rs, key=lambda r: r["params"]["seed"])
        gains, ses = [metric(r, "gold_gain") for r in rs], [metric(r, "gold_gain_se") for r in rs]
        mean = statistics.mean
        gain = pm(mean(gains), se(gains)) if len(rs) > 1 else pm(gains[0], ses[0]) + " (paired over prompts)"
        rows.append(
            [
                {"ppo": "PPO (critic)", "grpo": "GRPO (`group_size=4`)"}.get(method, method),
                f"`{env}`",
                ", ".join(str(r["params"]["seed"]) for r in rs),
                f"{mean(metric(r, 'gold_before') for r in rs):.3f} → {mean(metric(r, 'gold_after') for r in rs):.3f}",
                gain,
                f"{mean(metric(r, 'tool_use_before') for r in rs):.3f} → {mean(metric(r, 'tool_use_after') for r in rs):.3f}",
                time_cell(rs),
                cpu,
                commit_label(rs[0]),
            ]
        )
    headers = [
        "method",
        "environment",
        "seeds",
        "accuracy before → after (mean)",
        "gain: mean ± s.e. over seeds",
        "calculator use before → after",
        "time per run",
        "CPU",
        "commit",
    ]
    return md(headers, rows) + footer(recs)


# ---------------------------------------------------------------------------------------- study frontier
@table("frontier-imdb")
def frontier_imdb(records: list[dict]) -> str:
    recs = select(records, "study_frontier", "imdb-reduced")
    rows = []
    for r in recs:
        m = r["metrics"]
        sft = m["sft"]["gold"]
        rows.append(["SFT", "-", f"{sft:.3f}", "-", "0", "-", "-", cpu_label(r), commit_label(r)])
        for method, res in m["methods"].items():
            for pt in res["points"]:
                golds = [s["gold"] for s in pt["per_seed"]]
                cpu = statistics.mean(s["train_cpu_seconds"] for s in pt["per_seed"])
                rows.append(
                    [
                        METHOD.get(method, method),
                        pt["point"].replace("=", " "),
                        pm(statistics.mean(golds), se(golds), signed=False),
                        f"{statistics.mean(golds) - sft:+.2f}",
                        f"{pt['kl_mean']:.1f}",
                        f"{cpu:.0f}",
                        len(golds),
                        cpu_label(r),
                        commit_label(r),
                    ]
                )
    return md(
        [
            "method",
            "point",
            "gold ± s.e. over seeds",
            "gain over SFT",
            "KL (nats)",
            "CPU s per run",
            "seeds",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


@table("frontier-imdb-vs-ppo")
def frontier_imdb_vs_ppo(records: list[dict]) -> str:
    recs = select(records, "study_frontier", "imdb-reduced")
    rows = []
    for r in recs:
        for method, pts in r["metrics"]["vs_ppo_pairwise"].items():
            for p in pts:
                rows.append(
                    [
                        METHOD.get(method, method),
                        f"{p['kl']:.1f}",
                        f"{p['ppo']:.3f}",
                        f"{p[method]:.3f}",
                        pm(p["ppo_minus"], p["se"]),
                        cpu_label(r),
                        commit_label(r),
                    ]
                )
    return md(
        ["method", "KL (nats)", "PPO gold", "method's gold", "PPO − method ± s.e.", "CPU", "commit"], rows
    ) + footer(
        recs,
        "Each seed read along its own frontier (linear in ln KL) on the KL range the two methods share. ",
    )


# ------------------------------------------------------------------------------- method comparisons
def seed_table(recs: list[dict]) -> dict[str, dict[int, dict]]:
    """method -> seed -> record, methods in :data:`METHOD` order."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in recs:
        out[r["params"]["method"]][r["params"]["seed"]] = r
    order = list(METHOD)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def slope_adjusted(
    runs: dict[str, dict[int, dict]], base: str = "ppo"
) -> tuple[float, dict[str, list[float]]]:
    """The gain-KL slope pooled within methods, and each method's per-seed difference from ``base`` moved
    along it to ``base``'s KL."""
    num = den = 0.0
    for seeds in runs.values():
        kls = [metric(r, "kl") for r in seeds.values()]
        gs = [metric(r, "gold_gain") for r in seeds.values()]
        mk, mg = statistics.mean(kls), statistics.mean(gs)
        num += sum((k - mk) * (g - mg) for k, g in zip(kls, gs))
        den += sum((k - mk) ** 2 for k in kls)
    slope = num / den if den else 0.0
    adj = {}
    for method, seeds in runs.items():
        common = sorted(set(seeds) & set(runs[base]))
        adj[method] = [
            metric(seeds[s], "gold_gain")
            - metric(runs[base][s], "gold_gain")
            - slope * (metric(seeds[s], "kl") - metric(runs[base][s], "kl"))
            for s in common
        ]
    return slope, adj


@table("critic-dense")
def critic_dense(records: list[dict]) -> str:
    recs = select(records, "quickstart", "dense-critic", task="imdb")
    recs = [r for r in recs if r["params"].get("method") and r["params"].get("plan") != "default"]
    summaries = {r["params"]["method"]: r for r in select(records, "quickstart_methods", "dense-critic")}
    runs = seed_table(recs)
    slope, adj = slope_adjusted(runs)
    rows = []
    for method, seeds in runs.items():
        ss = sorted(seeds)
        gains = [metric(seeds[s], "gold_gain") for s in ss]
        kls = [metric(seeds[s], "kl") for s in ss]
        paired = [g - metric(runs["ppo"][s], "gold_gain") for s, g in zip(ss, gains)]
        summ = summaries.get(method, {"metrics": {}})
        rl = summ["metrics"].get("rl_cpu_seconds_mean")
        per_min = summ["metrics"].get("gain_per_rl_cpu_minute")
        first = seeds[ss[0]]
        rows.append(
            [
                METHOD.get(method, method),
                " / ".join(f"{g:+.3f}" for g in gains),
                pm(statistics.mean(gains), se(gains)),
                " / ".join(f"{k:.2f}" for k in kls),
                "-" if rl is None else f"{rl:.0f}",
                "-" if per_min is None else f"{per_min:.3f}",
                "—" if method == "ppo" else pm(statistics.mean(paired), se(paired)),
                "—" if method == "ppo" else pm(statistics.mean(adj[method]), se(adj[method])),
                cpu_label(first),
                commit_label(first),
            ]
        )
    return md(
        [
            "method",
            "gain per seed",
            "mean ± s.e. over seeds",
            "KL per seed (nats)",
            "RL stage CPU s (mean)",
            "gain per RL CPU-minute",
            "− PPO, paired by seed",
            "− PPO at PPO's KL",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(
        recs + list(summaries.values()),
        f"At PPO's KL: each seed's difference moved along the gain-KL slope fitted within methods "
        f"({slope:.3f} gold per nat). ",
    )


@table("arith-methods")
def arith_methods(records: list[dict]) -> str:
    recs = select(records, "quickstart", "arith-methods", task="arith")
    rows = []
    for same in (False, True):
        runs = seed_table([r for r in recs if r["params"].get("same_prompts", False) == same])
        for method, seeds in runs.items():
            ss = sorted(seeds)
            gains = [metric(seeds[s], "gold_gain") for s in ss]
            group = any(s.startswith("ppo.group_size") for s in seeds[ss[0]]["params"]["sets"])
            batch = (
                "512 (128 prompts x 4)"
                if same
                else ("128 (32 prompts x 4)" if group else "128 (128 prompts)")
            )
            wall = [metric(seeds[s], "seconds_total") for s in ss]
            rows.append(
                [
                    METHOD.get(method, method),
                    batch,
                    " / ".join(f"{g:+.3f}" for g in gains),
                    pm(statistics.mean(gains), se(gains)),
                    sum(g >= 0.15 for g in gains),
                    " / ".join(f"{metric(seeds[s], 'kl'):.1f}" for s in ss),
                    f"{min(wall):.0f}-{max(wall):.0f}",
                    cpu_label(seeds[ss[0]]),
                    commit_label(seeds[ss[0]]),
                ]
            )
    return md(
        [
            "method",
            "responses per iteration",
            "gain seed 0 / 1 / 2",
            "mean ± s.e. over seeds",
            "seeds ≥ +0.15",
            "KL (nats)",
            "s wall per run",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


# --------------------------------------------------------------------------------------- imdb variants
def gain_row(r: dict, label: str) -> list:
    g, kl = metric(r, "gold_gain"), metric(r, "kl")
    cpu = metric(r, "cpu_seconds_total")
    return [
        label,
        r["params"]["seed"],
        pm(g, metric(r, "gold_gain_se")),
        f"{kl:.2f}",
        f"{g / kl:.3f}",
        metric(r, "eval_prompts", default="-"),
        "-" if cpu is None else f"{cpu:.0f}",
        cpu_label(r),
        commit_label(r),
    ]


@table("imdb-variants")
def imdb_variants(records: list[dict]) -> str:
    """Every single-setting run of the imdb ``small`` quickstart with the MiniLM reward model, by KL."""
    recs = select(records, "quickstart", ("imdb-variants", "imdb-soups", "imdb-bf16"), task="imdb")
    recs = [
        r
        for r in recs
        if "before the LoRA decoding fix" not in (r.get("note") or "")
        and r["params"].get("plan") != "default"
    ]
    recs.sort(key=lambda r: metric(r, "kl"))
    rows = [
        gain_row(
            r,
            sets_label(r["params"]["sets"], PLAN_IMDB)
            + (" (re-judged)" if r["params"].get("rejudged") else ""),
        )
        for r in recs
    ]
    return md(
        [
            "settings (`--set`, ppo. left out)",
            "seed",
            "gain ± paired s.e.",
            "KL (nats)",
            "gain per nat",
            "held-out prompts",
            "CPU s (pipeline)",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


MINILM_DROP = (
    "ppo.advantage_estimator=",
    "ppo.kl.controller=fixed",
    "ppo.kl.init_coef=0.25",
    "ppo.group_size=",
    "ppo.kl.penalty=",
    "ppo.optim.lr=",
    "ppo.iterations=",
)  # the GRPO setting, in the footer
RM_DROP = (
    "ppo.advantage_estimator=",
    "ppo.group_size=",
    "ppo.kl.penalty=",
    "ppo.optim.lr=",
    "ppo.iterations=",
    "rm.batch_size=",
    "rm.optim.lr=0.05",
    "rm.epochs=",
    "rm.l2_coef=",
    "ppo.reward.dense=",
)


@table("imdb-reward-models")
def imdb_reward_models(records: list[dict]) -> str:
    recs = select(records, "quickstart", "imdb-reward-models", task="imdb")
    recs.sort(
        key=lambda r: (
            r["params"]["sets"][:1] == ["rm.model.path=bag-of-tokens"]
            or "rm.model.path=bag-of-tokens" in r["params"]["sets"],
            metric(r, "kl"),
        )
    )
    rows = []
    for r in recs:
        bow = "rm.model.path=bag-of-tokens" in r["params"]["sets"]
        sets = [s for s in r["params"]["sets"] if s != "rm.model.path=bag-of-tokens"]
        rm = ("bag of tokens, dense rewards" if bow else "MiniLM") + (
            " (12000 prompts)" if "pairs.num_prompts=12000" in sets else ""
        )
        label = sets_label(
            [s for s in sets if s != "pairs.num_prompts=12000"], RM_DROP if bow else MINILM_DROP
        )
        g = metric(r, "gold_gain")
        rows.append(
            [
                rm,
                label,
                r["params"]["seed"],
                pm(g, metric(r, "gold_gain_se")),
                f"{metric(r, 'kl'):.2f}",
                f"{metric(r, 'rm_accuracy'):.2f}",
                f"{metric(r, 'cpu_seconds_total'):.0f}",
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "reward model",
            "other settings",
            "seed",
            "gain ± paired s.e.",
            "KL (nats)",
            "RM held-out acc.",
            "CPU s (pipeline)",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(
        recs,
        "MiniLM rows run the GRPO setting `advantage_estimator=grpo group_size=4 kl.penalty=loss "
        "kl.controller=fixed kl.init_coef=0.25 optim.lr=1.5e-4 iterations=80`; bag-of-tokens rows PPO with `rm.batch_size=64 rm.optim.lr=0.05 "
        "rm.epochs=10 rm.l2_coef=1e-3 ppo.reward.dense=true`. ",
    )


@table("imdb-soups")
def imdb_soups(records: list[dict]) -> str:
    """Each judged policy of a merge experiment: its runs alone, their means, scaled means."""
    recs = select(records, "imdb_headroom", "soups", mode="judge")
    order = list(dict.fromkeys(r["params"]["experiment"] for r in recs))

    def key(r: dict) -> tuple:
        p = r["params"]
        return order.index(p["experiment"]), p["seed"], "alone" not in p["policy"], p["policy"]

    rows = [
        [
            r["params"]["experiment"],
            r["params"]["seed"],
            r["params"]["policy"],
            pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
            f"{metric(r, 'kl'):.2f}",
            cpu_label(r),
            commit_label(r),
        ]
        for r in sorted(recs, key=key)
    ]
    return md(
        ["runs", "seed", "policy judged", "gain ± paired s.e.", "KL (nats)", "CPU", "commit"], rows
    ) + footer(
        recs,
        "Merged by `shifu merge` (base + scale x mean of the runs' changes to it); every policy judged by "
        "the quickstart's evaluation on the 1000 held-out prompts. ",
    )


@table("imdb-headroom")
def imdb_headroom(records: list[dict]) -> str:
    mode_order = ["best-of-n", "gold-reward", "raft"]
    recs = sorted(
        select(records, "imdb_headroom", "headroom"),
        key=lambda r: (
            mode_order.index(r["params"]["mode"]),
            r["params"].get("n", 0),
            r["params"].get("lr", 0),
        ),
    )
    rows = []
    for r in recs:
        p, m = r["params"], r["metrics"]
        if p["mode"] == "best-of-n":
            what = f"best of {p['n']} SFT samples, chosen by the reward model (by the gold judge)"
            res = f"gold {m['gold_chosen_by_rm']:.3f} ({m['gold_chosen_by_gold']:.3f}); SFT {m['gold_sft_mean_64x64']:.3f}"
            kl = f"≤ {m['kl_bound']:.2f}"
        elif p["mode"] == "gold-reward":
            what = "the RL stage rewarded by the gold judge instead of the reward model"
            res, kl = f"gain {pm(m['gold_gain'], m['gold_gain_se'])}", f"{m['kl']:.2f}"
        else:
            what = f"offline RAFT: SFT on the best of {p['n']} for {p['prompts']} prompts, lr {p['lr']:g}, {p['epochs']:g} epochs"
            res, kl = f"gain {pm(m['gain'], m['se'])}", f"{m['kl']:.2f}"
        rows.append([what, res, kl, cpu_label(r), commit_label(r)])
    return md(["diagnostic (imdb `small`, seed 0)", "result", "KL (nats)", "CPU", "commit"], rows) + footer(
        recs
    )


# ------------------------------------------------------------------------------------------- throughput
def fmt(x, spec=".2f", default="-"):
    return default if x is None else format(x, spec)


def ppo_shape(p: dict) -> str:
    return f"{p['shape']} R={p['new_tokens']}"


@table("ppo-vs-trl")
def ppo_vs_trl(records: list[dict]) -> str:
    recs = sorted(
        select(records, "ppo_iteration", mode="vs-trl"),
        key=lambda r: (r["params"]["shape"], r["params"]["new_tokens"], r["date"]),
    )
    rows = []
    for r in recs:
        s, p = r["metrics"]["summary"], r["params"]
        rss = s.get("peak_rss_mib", {})
        gen = fmt(s.get("generation_speedup_vs_hf")) + "x"
        if s.get("generation_speedup_bf16_decode_vs_hf"):
            gen += f" ({s['generation_speedup_bf16_decode_vs_hf']:.2f}x)"
        rows.append(
            [
                ppo_shape(p),
                f"{p['batch']} / {p['minibatch']}",
                fmt(s["shifu_median_s_per_iter"]),
                fmt(s["trl_median_s_per_iter"]),
                fmt(s["shifu_fast_median_s_per_iter"]),
                fmt(s["ratio_shifu_over_trl"]),
                fmt(s["throughput_fast_over_trl"]) + "x",
                fmt(s.get("throughput_fast_over_fp32")) + "x",
                " / ".join(fmt(rss.get(k), ".0f") for k in ("shifu", "trl", "shifu_fast")),
                gen,
                f"{p.get('rounds', 1)} x {p.get('iters', '?')}"
                + (", TRL also with shifu's malloc" if p.get("peer_malloc") else ""),
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "shape",
            "rollout B / minibatch",
            "shifu fp32 s/iter",
            "TRL 1.12 s/iter",
            "shifu fast s/iter",
            "fp32 / TRL time",
            "fast / TRL throughput",
            "fast / fp32 throughput",
            "peak RSS MiB shifu / TRL / fast",
            "generation vs HF generate fp32 (bf16 decode)",
            "rounds x iterations",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(
        recs,
        "Medians over rounds; 'fast' = shared-trunk critic and bf16 where the probe measures it faster. ",
    )


@table("ppo-phases")
def ppo_phases(records: list[dict]) -> str:
    recs = sorted(
        select(records, "ppo_iteration"),
        key=lambda r: (r["params"]["shape"], r["params"]["new_tokens"], r["date"]),
    )
    rows = []
    for r in recs:
        p = r["params"]
        if p["mode"] == "vs-trl":
            runs = [
                (name, rs[0]) for name, rs in r["metrics"]["runs"].items() if name in ("shifu", "shifu_fast")
            ]
        elif p["mode"] == "single":
            runs = [("shifu_fast" if p.get("fast") else "shifu", r["metrics"])]
        else:
            continue
        for name, m in runs:
            bf = m.get("bf16", {})
            chosen = [k for k in ("decode", "frozen", "update", "reward") if bf.get(k)]
            mode = "fp32" if name == "shifu" else "fast (bf16: " + (", ".join(chosen) or "none") + ")"
            rows.append(
                [
                    ppo_shape(p),
                    mode,
                    m.get("malloc", "-"),
                    fmt(m["median_s_per_iter"]),
                    " / ".join(
                        fmt(m.get(k)) for k in ("median_generation_s", "median_scoring_s", "median_train_s")
                    ),
                    fmt(m.get("mfu"))
                    + " ("
                    + " / ".join(fmt(m.get(k)) for k in ("mfu_generation", "mfu_scoring", "mfu_train"))
                    + ")",
                    fmt(m.get("peak_rss_mib"), ".0f"),
                    fmt(m.get("matmul_peak_gflops"), ".0f"),
                    cpu_label(r),
                    commit_label(r),
                ]
            )
    return md(
        [
            "shape",
            "shifu",
            "malloc",
            "s/iter (first round)",
            "generation / scoring / update s",
            "MFU (gen / scoring / update)",
            "peak RSS MiB",
            "fp32 GEMM peak GFLOP/s",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(
        [r for r in recs if r["params"]["mode"] != "budget-ab"],
        "MFU counts the useful fp32 FLOPs against the fp32 GEMM peak measured in the same process (bf16 runs "
        "can read above 1). ",
    )


@table("micro-batches")
def micro_batches(records: list[dict]) -> str:
    recs = select(records, "ppo_iteration", mode="budget-ab")
    rows = []
    for r in recs:
        s, p = r["metrics"]["summary"], r["params"]
        mean_len = statistics.mean(x["mean_response_len"] for x in r["metrics"]["runs"]["fixed"])
        rows.append(
            [
                ppo_shape(p),
                f"{mean_len:.1f}",
                p["budget"],
                fmt(s["update_s_fixed"]),
                fmt(s["update_s_budget"]),
                fmt(s["update_ratio_budget_over_fixed"]),
                " / ".join(fmt(x) for x in s["per_round_update_ratio"]),
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "shape",
            "mean response tokens",
            "micro_batch_tokens",
            "update s, fixed split",
            "update s, token budget",
            "budget / fixed",
            "per round",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


@table("decode-weights")
def decode_weights(records: list[dict]) -> str:
    recs = sorted(select(records, "decode_weights", mode="step"), key=lambda r: r["params"]["rows"])
    rows = []
    for r in recs:
        m = r["metrics"]
        rows.append(
            [
                r["params"]["rows"],
                *(f"{m['ms_per_step'][k]:.1f}" for k in ("fp32", "bf16", "int8")),
                *(f"{m['read_gb_per_s'][k]:.1f}" for k in ("fp32", "bf16", "int8")),
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "rows",
            "fp32 ms/step",
            "bf16 ms/step",
            "int8 ms/step",
            "fp32 GB/s",
            "bf16 GB/s",
            "int8 GB/s",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs, "SmolLM2-135M's 30 layers and tied head, one decode step. ")


@table("generation-head-order")
def generation_head_order(records: list[dict]) -> str:
    recs = sorted(select(records, "decode_weights", mode="generation"), key=lambda r: r["params"]["rows"])
    rows = []
    for r in recs:
        m = r["metrics"]
        rows.append(
            [
                r["params"]["rows"],
                fmt(m["speedup_vs_hf"]["plain"]) + "x",
                fmt(m["speedup_vs_hf"]["left"]) + "x",
                fmt(m["left_over_plain_speed"]) + "x",
                m["probe_chose"],
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "rows",
            "F.linear(h, W) vs HF",
            "(W @ h^T)^T vs HF",
            "second / first",
            "probe chose",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs, "128-token fp32 generations at the SmolLM2-135M shape. ")


@table("quickstart-bf16")
def quickstart_bf16(records: list[dict]) -> str:
    recs = sorted(
        select(records, "quickstart", "imdb-bf16", task="imdb"),
        key=lambda r: (len(r["params"]["sets"]), r["params"]["seed"]),
    )
    rows = []
    for r in recs:
        c = metric(r, "cpu_seconds", default={})
        ppo = sum(v for k, v in c.items() if k == "ppo" or k.startswith("ppo-"))
        rows.append(
            [
                sets_label(r["params"]["sets"]),
                r["params"]["seed"],
                fmt(c.get("rm"), ".0f"),
                f"{ppo:.0f}",
                f"{metric(r, 'cpu_seconds_total'):.0f}",
                pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
                f"{metric(r, 'kl'):.2f}",
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "settings",
            "seed",
            "reward model CPU s",
            "PPO CPU s (all runs)",
            "pipeline CPU s",
            "gain ± s.e.",
            "KL (nats)",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


@table("serve-load")
def serve_load(records: list[dict]) -> str:
    recs = [r for r in select(records, "serve_load") if r["params"].get("mode") in ("merged", "exact")]
    if not recs:
        return none_yet("serve_load", "python benchmarks/serve_load.py --record")
    rows = []
    for r in recs:
        m, p = r["metrics"], r["params"]
        rows.append(
            [
                p["mode"],
                p["clients"],
                fmt(m["rows_per_s"], ".1f"),
                fmt(m.get("in_process_rows_per_s"), ".1f"),
                fmt(m.get("ratio_vs_in_process")),
                f"{fmt(m.get('p50_ms'), '.1f')} / {fmt(m.get('p99_ms'), '.1f')}",
                fmt(m.get("rows_per_forward"), ".1f"),
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "server",
            "clients",
            "rows/s served",
            "rows/s in process",
            "ratio",
            "latency p50 / p99 ms",
            "rows per forward",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


@table("memory")
def memory(records: list[dict]) -> str:
    recs = select(records, "memory")
    if not recs:
        return none_yet("memory", "python benchmarks/memory.py --record")
    rows = [
        [
            r["params"]["config"],
            " ".join(f"`{a}`" for a in r["params"].get("args", [])) or "-",
            fmt(r["metrics"]["peak_rss_gb"], ".2f"),
            fmt(r["metrics"]["checkpoint_mb"], ".0f"),
            fmt(r["metrics"]["seconds_per_iteration"], ".1f"),
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    return md(
        ["configuration", "settings", "peak RSS GB", "checkpoint MB", "s per iteration", "CPU", "commit"],
        rows,
    ) + footer(recs)


# ---------------------------------------------------------------------------------------------- the pages
def pages() -> list[Path]:
    out = []
    for pattern in PAGES:
        out += sorted(ROOT.glob(pattern))
    return [p for p in out if p.exists()]


def render(text: str, records: list[dict], where: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown results block {name!r}; known: {', '.join(sorted(TABLES))}")
        return m.group(1) + TABLES[name](records) + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's generated block is stale")
    ap.add_argument("--print", dest="name", help="print one table")
    args = ap.parse_args(argv)
    records = provenance.load()
    if args.name:
        print(TABLES[args.name](records))
        return 0
    stale = []
    for page in pages():
        rel = str(page.relative_to(ROOT))
        text = page.read_text(encoding="utf-8")
        new = render(text, records, rel)
        if new != text:
            stale.append(rel)
            if not args.check:
                page.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale results tables in {', '.join(stale)}: run `make docs-tables`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

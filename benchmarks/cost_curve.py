"""The cost curve of docs/benchmarks/throughput.md from ``ppo_iteration.py --vs-trl`` runs.

    python benchmarks/cost_curve.py docs/img/cost_curve.png             # the records of series cost-curve
    python benchmarks/cost_curve.py OUT.png RUN.jsonl [RUN.jsonl ...]   # plot + a Markdown table on stdout

With no RUN files it reads the ``--vs-trl`` records of series ``cost-curve`` in
``benchmarks/results/ppo_iteration.jsonl`` (``ppo_iteration.py --vs-trl --record --series cost-curve``).
Each RUN file is one ``--vs-trl`` run's output (its ``{"run": ...}`` lines and the summary line). The plot: seconds per
iteration per generated token (the rollout sizes differ between shapes) for shifu fp32, TRL fp32 and shifu
fast, one group per (shape, response length); the table: the per-phase figures, MFU and peak RSS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def from_records(path: Path, series: str = "cost-curve") -> list[dict]:
    """The ``--vs-trl`` records of ``series`` in a provenance file, as :func:`load` returns a run."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("series") == series and rec["params"].get("mode") == "vs-trl":
            setup = {k: v for k, v in rec["params"].items() if k not in ("mode", "rounds", "iters", "warmup")}
            runs = {name: {**rs[0], "setup": setup} for name, rs in rec["metrics"]["runs"].items()}
            out.append({"runs": runs, "summary": rec["metrics"]["summary"], "setup": setup})
    return out


def load(path: Path) -> dict:
    runs, summary = {}, {}
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        js = json.loads(line)
        if "run" in js:
            runs[js["run"]] = js
        elif "ratio_shifu_over_trl" in js:
            summary = js
    return {"runs": runs, "summary": summary}


def label(setup: dict) -> str:
    return f"{setup['shape']} R={setup['new_tokens']}"


def table(results: list[dict]) -> str:
    head = (
        "| shape, response | rollout (B / minibatch) | system | s / iter | gen / scoring / update s | "
        "MFU (gen / scoring / update) | peak RSS MiB | shifu / TRL | gen vs HF |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in results:
        s, runs, summ = r["setup"], r["runs"], r["summary"]
        for name in ("shifu", "trl", "shifu_fast"):
            js = runs.get(name)
            if js is None:
                continue

            def f(k, fmt="{:.2f}", js=js):
                v = js.get(k)
                return "-" if v is None else fmt.format(v)

            phases = f"{f('median_generation_s')} / {f('median_scoring_s')} / {f('median_train_s')}"
            mfu = f"{f('mfu')} ({f('mfu_generation')} / {f('mfu_scoring')} / {f('mfu_train')})"
            if name == "trl":
                phases, mfu = "-", f("mfu")
            ratio = {
                "shifu": f"{summ.get('ratio_shifu_over_trl', float('nan')):.2f}",
                "shifu_fast": f"fast: {summ.get('throughput_fast_over_trl', float('nan')):.2f}x TRL, "
                f"{summ.get('throughput_fast_over_fp32', float('nan')):.2f}x fp32",
            }.get(name, "")
            gen = (
                f"{summ['generation_speedup_vs_hf']:.2f}x"
                if name == "shifu" and "generation_speedup_vs_hf" in summ
                else ""
            )
            system = {"shifu": "shifu fp32", "trl": "TRL 1.12 fp32", "shifu_fast": "shifu fast"}[name]
            if name == "shifu_fast":
                b = js.get("bf16", {})
                chosen = [k for k in ("decode", "frozen", "update", "reward") if b.get(k)]
                system += " (bf16: " + (", ".join(chosen) if chosen else "none") + ")"
            lines.append(
                f"| {label(s)} | {s['batch']} / {s['minibatch']} | {system} | {f('median_s_per_iter')} | {phases} | "
                f"{mfu} | {f('peak_rss_mib', '{:.0f}')} | {ratio} | {gen} |"
            )
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [("shifu", "shifu fp32"), ("trl", "TRL fp32"), ("shifu_fast", "shifu fast")]
    x = range(len(results))
    width = 0.27
    for j, (key, lab) in enumerate(names):
        ys = []
        for r in results:
            js = r["runs"].get(key)
            tokens = r["setup"]["batch"] * r["setup"]["new_tokens"]
            ys.append(js["median_s_per_iter"] / tokens * 1e3 if js else 0.0)
        ax.bar([i + (j - 1) * width for i in x], ys, width, label=lab)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [label(r["setup"]) for r in results], rotation=20, fontsize=8)
    ax.set_ylabel("ms per generated token (whole iteration)")
    ax.set_title("PPO iteration cost, 1 CPU thread")
    ax.legend(fontsize=8)
    ratios = [r["summary"].get("ratio_shifu_over_trl", float("nan")) for r in results]
    ax2.bar(list(x), ratios, color="C0")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xticks(list(x), [label(r["setup"]) for r in results], rotation=20, fontsize=8)
    ax2.set_ylabel("shifu fp32 / TRL fp32 seconds per iteration")
    ax2.set_title("lower is better")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    out, paths = Path(argv[0]), [Path(p) for p in argv[1:]]
    if not paths:
        results = from_records(Path(__file__).resolve().parent / "results" / "ppo_iteration.jsonl")
        order = {"toy": 0, "gpt2-12x512": 1}
        results.sort(key=lambda r: (order.get(r["setup"]["shape"], 2), r["setup"]["new_tokens"]))
        plot(results, out)
        print(table(results))
        return 0
    results = []
    for p in paths:
        r = load(p)
        if r["runs"]:
            r["setup"] = next(iter(r["runs"].values()))["setup"]
            results.append(r)
    plot(results, out)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

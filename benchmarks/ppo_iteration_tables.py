"""The tables of ``benchmarks/ppo_iteration.py``'s records: shifu against TRL, the phases of one iteration,
and the token-budget micro-batches.
"""

from __future__ import annotations

import statistics

from table_parts import commit_label, cpu_label, fmt, footer, md, select


def ppo_shape(p: dict) -> str:
    return f"{p['shape']} R={p['new_tokens']}"


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


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "ppo-vs-trl": ppo_vs_trl,
    "ppo-phases": ppo_phases,
    "micro-batches": micro_batches,
}

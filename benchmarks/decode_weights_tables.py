"""The tables of ``benchmarks/decode_weights.py``'s records: one decode step's weight reads, and the order of
the output head's product in whole generations.
"""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, select


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


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "decode-weights": decode_weights,
    "generation-head-order": generation_head_order,
}

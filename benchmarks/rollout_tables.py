"""The tables of the rollout benchmarks: ``env_concurrency.py`` (a slow environment's share of a rollout),
``agent_gateway.py`` (the agent source's load and HTTP overhead), ``agent_engine.py`` (the gateway's engine under
an agent workload, with and without prefix reuse), ``episode_engine.py`` (an environment's episodes in lockstep
against one running decode) and ``rss_timeline.py`` (peak memory per stage
and per PPO iteration of SmolLM2 runs)."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, select


def env_concurrency(records: list[dict]) -> str:
    recs = select(records, "env_concurrency")
    if not recs:
        return none_yet("env_concurrency", "python benchmarks/env_concurrency.py --record")
    rows = [
        [
            r["params"]["concurrency"],
            f"{r['params']['episodes']} x {r['params']['turns']}",
            fmt(r["params"]["step_sleep_s"] * 1000, ".0f"),
            fmt(r["metrics"]["rollout_s"], ".2f"),
            fmt(r["metrics"]["env_share_s"], ".2f"),
            fmt(r["metrics"]["env_share_over_three_steps"], ".2f") + "x",
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    headers = ["`env.concurrency`", "episodes x turns", "ms per step", "rollout s", "environment's share s"]
    headers += ["share / three steps' latency", "CPU", "commit"]
    return md(headers, rows) + footer(recs)


def agent_gateway(records: list[dict]) -> str:
    recs = select(records, "agent_gateway")
    if not recs:
        return none_yet("agent_gateway", "python benchmarks/agent_gateway.py --load --overhead --record")
    rows = []
    for r in recs:
        m, p = r["metrics"], r["params"]
        if p["mode"] == "load":
            what = f"{p['sessions']} sessions x {p['turns']} calls, {p['repeats']} rollouts"
            result = (
                f"{m['calls_answered']}/{m['calls_expected']} answered, p50 {m['p50_ms'] / 1000:.2f} s, "
                f"p99 {m['p99_ms'] / 1000:.2f} s, {m['calls_per_s']:.1f} calls/s"
            )
        else:
            what = f"{p['sessions']} episodes x {p['turns']} calls, in process vs through the gateway"
            result = (
                f"CPU {m['cpu_s_agent']:.2f} s vs {m['cpu_s_in_process']:.2f} s: {m['cpu_ratio']:.2f}x; "
                f"same trajectories: {'yes' if m['same_trajectories'] else 'NO'}"
            )
        rows.append(
            [
                p["mode"],
                what,
                result,
                fmt(m.get("completions_per_sampler_call"), ".1f"),
                cpu_label(r),
                commit_label(r),
            ]
        )
    headers = ["mode", "workload", "result", "completions per sampler call", "CPU", "commit"]
    return md(headers, rows) + footer(recs, f"Model: {recs[0]['params']['model']}. ")


ENGINE_NAMES = {
    "no_prefix_cache": "static",
    "static": "static",
}  # (the first records named it no_prefix_cache)


def agent_engine(records: list[dict]) -> str:
    recs = select(records, "agent_engine")
    if not recs:
        return none_yet("agent_engine", "python benchmarks/agent_engine.py --model tiny --record")
    rows = []
    for r in recs:
        m, p = r["metrics"], r["params"]
        what = (
            f"{p['model']}: {p['sessions']} x {p['turns']} calls, budgets {'/'.join(map(str, p['budgets']))}"
        )
        if "kv_mb" in p:  # (the records since the admitting loop's pool)
            tight = f", tight {p['tight_kv_mb']:g}" if p.get("tight_kv_mb") else ""
            what += f"; KV pool {p['kv_mb']:g}{tight} MB, prefix cache {p['cache_mb']:g} MB"
        if "malloc" in p:  # (the records since the server's malloc was set as shifu serve --policy sets it)
            what += f"; malloc {'/'.join(p['malloc'])}"
        for name, e in ((k, v) for k, v in m.items() if isinstance(v, dict)):
            same = e.get("same_answers_as_static", m.get("same_answers"))
            rows.append(
                [
                    what,
                    ENGINE_NAMES.get(name, name.replace("_", " ")),
                    fmt(e["tokens_per_s"], ".1f"),
                    f"{e['p50_ms'] / 1000:.1f} / {e['p99_ms'] / 1000:.1f}",
                    f"{e['prefill_tokens_per_conversation']:.0f} of {e['prompt_tokens_per_conversation']:.0f}",
                    fmt(e["hit_rate"], ".2f"),
                    fmt(e["peak_rss_mb"], ".0f"),
                    f"{e['kv_peak_mb']:.0f} ({e['kv_waits']})" if e.get("kv_peak_mb") else "–",
                    fmt(same, ".2f"),
                    cpu_label(r),
                    commit_label(r),
                ]
            )
    headers = ["workload", "engine", "tokens/s", "call p50 / p99 s", "prefill tokens per conversation"]
    headers += [
        "hit rate",
        "server peak RSS MB",
        "KV pool peak MB (waits)",
        "answers as static",
        "CPU",
        "commit",
    ]
    return md(headers, rows) + footer(recs, "A shared 2-core VM with other jobs running: times are noisy. ")


def episode_engine(records: list[dict]) -> str:
    recs = select(records, "episode_engine")
    if not recs:
        return none_yet("episode_engine", "python benchmarks/episode_engine.py --run RUN --record")
    rows = []
    for r in recs:
        m, p = r["metrics"], r["params"]
        schedule = p.get("schedule", "lockstep") if p["lag"] is None else f"running decode, lag {p['lag']}"
        if schedule == "lockstep-hf":
            schedule = "lockstep, peft's HF forward"
        policy = f"{p['run']}'s SFT" if p["policy"] == "sft/final" else p["policy"]
        policy += " with LoRA adapters" if p.get("lora") else ""
        workload = f"{policy}, plan {p['plan']}, {p['episodes']} episodes"
        rows.append(
            [
                workload,
                fmt(p["sleep_ms"], ".0f"),
                schedule,
                fmt(m["rollout_s"], ".3f"),
                f"{m['sampled_tokens']} / {m['turns']}",
                fmt(m["tokens_per_s"], ".0f"),
                fmt(m["time_vs_lockstep"], ".2f") + "x",
                cpu_label(r),
                commit_label(r),
            ]
        )
    headers = ["workload", "ms per step", "schedule", "rollout s", "tokens / turns", "tokens/s"]
    headers += ["time / lockstep's", "CPU", "commit"]
    return md(headers, rows) + footer(recs)


def rss_timeline(records: list[dict]) -> str:
    recs = select(records, "rss_timeline")
    if not recs:
        return none_yet("rss_timeline", "python benchmarks/rss_timeline.py quickstart --record")
    rows = []
    for r in recs:
        m, p = r["metrics"], r["params"]
        stages: dict[str, float] = {}
        for s in m["segments"]:
            if s["stage"] not in ("load", "prepare task"):
                stages[s["stage"]] = max(stages.get(s["stage"], 0.0), s["peak_mb"])
        ends = m["iteration_end_rss_mb"]
        rows.append(
            [
                p["workload"] + (f" ({p['task']})" if p.get("task") else ""),
                r.get("note") or "-",
                fmt(m["peak_rss_mb"] / 1024, ".2f"),
                ", ".join(f"{k} {v / 1024:.2f}" for k, v in stages.items()),
                " -> ".join(f"{x / 1024:.2f}" for x in ends) or "-",
                fmt(m["process_cpu_s"], ".0f"),
                cpu_label(r),
                commit_label(r),
            ]
        )
    headers = [
        "run",
        "what ran",
        "peak RSS GiB",
        "peak per stage GiB",
        "RSS after each PPO iteration GiB",
        "CPU s",
    ]
    return md(headers + ["CPU", "commit"], rows) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "env-concurrency": env_concurrency,
    "agent-gateway": agent_gateway,
    "agent-engine": agent_engine,
    "episode-engine": episode_engine,
    "rss-timeline": rss_timeline,
}

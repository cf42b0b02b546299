"""Results with provenance: the committed records are well-formed, the docs tables are what
benchmarks/tables.py generates from them now, and the writer produces records the tables can read."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


provenance = load("provenance")
tables = load("tables")
parts = load("table_parts")


def test_committed_tables_match_what_the_records_generate(capsys):
    rc = tables.main(["--check"])
    assert rc == 0, capsys.readouterr().err + " (run `make docs-tables`)"


def test_every_record_carries_its_provenance():
    records = provenance.load()  # check() on each: commit, cpu (or cpu_note), date, no machine path
    assert records, "benchmarks/results/ holds no record"
    for r in records:
        assert r["cpu"] is None or r["cpu"]["flags"] is not None
        assert isinstance(r["threads"], int) and r["torch"]
        assert r["command"].split()[0] in ("python", "shifu", "SHIFU_THREADS=1", "SHIFU_MALLOC=system")
        assert r["config_digest"] is None or len(r["config_digest"]) == 64


def test_record_commits_exist_in_the_history():
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    )
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: older commits are not here to check")
    commits = sorted({r["commit"] for r in provenance.load()})
    missing = [
        c
        for c in commits
        if subprocess.run(
            ["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT, capture_output=True
        ).returncode
        != 0
    ]
    assert not missing, f"records name commits the history does not hold: {missing}"


def test_no_absolute_machine_path_in_benchmarks_or_docs():
    files = subprocess.run(
        ["git", "ls-files", "benchmarks", "docs", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if not path.exists() or path.suffix in (".png", ".jpg"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        hits += [f"{name}: {p}" for p in (f"/{d}/" for d in provenance.MACHINE_DIRS) if p in text]
    assert not hits, hits


def test_a_written_record_has_the_format_and_feeds_a_table(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sys, "argv", [str(ROOT / "benchmarks" / "serve_load.py"), "--record", "--out", str(tmp_path / "x")]
    )
    monkeypatch.setenv("SHIFU_THREADS", "1")
    metrics = {
        "rows_per_s": 150.0,
        "p50_ms": 48.6,
        "p99_ms": 71.5,
        "rows_per_forward": 8.0,
        "ratio_vs_in_process": 0.99,
        "in_process_rows_per_s": 151.0,
        "cache": str(tmp_path / "c.json"),
    }
    params = {"mode": "merged", "clients": 1, "rows": 8}
    rec = provenance.make_record("serve_load", metrics, params=params, config=params, threads=1)
    out = provenance.append(rec, tmp_path / "serve_load.jsonl")
    (line,) = out.read_text().splitlines()
    back = json.loads(line)
    assert set(provenance.REQUIRED) <= back.keys()
    assert (
        back["commit"]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    )
    assert back["command"] == "SHIFU_THREADS=1 python benchmarks/serve_load.py --record --out .../x"
    assert back["config_digest"] == provenance.config_digest({"rows": 8, "clients": 1, "mode": "merged"})
    assert back["metrics"]["cache"] == ".../c.json"  # a path outside the repository keeps its name only
    assert {"model", "flags", "cores"} <= back["cpu"].keys()
    table = tables.TABLES["serve-load"]([back])
    assert "| merged | 1 | 150.0 | 151.0 | 0.99 | 48.6 / 71.5 | 8.0 |" in table
    assert back["commit"][:7] in table


def test_check_refuses_a_record_without_commit_cpu_or_with_a_machine_path():
    good = {
        "benchmark": "b",
        "date": "2026-01-01T00:00:00+00:00",
        "commit": "a" * 40,
        "command": "python x",
        "config_digest": None,
        "cpu": None,
        "cpu_note": "not recorded",
        "threads": 1,
        "torch": "2",
        "metrics": {},
    }
    provenance.check(good)
    with pytest.raises(ValueError, match="commit"):
        provenance.check(good | {"commit": "abc1234"})
    with pytest.raises(ValueError, match="cpu_note"):
        provenance.check({k: v for k, v in good.items() if k != "cpu_note"})
    with pytest.raises(ValueError, match="machine path"):
        provenance.check(good | {"metrics": {"run": "/" + "work/runs/a"}})
    with pytest.raises(ValueError, match="missing"):
        provenance.check({k: v for k, v in good.items() if k != "threads"})


def test_cpu_info_reads_model_flags_and_cores():
    info = provenance.cpu_info(
        "processor : 0\nmodel name : Some Xeon\nflags : fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n"
    )
    assert info["model"] == "Some Xeon"
    assert info["flags"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert parts.cpu_label({"cpu": info}).startswith("Some Xeon, AMX")


def test_render_fills_only_the_marked_blocks_and_names_an_unknown_one():
    text = (
        "prose\n<!-- BEGIN results:micro-batches -->\nstale\n<!-- END results:micro-batches -->\nmore prose\n"
    )
    out = tables.render(text, provenance.load(), "page.md")
    assert out.startswith("prose\n<!-- BEGIN results:micro-batches -->\n| shape |")
    assert out.endswith("<!-- END results:micro-batches -->\nmore prose\n") and "stale" not in out
    with pytest.raises(SystemExit, match="page.md: unknown results block 'nope'"):
        tables.render("<!-- BEGIN results:nope -->\n<!-- END results:nope -->\n", [], "page.md")


def quickstart_run(series: str, seed: int, gain: float, se: float, cpu: float, sets: list[str]) -> dict:
    metrics = {"gold_before": 0.1, "gold_after": 0.1 + gain, "gold_gain": gain, "gold_gain_se": se}
    metrics |= {
        "cpu_seconds_total": cpu,
        "peak_rss_mb": 3000.0 + seed,
        "kl": 1.0,
        "gain_in_se": gain / se if se else None,
    }
    params = {"task": "arith_tool", "preset": "smollm2", "seed": seed, "sets": sets}
    cpu_info = {"model": "AMD EPYC", "flags": [], "cores": 2}
    rec = {"benchmark": "quickstart", "series": series, "commit": "abcdef0" + "0" * 33, "cpu": cpu_info}
    return rec | {"params": params, "metrics": metrics, "date": f"2026-01-0{seed + 1}", "command": "x"}


def test_agent_equivalence_reads_a_second_standard_error_off_the_spread_of_three_seeds():
    run = quickstart_run
    env, agent = "agent-equivalence-zero-critic2-env", "agent-equivalence-zero-critic-agent"
    # per-seed differences +0.0, +0.2, +0.1: mean +0.1, their standard deviation 0.1, so 0.1 / sqrt(3) = 0.058
    recs = [run(env, s, g, 0.03, 1000.0, []) for s, g in enumerate([0.9, 0.6, 0.8])]
    recs += [run(agent, s, g, 0.03, 1000.0, []) for s, g in enumerate([0.9, 0.8, 0.9])]
    table = tables.TABLES["agent-equivalence"](recs)
    # the evaluation's standard error: sqrt(3 * 0.03^2) / 3 per side, sqrt(2) of that for the difference
    assert "| mean of 3 |" in table and "| +0.100 ± 0.024 (4.1 s.e.) | +0.100 ± 0.058 (1.7 s.e.) |" in table
    assert table.count("| - |") == 3  # the three single seeds


def test_a_seed_that_answered_alike_before_and_after_has_a_gain_of_zero_without_a_ratio():
    # every held-out episode failed before and after on both paths: gain 0, standard error 0
    run = quickstart_run
    recs = [run("agent-equivalence-zero-critic2-env", 3, 0.0, 0.0, 1000.0, [])]
    recs += [run("agent-equivalence-zero-critic-agent", 3, 0.0, 0.0, 1000.0, [])]
    table = tables.TABLES["agent-equivalence"](recs)
    assert (
        "| 3 | 0.100 → 0.100 | 0.100 → 0.100 | +0.000 ± 0.000 | +0.000 ± 0.000 | +0.000 ± 0.000 | - |"
        in table
    )


def test_agent_repeat_rows_pair_the_two_runs_of_a_seed():
    first, again = "agent-equivalence-zero-critic-agent", "agent-equivalence-zero-critic-repeat-agent"
    recs = [
        quickstart_run(first, 2, 0.8, 0.03, 1800.0, []),
        quickstart_run(again, 2, 0.6, 0.04, 1900.0, []),
        quickstart_run(first, 0, 0.9, 0.03, 1800.0, []),  # not run again: no row
    ]
    table = tables.TABLES["agent-repeat"](recs)
    assert "| 2 | +0.800 ± 0.030 | +0.600 ± 0.040 | -0.200 ± 0.050 (4.0 s.e.) | 1800 / 1900 |" in table
    assert "| 0 |" not in table


def test_agent_equivalence_rows_pair_each_seed_and_average_several():
    run = quickstart_run
    critic = ["ppo.advantage_estimator=gae"]
    recs = [
        run("agent-equivalence-critic-env", 0, 0.2, 0.03, 1000.0, critic),
        run("agent-equivalence-critic-agent", 0, 0.3, 0.04, 1100.0, critic),
        run("agent-equivalence-critic-env", 1, 0.4, 0.03, 1000.0, critic),
        run("agent-equivalence-critic-agent", 1, 0.5, 0.04, 1300.0, critic),
        run("agent-equivalence-critic-agent", 2, 0.9, 0.04, 1300.0, critic),  # no environment run: no row
        run(None, 3, 0.6, 0.05, 900.0, []),
    ]
    table = tables.TABLES["agent-equivalence"](recs)
    assert (
        "| 0 | 0.100 → 0.300 | 0.100 → 0.400 | +0.200 ± 0.030 (6.7 s.e.) | +0.300 ± 0.040 (7.5 s.e.) |"
        in table
    )
    assert (
        "| +0.100 ± 0.050 (2.0 s.e.) | - | 1000 / 1100 | 1.10x | 3000 / 3000 | AMD EPYC, no vector flags, 2 cores |"
        in table
    )
    # the mean of seeds 0 and 1: standard errors sqrt(2 * se^2) / 2, CPU summed, the larger peak
    assert (
        "| mean of 2 | 0.100 → 0.400 | 0.100 → 0.500 | +0.300 ± 0.021 (14.1 s.e.) | +0.400 ± 0.028 (14.1 s.e.) |"
        in table
    )
    assert (
        "| +0.100 ± 0.035 (2.8 s.e.) | - | 2000 / 2400 | 1.20x | 3001 / 3001 | AMD EPYC, no vector flags, 2 cores |"
        in table
    )
    assert "| 2 |" not in table and "| 3 |" not in table
    # two seeds give no spread to read a standard error off
    assert "mean of 2" in table and table.count("| - |") == 3
    # the preset's own table: only the run without --set
    smollm2 = tables.TABLES["smollm2"](recs)
    assert smollm2.count("| arith_tool |") == 1 and "| arith_tool | 3 |" in smollm2

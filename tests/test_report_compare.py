"""`shifu report RUN_A RUN_B ...`: one self-contained page overlaying several runs' curves, a summary table
whose numbers are checked against the runs' files, the config keys that differ, notes for what a run lacks,
and every image loaded in headless Chromium."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml
from test_report import CHECK_SCRIPT, Links, _chromium, png_size, write_run

from shifu.cli import main as cli
from shifu.reporting.compare import GOLD_VS_KL, OVERLAYS, config_differences, render_comparison, run_labels
from shifu.runs.tracking import Tracker, read_metrics

EVERY_PLOT = [p.name for p in OVERLAYS] + [GOLD_VS_KL]


def make_runs(tmp_path: Path) -> list[Path]:
    """Two quickstart-shaped runs that differ in their beta and length, and a single `shifu ppo` run
    directory (top-level metrics.jsonl) that never logged entropy."""
    a, b, c = tmp_path / "beta-0.05", tmp_path / "beta-0.2", tmp_path / "ppo-only"
    write_run(a)
    write_run(b, iterations=20, eval_every=4)
    for run, beta in ((a, 0.05), (b, 0.2)):
        config = {"out_dir": str(run / "ppo"), "seed": 0, "kl": {"init_coef": beta, "target": 6.0}}
        (run / "ppo" / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    after = [json.loads(x) for x in (b / "samples_after.jsonl").read_text().splitlines()]
    for row, gold in zip(after, (0.9, 0.8, 0.95)):  # run b does better on the held-out prompts
        row["gold"] = gold
    (b / "samples_after.jsonl").write_text("".join(json.dumps(r) + "\n" for r in after))
    t = Tracker(c, tensorboard=False)
    for it in range(1, 11):
        row = {"objective/score": 0.1 * it, "objective/kl": 0.5 * it, "objective/kl_coef": 0.1}
        t.log(it, row | ({"eval/kl": 0.5 * it, "gold/score": 0.05 * it} if it % 5 == 0 else {}))
    t.close()
    config = {
        "model": {"path": "sft/final"},
        "iterations": 10,
        "seed": 0,
        "kl": {"init_coef": 0.1, "target": 6.0},
    }
    (c / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return [a, b, c]


def images(page: str) -> list[bytes]:
    links = Links()
    links.feed(page)
    assert links.scripts == 0 and not links.hrefs and "http://" not in page and "https://" not in page
    prefix = "data:image/png;base64,"
    assert all(s.startswith(prefix) for s in links.srcs), "every image is inline"
    return [base64.b64decode(s[len(prefix) :]) for s in links.srcs]


def cells(page: str, label: str) -> list[str]:
    """The summary-table cells (text, with their class) of the run named ``label``."""
    row = re.search(rf"<tr><th title=[^>]*><span[^>]*></span>{re.escape(label)}</th>(.*?)</tr>", page)
    assert row, f"no summary row for {label}"
    return re.findall(r'<td class="([^"]*)">(.*?)</td>', row.group(1))


@pytest.mark.unit
def test_compare_page_overlays_runs_and_summarises_them(tmp_path: Path):
    a, b, c = make_runs(tmp_path)
    out = render_comparison([a, b, c], tmp_path / "out" / "compare.html")
    page = out.read_text(encoding="utf-8")
    pngs = images(page)
    assert len(pngs) == len(EVERY_PLOT)
    for i, raw in enumerate(pngs):
        (tmp_path / f"{i}.png").write_bytes(raw)
        w, h = png_size(tmp_path / f"{i}.png")  # valid, decodable, not blank
        assert (w, h) == (640, 360)
    assert re.findall(r'alt="([^"]+)"', page) == EVERY_PLOT

    head = re.search(r"<tr><th>run</th>(.*?)</tr>", page).group(1)
    columns = re.findall(r"<th>(.*?)</th>", head)
    # run a: end values by hand from its files
    rows = read_metrics(a / "ppo" / "metrics.jsonl")
    score = statistics.mean(r["objective/score"] for r in rows[-5:])
    row_a = dict(zip(columns, cells(page, "beta-0.05")))
    assert row_a["iterations"][1] == "30"
    assert row_a["score (last 5)"][1] == f"{score:.3f}"
    assert row_a["final beta"][1] == f"{rows[-1]['objective/kl_coef']:.4f}"
    assert row_a["gold (last eval)"][1] == f"{rows[-1]['gold/score']:.3f}"
    before = [json.loads(x)["gold"] for x in (a / "samples_before.jsonl").read_text().splitlines()]
    assert (
        row_a["gold before"][1] == f"{statistics.mean(before):.3f} ± {statistics.stdev(before) / 3**0.5:.3f}"
    )
    # run b has the larger paired gain (highlighted); run c has no summary: its cells are blank
    row_b = dict(zip(columns, cells(page, "beta-0.2")))
    gains = [g - x for g, x in zip((0.9, 0.8, 0.95), before)]
    gain_text = f"{statistics.mean(gains):+.3f} ± {statistics.stdev(gains) / 3**0.5:.3f}"
    assert row_b["gold gain"] == ("num best", gain_text)
    assert row_a["gold gain"][0] == "num"
    row_c = dict(zip(columns, cells(page, "ppo-only")))
    assert row_c["gold before"][1] == "—" and row_c["iterations"][1] == "10"

    # the config keys that differ, per run; equal keys and out_dir are left out
    diff = re.search(r"<h2>Config differences</h2>\n<table>(.*?)</table>", page, flags=re.S).group(1)
    assert '<th>ppo:kl.init_coef</th><td class="text">0.05</td><td class="text">0.2</td>' in diff
    assert '<th>ppo:model.path</th><td class="text">—</td><td class="text">—</td>' in diff
    assert "kl.target" not in diff and "seed" not in diff and "out_dir" not in diff
    # what a run lacks is named, not silently dropped
    assert "entropy: no objective/entropy in ppo-only" in html.unescape(page)
    assert "response_len: no rollout/response_len in ppo-only" in html.unescape(page)


@pytest.mark.unit
def test_labels_and_config_differences():
    assert run_labels([Path("/x/a/s0"), Path("/x/b/s0"), Path("/x/b/s1")]) == ["a/s0", "b/s0", "s1"][:2] + [
        "b/s1"
    ]
    assert run_labels([Path("/r/one"), Path("/r/two")]) == ["one", "two"]
    a = {"ppo:a": "1", "ppo:b": "2", "sft:lr": "0.1"}
    b = {"ppo:a": "1", "ppo:b": "3", "ppo:c": "x"}  # a single ppo run: the sft stage is not compared
    assert config_differences([a, b]) == [("ppo:b", ["2", "3"]), ("ppo:c", ["—", "x"])]


@pytest.mark.unit
def test_cli_compare_and_its_errors(tmp_path: Path, capsys, monkeypatch):
    a, b, _ = make_runs(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", str(a), str(b), "--labels", "low beta, high beta"]) == 0
    assert "wrote compare.html (2 runs)" in capsys.readouterr().err
    page = (tmp_path / "compare.html").read_text(encoding="utf-8")
    assert "shifu run comparison: low beta, high beta" in page
    assert cli.main(["report", str(a), str(tmp_path / "nope"), "--out", "x.html"]) == 2
    assert f"run directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert cli.main(["report", str(a), str(b), "--labels", "only-one"]) == 2
    assert "--labels gives 1 names for 2 runs" in capsys.readouterr().err
    assert cli.main(["report", str(a), "--out", "x.html"]) == 2
    assert "--out and --labels are for comparisons of several runs" in capsys.readouterr().err


@pytest.mark.integration
def test_compare_page_loads_in_headless_chromium(tmp_path: Path):
    browser = _chromium()
    out = render_comparison(make_runs(tmp_path), tmp_path / "compare.html")
    page = out.read_text(encoding="utf-8")
    check = tmp_path / "compare_check.html"
    check.write_text(page.replace("<head>", "<head>" + CHECK_SCRIPT, 1), encoding="utf-8")
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        check.as_uri(),
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)}
    )
    assert r.returncode == 0, f"chromium exited {r.returncode}:\n{r.stderr[-2000:]}"
    found = re.search(r'<pre id="shifu-check">(.*?)</pre>', r.stdout, flags=re.S)
    assert found, f"the checking script did not run; chromium stderr:\n{r.stderr[-2000:]}"
    result = json.loads(html.unescape(found.group(1)))
    assert result["errors"] == []
    assert len(result["images"]) == len(EVERY_PLOT)
    for im in result["images"]:
        assert im["complete"] and (im["w"], im["h"]) == (640, 360), f"an image did not load: {im['src'][:60]}"
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line]
    assert console == [], "\n".join(console)

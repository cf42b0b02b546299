"""The run report: plots are valid PNGs, text is escaped, missing pieces are tolerated, the page loads in a
real browser (headless Chromium) with every image and no errors, and the metrics docs match the code."""

from __future__ import annotations

import html
import json
import math
import os
import random
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shifu.cli import main as cli
from shifu.reporting.report import GOLD_VS_KL, PLOTS, QUICKSTART_STAGES, render_report
from shifu.runs.metrics import METRICS, markdown_table, undefined_keys
from shifu.runs.tracking import Tracker, read_metrics

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# the plots of a quickstart run (sft, rm, ppo; a DPO run's plots are tested in test_report_runs.py)
EVERY_PLOT = [p.name for p in PLOTS if p.stage in QUICKSTART_STAGES] + [GOLD_VS_KL]
NASTY = 'a <b>bold</b> & "quoted" <script>alert(1)</script> line\nbreak'


def write_run(run: Path, *, iterations: int = 30, eval_every: int = 5) -> dict:
    """A realistic run directory, metrics written through the real Tracker."""
    rng = random.Random(0)
    sft = Tracker(run / "sft", tensorboard=False)
    for step in range(1, 41):
        row = {
            "sft/loss": 5.0 * math.exp(-step / 15) + 1.0 + 0.05 * rng.random(),
            "perf/tokens_per_s": 9000.0,
        }
        if step % 10 == 0:
            row["eval/sft/loss"] = row["sft/loss"] + 0.1
        sft.log(step, row)
    sft.close()
    rm = Tracker(run / "rm", tensorboard=False)
    for step in range(1, 31):
        row = {"rm/loss": 0.69 - 0.01 * step, "rm/accuracy": 0.5 + 0.015 * step, "rm/margin": 0.05 * step}
        if step % 5 == 0:
            row |= {"eval/rm/accuracy": 0.5 + 0.01 * step, "eval/rm/margin": 0.03 * step}
        rm.log(step, row)
    rm.close()
    ppo = Tracker(run / "ppo", tensorboard=False)
    beta = 0.05
    for it in range(1, iterations + 1):
        kl = 0.3 * it
        row = {
            "objective/score": -0.5 + 0.05 * it,
            "objective/kl": kl,
            "objective/kl_per_token": kl / 24,
            "objective/kl_coef": beta,
            "objective/rlhf_reward": -0.5 + 0.05 * it - beta * kl,
            "objective/entropy": 3.0 - 0.02 * it,
            "policy/approx_kl": 0.01,
            "policy/clipfrac": 0.1 + 0.01 * rng.random(),
            "policy/ratio_mean": 1.0,
            "value/explained_var": float("nan") if it == 1 else 0.1 * min(it, 9),  # Tracker writes "nan"
            "value/clipfrac": 0.05,
            "loss/policy": -0.01,
            "loss/value": 0.2,
            "rollout/response_len": 24.0 - 0.1 * it,
            "rollout/eos_frac": 0.9,
            "time/rollout_s": 1.5,
            "time/update_s": 2.5,
            "perf/tokens_per_s": 800.0,
        }
        if it == 7:
            row["policy/clipfrac"] = float("inf")  # a non-finite point must become a gap, not break the plot
        if it % eval_every == 0:
            row |= {
                "eval/score": -0.4 + 0.05 * it,
                "eval/kl": kl * 1.1,
                "gold/score": -0.1 + 0.6 * it / iterations,
            }
        beta *= 1.02
        ppo.log(it, row)
    ppo.close()
    summary = {
        "task": "imdb",
        "preset": "tiny",
        "seed": 0,
        "gold_before": -0.1,
        "gold_after": 0.5,
        "kl": 9.5,
        "rm_accuracy": 0.78,
        "seconds": {"sft": 120.5, "rm": 60.25, "ppo": 400.0},
        "n_prompts": 3,
        "judge": "vader <compound>",
    }
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    prompts = ["This movie was", NASTY, "I & my <friends>"]
    for name, golds in (("samples_before", [-0.2, 0.1, 0.0]), ("samples_after", [0.6, 0.4, 0.7])):
        kl = [{"kl": 4.25}, {"kl": 12.5}, {"kl": 0.75}] if name == "samples_after" else [{}] * 3
        lines = [
            json.dumps({"prompt": p, "response": f"{name} reply {i} <i>fine</i> & more", "gold": g} | kl[i])
            for i, (p, g) in enumerate(zip(prompts, golds))
        ]
        (run / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return summary


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature; then a full decode."""
    import matplotlib.image

    raw = path.read_bytes()
    assert raw[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert raw[12:16] == b"IHDR"
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    pixels = matplotlib.image.imread(path)  # decodes every chunk: a truncated file raises
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0, f"{path} is a blank image"
    return width, height


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.hrefs, self.scripts = [], [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if "src" in a:
            self.srcs.append(a["src"])
        if "href" in a:
            self.hrefs.append(a["href"])


@pytest.mark.unit
def test_render_full_run(tmp_path: Path):
    run = tmp_path / "run"
    write_run(run)
    assert read_metrics(run / "ppo" / "metrics.jsonl")[0]["value/explained_var"] == "nan"
    out = render_report(run)
    assert out == run / "report.html"
    for name in EVERY_PLOT:
        w, h = png_size(run / "report" / f"{name}.png")
        assert w > 100 and h > 100
    page = out.read_text(encoding="utf-8")

    # self-contained, JS-free, every image a relative path that exists
    links = Links()
    links.feed(page)
    assert links.scripts == 0
    assert sorted(links.srcs) == sorted(f"report/{n}.png" for n in EVERY_PLOT)
    assert all((run / s).is_file() for s in links.srcs)
    assert not links.hrefs and "http://" not in page and "https://" not in page

    # sample text is escaped, never interpreted
    assert "<b>bold</b>" not in page and "<script>alert" not in page and "<friends>" not in page
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; &quot;quoted&quot; &lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "I &amp; my &lt;friends&gt;" in page
    # summary figures: delta computed, stage times and total, extra keys kept
    assert "+0.600" in page and "-0.100" in page and "9.500" in page and "0.780" in page
    assert "120.5 s" in page and "580.8 s" in page
    assert '<th>n_prompts</th><td class="num">3</td>' in page
    assert '<th>judge</th><td class="">vader &lt;compound&gt;</td>' in page
    # per-sample gold deltas, in the before/after order of the files
    assert page.index("+0.800") < page.index("+0.300") < page.index("+0.700")
    assert "<th>KL after (nats)</th>" in page and page.index("4.25") < page.index("12.50") < page.index(
        "0.75"
    )
    # the inf clipfrac is reported as a gap, nothing is reported missing otherwise
    assert "1 non-finite value(s) of policy/clipfrac" in page
    assert "omitted" not in page


@pytest.mark.unit
def test_render_tolerates_missing_pieces(tmp_path: Path):
    run = tmp_path / "run"
    write_run(run)
    (run / "rm" / "metrics.jsonl").unlink()  # rule-based reward: no learned RM
    (run / "sft" / "metrics.jsonl").unlink()
    (run / "samples_after.jsonl").unlink()
    summary = json.loads((run / "summary.json").read_text())
    summary["rm_accuracy"] = None
    (run / "summary.json").write_text(json.dumps(summary))
    rows = read_metrics(run / "ppo" / "metrics.jsonl")
    for row in rows:  # a trainer that never logged entropy, and a run killed mid-line
        row.pop("objective/entropy")
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 31, "objective/sc'
    (run / "ppo" / "metrics.jsonl").write_text(text)

    page = render_report(run).read_text(encoding="utf-8")
    made = {p.stem for p in (run / "report").glob("*.png")}
    assert made == set(EVERY_PLOT) - {"entropy", "rm_accuracy", "sft_loss"}
    assert "entropy.png omitted: no finite values of objective/entropy in ppo/metrics.jsonl" in page
    assert "rm_accuracy.png omitted: this run has no learned reward model" in page
    assert "ppo/metrics.jsonl: skipped 1 line(s) that are not JSON objects (line 31)" in page
    assert "samples_after.jsonl is missing or empty" in page
    assert "no learned reward model" in page
    assert 'src="report/entropy.png"' not in page


@pytest.mark.unit
def test_rerender_drops_stale_plots(tmp_path: Path):
    run = tmp_path / "run"
    write_run(run)
    render_report(run)
    (run / "sft" / "metrics.jsonl").unlink()
    render_report(run)
    assert not (run / "report" / "sft_loss.png").exists()


@pytest.mark.unit
def test_single_trainer_run_dir(tmp_path: Path):
    """`shifu rm --out X` writes X/metrics.jsonl: the report puts its rows under the reward model."""
    run = tmp_path / "rm_only"
    t = Tracker(run, tensorboard=False)
    for step in range(1, 11):
        t.log(step, {"rm/loss": 0.7 - 0.02 * step, "rm/accuracy": 0.5 + 0.03 * step, "eval/rm/accuracy": 0.6})
    t.close()
    page = render_report(run).read_text(encoding="utf-8")
    assert png_size(run / "report" / "rm_accuracy.png")[0] > 0
    assert {p.name for p in (run / "report").iterdir()} == {"rm_accuracy.png"}
    # an rm run lacks nothing that belongs to other stages: no PPO or SFT plot, no sample table is missing
    assert "no summary.json" in page and "score.png" not in page and "sft_loss" not in page
    assert "Samples on held-out prompts" not in page and "samples_before" not in page


@pytest.mark.unit
def test_cli_errors_for_missing_or_empty_run_dir(tmp_path: Path, capsys):
    missing = tmp_path / "no_such_run"
    assert cli.main(["report", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "nothing to report" in err
    assert not (empty / "report.html").exists()
    blocked = tmp_path / "blocked"
    write_run(blocked)
    (blocked / "report").write_text("a file where the plot folder goes")
    assert cli.main(["report", str(blocked)]) == 2
    assert f"cannot write the report into {blocked}" in capsys.readouterr().err


@pytest.mark.unit
def test_cli_renders(tmp_path: Path, capsys):
    run = tmp_path / "run"
    write_run(run)
    assert cli.main(["report", str(run), "--max-samples", "2"]) == 0
    printed = capsys.readouterr()
    assert f"wrote {run / 'report.html'} ({len(EVERY_PLOT)} plots)" in printed.err and printed.out == ""
    page = (run / "report.html").read_text(encoding="utf-8")
    assert "First 2 of 3 held-out prompts." in page and "I &amp; my" not in page


# ---------------------------------------------------------------------------------- metrics table


@pytest.mark.unit
def test_metrics_docs_match_the_table():
    docs = (ROOT / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    assert docs == markdown_table(), (
        "docs/reference/metrics.md is stale: run `python -m shifu.runs.metrics docs/reference/metrics.md`"
    )
    documented = re.findall(r"^\| `([^`]+)` \|", docs, flags=re.M)
    assert documented == list(METRICS)


@pytest.mark.unit
def test_every_plotted_key_is_defined():
    for plot in PLOTS:
        for key in plot.keys:
            assert key in METRICS, f"report plots {key}, which shifu/runs/metrics.py does not define"
    for key in METRICS:
        assert re.fullmatch(r"[a-z]+(/[a-z][a-z0-9_]*)*(/[a-z][a-z0-9_]*|/\*)", key), key


@pytest.mark.unit
def test_undefined_keys_finds_what_the_table_lacks(tmp_path: Path):
    run = tmp_path / "run"
    write_run(run)
    rows = [r for stage in ("sft", "rm", "ppo") for r in read_metrics(run / stage / "metrics.jsonl")]
    assert undefined_keys(rows) == []
    rows.append({"step": 0, "sizes/total_optimizer_steps": 40, "objective/scroe": 1.0, "sizes": 3})
    assert undefined_keys(rows) == ["objective/scroe", "sizes"]


# ----------------------------------------------------------------------------------- real browser

CHECK_SCRIPT = """<script>
window.__errors = [];
window.addEventListener("error", function (e) {
  var t = e.target || {};
  window.__errors.push(t.src ? "failed to load " + t.src : String(e.message));
}, true);
console.error = function () { window.__errors.push(Array.prototype.join.call(arguments, " ")); };
window.addEventListener("load", function () {
  var imgs = Array.prototype.map.call(document.images, function (im) {
    return {src: im.getAttribute("src"), complete: im.complete, w: im.naturalWidth, h: im.naturalHeight};
  });
  var out = document.createElement("pre");
  out.id = "shifu-check";
  out.textContent = JSON.stringify({images: imgs, errors: window.__errors});
  document.body.appendChild(out);
});
</script>"""


def _chromium() -> str:
    """The Chromium binary; installs Debian's package when running as root with apt, else skips."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        pytest.skip(
            "headless Chromium is not installed and cannot be (needs root and apt-get): apt-get install chromium"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]  # other apt users on the machine: wait, don't fail
    for cmd in (
        ["apt-get", *lock, "update"],
        ["apt-get", *lock, "install", "-y", "--no-install-recommends", "chromium"],
    ):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            pytest.skip(
                f"could not install Chromium ({' '.join(cmd)} exited {r.returncode}): {r.stderr[-400:]}"
            )
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("apt-get installed chromium but no `chromium` binary is on PATH")
    return path


@pytest.mark.integration
def test_report_loads_in_headless_chromium(tmp_path: Path):
    browser = _chromium()
    run = tmp_path / "run"
    write_run(run)
    page = render_report(run).read_text(encoding="utf-8")
    # the report is JS-free; a copy next to it (same relative image paths) gets the checking script
    assert "<script" not in page
    check = run / "report_check.html"
    check.write_text(page.replace("<head>", "<head>" + CHECK_SCRIPT, 1), encoding="utf-8")
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
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
    srcs = sorted(im["src"] for im in result["images"])
    assert srcs == sorted(f"report/{n}.png" for n in EVERY_PLOT)
    for im in result["images"]:
        assert im["complete"] and im["w"] > 0 and im["h"] > 0, f"{im['src']} did not load: {im}"
    # console messages the page itself logged (Chromium prints them as CONSOLE lines at --v=0)
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line]
    assert console == [], "\n".join(console)
    # the escaped sample text reached the DOM as text, not markup
    assert "&lt;b&gt;bold&lt;/b&gt;" in r.stdout and "<b>bold</b>" not in r.stdout


@pytest.mark.unit
@pytest.mark.parametrize("reported", [True, False])
def test_tool_use_is_a_share_or_not_reported_never_a_false_zero(tmp_path: Path, reported: bool):
    """An environment run's summary: tool use before/after with its standard error when the environment
    reported ``tool_calls``; ``None`` (null in summary.json) when it did not, shown as "not reported" on the
    console and in the report, never as 0.000."""
    from shifu.reporting.summary import result_lines

    run = tmp_path / "run"
    write_run(run)
    summary = json.loads((run / "summary.json").read_text())
    summary |= {
        "gold_gain": 0.6,
        "gold_gain_se": 0.1,
        "eval_prompts": 3,
        "eval_temperature": 0.7,
        "seconds_total": 12.0,
        "policy": "ppo/final",
        "tool_use_before": 0.25 if reported else None,
        "tool_use_after": 0.75 if reported else None,
        "tool_use_before_se": 0.125 if reported else None,
        "tool_use_after_se": 0.1 if reported else None,
    }
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    lines = result_lines(json.loads((run / "summary.json").read_text()), "game", "tiny", 0, Path("runs/game"))
    tool = [x for x in lines if x.startswith("  tool use: ")]
    page = render_report(run).read_text(encoding="utf-8")
    if reported:
        assert tool == ["  tool use: before 0.250 -> after 0.750"]
        assert (
            '<th>tool use, final policy (share of episodes that called a tool)</th><td class="num">0.750 ± 0.100'
            in page
        )
    else:
        assert tool == ["  tool use: not reported (no Step.info of the environment had tool_calls)"]
        assert page.count("not reported (no Step.info of the environment had tool_calls)") == 2
        assert "<th>tool_use" not in page  # (no raw key shown as "—")

"""`shifu report` on the run directory of every stage, written by real tiny runs through the command line:
SFT (loss), RM (accuracy), DPO (loss, accuracy, margin) and PPO (curves and the samples of its first and
last evaluation). Also what `config.yaml` records when a run could not do what its config said."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import write_jsonl
from ppo_task import build_char_model, write_prompts
from test_dpo import preference_rows
from test_report import Links, png_size
from test_sft import corpus

from shifu.cli import main as cli
from shifu.reporting.report import PLOTS, render_report
from shifu.runs.tracking import read_metrics

pytestmark = pytest.mark.integration

COMMON = ["progress=false", "tensorboard=false", "--threads", "1"]


def shifu(*argv) -> list[str]:
    """Run ``shifu ARGV`` in this process; returns its stderr lines (the command must succeed)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    assert rc == 0, err.getvalue()
    return [line for line in err.getvalue().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """One tiny run of each stage (every log step written), and their closing lines."""
    d = tmp_path_factory.mktemp("runs")
    sft_data = [
        write_jsonl(d / f"sft_{n}.jsonl", corpus(k, seed=s)) for n, k, s in (("t", 48, 0), ("e", 8, 1))
    ]
    pairs = [
        write_jsonl(d / f"pairs_{n}.jsonl", preference_rows(k, s)) for n, k, s in (("t", 32, 0), ("e", 8, 1))
    ]
    model = f"model.path={tiny_model_dir}"
    last = {
        "sft": shifu(
            "sft",
            "--out",
            d / "sft",
            model,
            f"data.train={sft_data[0]}",
            f"data.eval={sft_data[1]}",
            "max_steps=4",
            "batch_size=8",
            "log_every=1",
            "eval.every=2",
            *COMMON,
        )[-1],
        "rm": shifu(
            "rm",
            "--out",
            d / "rm",
            model,
            f"data.train={pairs[0]}",
            f"data.eval={pairs[1]}",
            "max_steps=4",
            "batch_size=8",
            "log_every=1",
            *COMMON,
        )[-1],
        "dpo": shifu(
            "dpo",
            "--out",
            d / "dpo",
            model,
            f"data.train={pairs[0]}",
            f"data.eval={pairs[1]}",
            "max_steps=4",
            "batch_size=8",
            "log_every=1",
            "eval.every=2",
            "optim.lr=3e-3",
            *COMMON,
        )[-1],
    }
    # PPO: a character-level policy scored by the BPE reward model above (another tokenizer: it scores the
    # decoded text, and cannot be the critic, so critic.init=reward falls back to sft)
    char = build_char_model(d / "char")
    ppo_argv = [
        "ppo",
        "--out",
        d / "ppo",
        f"model.path={char}",
        f"data.train={write_prompts(d / 'p.jsonl')}",
        f"reward.model_path={d / 'rm' / 'final'}",
        "eval.gold_function=ppo_task:frac_a",
        "batch_size=8",
        "minibatch_size=8",
        "ppo_epochs=1",
        "generation.max_new_tokens=4",
        "eval.every=1",
        "eval.num_prompts=6",
        "eval.final_prompts=0",  # its evaluations' samples are the report's table (test_eval_command: the final one)
        "save_every=1",
        *COMMON,
    ]
    ppo_err = shifu(*ppo_argv, "iterations=2")
    last["ppo"] = ppo_err[-1]
    return {"dir": d, "last": last, "ppo_err": ppo_err, "ppo_argv": ppo_argv}


def render(run: Path) -> tuple[str, set[str]]:
    page = render_report(run).read_text(encoding="utf-8")
    links = Links()
    links.feed(page)
    assert all((run / s).is_file() for s in links.srcs) and links.scripts == 0
    return page, {Path(s).stem for s in links.srcs}


def notes(page: str) -> str:
    m = re.search(r'<div class="notes">(.*?)</div>', page, re.S)
    return m.group(1) if m else ""


def test_every_trainer_ends_with_where_its_outputs_are(runs):
    for kind in ("sft", "rm", "dpo", "ppo"):
        line, final = runs["last"][kind], runs["dir"] / kind / "final"
        assert line.startswith(f"shifu {kind}: ") and line.endswith(f" in {final}"), line
        assert (final / "config.json").is_file()


def test_sft_run(runs):
    run = runs["dir"] / "sft"
    page, plots = render(run)
    assert plots == {"sft_loss"} and png_size(run / "report" / "sft_loss.png")[0] > 100
    assert "shifu run report: shifu sft run sft" in page
    # nothing of the other stages is reported missing, and an SFT run has no samples to miss
    assert notes(page) == "" and "Samples on held-out prompts" not in page
    logged = [r["eval/sft/loss"] for r in read_metrics(run / "metrics.jsonl") if "eval/sft/loss" in r]
    assert len(logged) == 3  # steps 0, 2, 4: the held-out curve has points to draw
    summary = json.loads((run / "summary.json").read_text())
    assert f"{summary['eval/sft/loss']:.4g}" in page  # the summary table shows the run's own figures


def test_rm_run(runs):
    run = runs["dir"] / "rm"
    page, plots = render(run)
    assert plots == {"rm_accuracy"} and png_size(run / "report" / "rm_accuracy.png")[0] > 100
    assert notes(page) == "" and "Samples on held-out prompts" not in page
    acc = json.loads((run / "summary.json").read_text())["eval/rm/accuracy"]
    assert f'<th>eval/rm/accuracy</th><td class="num">{acc:.4g}</td>' in page


def test_dpo_run_draws_loss_accuracy_and_margin(runs):
    run = runs["dir"] / "dpo"
    page, plots = render(run)
    dpo_plots = {p.name for p in PLOTS if p.stage == "dpo"}
    assert plots == dpo_plots == {"dpo_loss", "dpo_accuracy", "dpo_margin"}
    for name in dpo_plots:
        assert png_size(run / "report" / f"{name}.png")[0] > 100
    assert "eval/dpo/margin over DPO steps" in page
    assert notes(page) == "" and "Samples on held-out prompts" not in page
    rows = read_metrics(run / "metrics.jsonl")
    assert sum("dpo/loss" in r for r in rows) == 4 and sum("eval/dpo/accuracy" in r for r in rows) == 3


def test_ppo_run_shows_its_samples(runs):
    run = runs["dir"] / "ppo"
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["iteration"] == 0]
    last = [s for s in samples if s["iteration"] == 2]
    assert first and len(first) == len(last)
    page, plots = render(run)
    assert {"score", "kl", "gold", "gold_vs_kl"} <= plots
    assert not plots & {"sft_loss", "rm_accuracy", "dpo_loss"}  # no other stage's plot
    table = page[page.index("Samples on held-out prompts") :]
    assert "iteration 0 (initial policy)" in table and "iteration 2 (last evaluation)" in table
    # each prompt's row: its response at iteration 0, its gold, its response at iteration 2, its gold
    cells = re.findall(r"<td[^>]*>(.*?)</td>", table, re.S)
    for i, (a, b) in enumerate(zip(first, last)):
        assert a["prompt"] == b["prompt"]
        row = cells[i * 7 : i * 7 + 7]
        assert row[1:6] == [a["prompt"], a["response"], f"{a['gold']:.3f}", b["response"], f"{b['gold']:.3f}"]
    assert "Not shown" not in page  # nothing missing: curves, gold and both evaluations are there
    # what ran, in words, and where the run lies never as an absolute path
    method = "PPO (GAE on a learned critic, critic.init=sft; KL to the reference in the reward, k1)"
    assert f'<th>method (shifu ppo)</th><td class="">{method}</td>' in page
    reward = f"the reward model {runs['dir'].name}/rm/final"  # another run's model: by its run's name
    assert f'<th>reward</th><td class="">{reward}</td>' in page
    assert str(runs["dir"]) not in page and not re.search(r'[\s>"(]/(tmp|home|root)/', page)


def test_ppo_run_with_one_evaluation(runs, tmp_path):
    """eval.every=0 evaluates once, at the end: that evaluation is the table, and a note says why alone."""
    run = tmp_path / "ppo_once"
    run.mkdir()
    rows = [json.loads(x) for x in (runs["dir"] / "ppo" / "samples.jsonl").read_text().splitlines()]
    write_jsonl(run / "samples.jsonl", [r for r in rows if r["iteration"] == 2])
    (run / "metrics.jsonl").write_text((runs["dir"] / "ppo" / "metrics.jsonl").read_text())
    page, _ = render(run)
    assert "samples.jsonl holds one evaluation (iteration 2)" in page
    assert "iteration 2 (last evaluation)" in page and "initial policy" not in page


def test_ppo_config_records_the_critic_fallback_and_resumes(runs):
    run = runs["dir"] / "ppo"
    assert any("critic.init=reward fell back to critic.init=sft" in x for x in runs["ppo_err"])
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["critic"]["init"] == "sft"  # what ran, not the default `reward` the command line left
    assert (run / "critic" / "config.json").is_file()
    # the same command line resumes: the checkpoint's config holds the value that ran, as this run does
    err = shifu(*runs["ppo_argv"], "iterations=3", "--resume")
    assert any("resumed from" in x for x in err) and err[-1].startswith("shifu ppo: 3 iterations")
    assert yaml.safe_load((run / "config.yaml").read_text())["critic"]["init"] == "sft"


def test_ppo_shared_critic_records_its_joint_optimizer(tmp_path):
    char = build_char_model(tmp_path / "char")
    prompts = write_prompts(tmp_path / "p.jsonl", n=16)
    shifu(
        "ppo",
        "--out",
        tmp_path / "run",
        f"model.path={char}",
        f"data.train={prompts}",
        "reward.function=ppo_task:frac_a",
        "critic.init=shared",
        "iterations=1",
        "batch_size=4",
        "minibatch_size=4",
        "ppo_epochs=1",
        "generation.max_new_tokens=3",
        "eval.every=0",
        "eval.num_prompts=4",
        "save_every=0",
        *COMMON,
    )
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["critic"]["init"] == "shared" and config["joint_optimizer"] is True

"""What a newcomer reads: shifu's own lines on stderr (stdout only for a command's data), progress through the
final evaluation, whose size is a plan setting, third-party warnings and bars only with --verbose, every
"after" gold figure saying how it was measured, and a report whose summary is labelled, whose reward plot is
titled by the run's reward and whose gold-against-KL points are not joined in iteration order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import write_jsonl

from shifu.cli import main as cli
from shifu.reporting.plots import gold_vs_kl_figure
from shifu.reporting.report import render_report
from shifu.reporting.run_data import load_run
from shifu.runs.tracking import Tracker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def shifu(*argv: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m shifu ARGV`` in a fresh process, with neither the user's verbosity settings nor ours."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRANSFORMERS_", "HF_", "SHIFU_VERBOSE", "TQDM_"))
    }
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, filter(None, [ROOT, pythonpath])))}
    return subprocess.run(
        [sys.executable, "-m", "shifu", *argv], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )


def test_quickstart_prints_nothing_of_its_own_to_stdout(tmp_path):
    """A real (short) arith quickstart with a LoRA actor and critic: stdout stays empty; the LoRA lines, the
    progress of the final evaluation and the labelled results are on stderr; eval.num_prompts sets how many
    held-out prompts the final evaluation takes."""
    out = tmp_path / "run"
    sets = [
        "sft.max_steps=20",
        "ppo.iterations=1",
        "ppo.batch_size=32",
        "ppo.minibatch_size=32",
        "ppo.ppo_epochs=1",
        "ppo.eval.num_prompts=8",
        "ppo.lora.enabled=true",
        "ppo.lora.critic=true",
        "eval.num_prompts=24",
    ]
    r = shifu(
        "quickstart", "--task", "arith", "--out", str(out), "--threads", "1", *(f"--set={s}" for s in sets)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == "", r.stdout
    err = r.stderr
    assert "shifu ppo: LoRA actor," in err and "shifu ppo: LoRA critic," in err
    assert re.search(r"final evaluation: 100%.*\b96/96\b", err), err[-2000:]  # 24 prompts, 4 passes
    # three "after" figures of one policy, each saying how it was measured
    assert "held-out gold" in err and "(last evaluation: 8 prompts sampled at T=0.7)" in err
    lines = err.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("arith/tiny seed 0: gold judge"))
    assert "on 24 held-out prompts" in lines[i]
    assert lines[i + 1].startswith("  sampled at T=1: before ") and "paired standard error" in lines[i + 1]
    assert lines[i + 2].startswith("  greedy: ") and lines[i + 2].index("before") == lines[i + 1].index(
        "before"
    )
    assert lines[-1].endswith(f"outputs in {out} (summary.json, report.html; policy in ppo/final)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_prompts"] == 24
    assert len((out / "samples_after.jsonl").read_text().splitlines()) == 24


def test_eval_num_prompts_is_honoured_and_checked(tiny_model_dir, tmp_path, capsys):
    from shifu.evaluation.final import evaluate
    from shifu.pipelines.quickstart import _plan

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    ev = {"temperature": 1.0, "max_new_tokens": 3, "num_prompts": 7}
    s = evaluate("arith", tiny_model_dir, tiny_model_dir, str(tmp_path / "prompts.jsonl"), ev, 0, tmp_path)
    assert s["eval_prompts"] == 7
    after = [json.loads(x) for x in (tmp_path / "samples_after.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in after] == [r["prompt"] for r in rows[:7]]  # the first N, in file order
    # unset: every held-out prompt, as before the setting existed
    assert (
        evaluate(
            "arith",
            tiny_model_dir,
            tiny_model_dir,
            str(tmp_path / "prompts.jsonl"),
            {"temperature": 1.0, "max_new_tokens": 3},
            0,
            tmp_path,
        )["eval_prompts"]
        == 30
    )
    assert _plan("arith", "tiny", ["eval.num_prompts=64"])["eval"]["num_prompts"] == 64
    assert (
        cli.main(
            ["quickstart", "--task", "arith", "--out", str(tmp_path / "x"), "--set", "eval.num_prompts=0"]
        )
        == 2
    )
    assert "eval.num_prompts must be >= 1" in capsys.readouterr().err and not (tmp_path / "x").exists()


LEGACY_REWARD = """
import transformers
from tqdm.auto import tqdm



def score(prompts, responses, rows):
    # a deprecated argument: transformers raises a FutureWarning that names the caller (stacklevel=2)
    transformers.GenerationConfig(continuous_batching_config={"max_batch_tokens": 8})
    # a plain tqdm bar, as the GGUF converter draws one ("Converting and de-quantizing GGUF tensors...")
    return [float(len(y)) for y in tqdm(responses, desc="Converting and de-quantizing")]
"""


def test_library_warnings_and_bars_only_with_verbose(tiny_model_dir, tmp_path):
    (tmp_path / "legacy_reward.py").write_text(LEGACY_REWARD, encoding="utf-8")
    argv = [
        "sample",
        str(tiny_model_dir),
        "--prompt",
        "the movie",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--reward-function",
        "legacy_reward:score",
    ]
    quiet = shifu(*argv, pythonpath=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert "the movie" in quiet.stdout  # the command's output (data) stays on stdout
    assert "FutureWarning" not in quiet.stderr and "de-quantizing" not in quiet.stderr, quiet.stderr
    loud = shifu(*argv, "--verbose", pythonpath=tmp_path)
    assert loud.returncode == 0, loud.stderr
    assert "FutureWarning" in loud.stderr and "continuous_batching_config" in loud.stderr
    assert "de-quantizing" in loud.stderr and loud.stdout == quiet.stdout


def quickstart_run(run: Path, reward: dict) -> None:
    """A quickstart-shaped run directory: PPO metrics with evaluations whose KL rises and falls, the PPO
    config with ``reward``, and the summary that the quickstart writes."""
    ppo = Tracker(run / "ppo", tensorboard=False)
    kls = {0: 0.0, 5: 2.0, 10: 1.0, 15: 3.0, 20: 1.5}  # KL falls between evaluations: a zig-zag in order
    for it in range(21):
        row = {"objective/score": 0.1 * it, "objective/kl": 0.1 * it, "objective/kl_coef": 0.05} if it else {}
        if it in kls:
            row |= {
                "eval/score": 0.1 * it,
                "eval/kl": kls[it],
                "eval/kl_k3": kls[it],
                "gold/score": 0.02 * it,
            }
        ppo.log(it, row)
    ppo.close()
    config = {
        "reward": {"model_path": None, "function": None, "url": None} | reward,
        "eval": {"num_prompts": 64, "temperature": 0.7},
    }
    (run / "ppo" / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    summary = {
        "gold_before": 0.19,
        "gold_after": 0.41,
        "gold_gain": 0.22,
        "gold_before_se": 0.017,
        "gold_after_se": 0.022,
        "gold_gain_se": 0.024,
        "kl": 1.6,
        "kl_k1": 1.1,
        "eval_prompts": 512,
        "eval_temperature": 1.0,
        "gold_judge": "shifu.tasks.judges:exact_match",
        "gold_greedy_before": 0.297,
        "gold_greedy_after": 0.541,
        "task": "arith",
        "preset": "tiny",
        "seed": 0,
        "rm_accuracy": None,
        "seconds": {"prepare": 3.9, "sft": 40.5, "ppo": 76.0, "eval": 2.6},
        "cpu_seconds": {"prepare": 2.61, "sft": 18.92, "ppo": 26.0, "eval": 0.87},
        "policy": "ppo/final",
        "seconds_total": 122.94,
        "cpu_seconds_total": 48.4,
    }
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")


def test_report_summary_is_labelled_with_a_cpu_table(tmp_path):
    run = tmp_path / "run"
    quickstart_run(run, {"function": "shifu.tasks.judges:exact_match"})
    page = render_report(run).read_text(encoding="utf-8")
    summary = page[page.index("<h2>Summary</h2>") : page.index("<h2>Training curves</h2>")]
    assert "{" not in summary and "&quot;" not in summary  # no JSON blob
    for raw in ("cpu_seconds", "gold_before_se", "kl_k1", "eval_temperature", "gold_greedy_after"):
        assert f"<th>{raw}</th>" not in summary, raw
    # each "after" figure says how it was measured
    assert "Final evaluation on 512 held-out prompts" in summary
    assert (
        '<th>gold, final policy (after PPO), sampled at T=1</th><td class="num">0.410 ± 0.022</td>' in summary
    )
    assert '<th>gold, final policy (after PPO), greedy</th><td class="num">0.541</td>' in summary
    assert "gold, last PPO evaluation (iteration 20: up to 64 prompts sampled at T=0.7)" in summary
    # wall-clock and CPU seconds per stage, and their totals
    times = summary[summary.index("Time per stage") :]
    assert '<tr><th>sft</th><td class="num">40.5 s</td><td class="num">18.9 s</td></tr>' in times
    assert '<tr><th>total</th><td class="num">123.0 s</td><td class="num">48.4 s</td></tr>' in times


@pytest.mark.parametrize(
    ("reward", "title"),
    [
        ({"function": "shifu.tasks.judges:exact_match"}, "Reward: function exact_match"),
        ({"model_path": "RUN/rm/final"}, "Reward-model score"),
        ({"model_path": "ENSEMBLE"}, "Reward-model ensemble score"),
        ({"url": "http://127.0.0.1:8000"}, "Reward-service score"),
    ],
)
def test_reward_plot_is_titled_by_the_runs_reward(tmp_path, reward, title):
    run = tmp_path / "run"
    if reward.get("model_path") == "ENSEMBLE":
        (tmp_path / "ens").mkdir()
        (tmp_path / "ens" / "ensemble.json").write_text("{}")  # shifu.rewards.ensemble.ENSEMBLE_FILE
        reward = {"model_path": str(tmp_path / "ens")}
    quickstart_run(run, reward)
    page = render_report(run).read_text(encoding="utf-8")
    caption = re.search(r'alt="score"[^>]*><figcaption>(.*?)</figcaption>', page).group(1)
    assert caption.startswith(f"{title}: objective/score"), caption
    if title != "Reward-model score":
        assert "Reward-model score" not in page


def test_gold_against_kl_points_are_not_joined_in_iteration_order(tmp_path):
    run = tmp_path / "run"
    quickstart_run(run, {"function": "shifu.tasks.judges:exact_match"})
    data = load_run(run)
    fig, ax = gold_vs_kl_figure(data.stages["ppo"], data)
    for line in ax.get_lines():
        xs = list(line.get_xdata())
        if len(xs) > 1:  # several points in one artist: either unjoined, or joined in order of KL
            assert line.get_linestyle() in ("None", "none", "") or xs == sorted(xs), (line.get_label(), xs)
    evaluations = next(x for x in ax.get_lines() if x.get_label().startswith("PPO evaluations"))
    assert list(evaluations.get_xdata()) == [0.0, 2.0, 1.0, 3.0, 1.5]  # the zig-zag data, drawn as points
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"it {i}" for i in (0, 5, 10, 15, 20))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "PPO evaluations (up to 64 prompts sampled at T=0.7)" in legend
    assert "final policy, final evaluation: 512 prompts sampled at T=1" in legend

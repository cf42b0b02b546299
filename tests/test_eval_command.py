"""Measuring your own task: ``shifu ppo`` with a gold judge ends with the paired held-out evaluation of its start
and its final policy (summary.json, samples_before/after.jsonl, model card, closing line), and ``shifu eval``
gives the same kind of figures for any one or two policies, judged by a reward function, a reward model or an
environment. Every printed and recorded gain is recomputed here from the per-prompt values the run recorded;
progress bars show on stderr only with ``progress=true``."""

from __future__ import annotations

import json
import math
import re

import pytest
from ppo_task import build_char_model, write_prompts

from shifu.cli import main as cli
from shifu.config.loader import load_config
from shifu.core.stats import mean_se
from shifu.trainers import ppo

pytestmark = pytest.mark.integration

HELD_OUT = 20  # rows of the held-out file; eval.final_prompts=16 takes the first 16


def rows_of(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def ppo_args(task, out, *extra):
    return [
        f"out_dir={out}",
        f"model.path={task['model']}",
        f"data.train={task['prompts']}",
        f"data.eval={task['eval']}",
        "reward.function=ppo_task:frac_a",
        "eval.gold_function=ppo_task:frac_a",
        "critic.init=sft",
        "iterations=10",
        "batch_size=16",
        "minibatch_size=8",
        "generation.max_new_tokens=6",
        "optim.lr=1e-2",
        "optim.schedule=constant",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.02",
        "eval.every=5",
        "eval.num_prompts=8",
        "eval.final_prompts=16",
        "save_every=0",
        "tensorboard=false",
        "target_approx_kl=0.02",
        *extra,
    ]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A random character policy, its PPO run on frac_a (a gold judge), and the run's stderr."""
    d = tmp_path_factory.mktemp("eval_cmd")
    task = {
        "model": build_char_model(d / "model"),
        "prompts": write_prompts(d / "prompts.jsonl"),
        "eval": d / "eval.jsonl",
        "dir": d,
    }
    held_out = [
        {"prompt": "".join("abcdefghijkl"[(i * 5 + j) % 12] for j in range(3 + i % 2))} for i in range(20)
    ]
    task["eval"].write_text("".join(json.dumps(r) + "\n" for r in held_out), encoding="utf-8")
    task["held_out"] = held_out
    return task


@pytest.fixture(scope="module")
def run(task):
    out = task["dir"] / "run"
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        summary = ppo.train(load_config(ppo.Config, None, ppo_args(task, out, "progress=true")))
    return {"out": out, "summary": summary, "stderr": err.getvalue()}


def test_ppo_with_a_judge_ends_with_the_paired_final_evaluation(task, run):
    """summary.json holds the quickstart's keys; the gain and its standard error are those of the per-prompt
    differences in samples_before/after.jsonl (the first eval.final_prompts held-out prompts, in order, the
    same prompts on both sides); the policy learned (frac_a rose); the card and the closing line say it."""
    out, s = run["out"], json.loads((run["out"] / "summary.json").read_text())
    assert s == json.loads(json.dumps(run["summary"]))
    before, after = rows_of(out / "samples_before.jsonl"), rows_of(out / "samples_after.jsonl")
    prompts = [r["prompt"] for r in task["held_out"][:16]]
    assert [r["prompt"] for r in before] == prompts == [r["prompt"] for r in after]
    assert s["eval_prompts"] == 16 and s["eval_temperature"] == 0.7 and s["gold_judge"] == "ppo_task:frac_a"
    gain, gain_se = mean_se([a["gold"] - b["gold"] for b, a in zip(before, after)])
    assert s["gold_gain"] == pytest.approx(gain, abs=1e-12) and s["gold_gain_se"] == pytest.approx(gain_se)
    assert (s["gold_before"], s["gold_before_se"]) == pytest.approx(mean_se([r["gold"] for r in before]))
    assert s["kl"] == pytest.approx(sum(r["kl"] for r in after) / 16) and s["kl"] > 0
    assert s["gold_before"] < 0.15 < 0.3 < s["gold_after"], s  # random policy ~1/12 'a'; trained: far more
    assert s["gold_gain"] > 3 * s["gold_gain_se"]
    card = (out / "final" / "README.md").read_text()
    row = re.search(
        r"final evaluation: model\.path -> final policy.*\(n = 16, T = 0\.7\): gain .*\| (.*) \|", card
    )
    assert row and row.group(1) == f"{s['gold_gain']:+.4f} ± {s['gold_gain_se']:.4f}", card
    last = run["stderr"].strip().splitlines()[-1]
    assert (
        f"gain {s['gold_gain']:+.3f} ± {s['gold_gain_se']:.3f} (paired, 16 prompts sampled at T=0.7" in last
    )
    # progress bars on stderr over every evaluation, the one before the first rollout included
    err = run["stderr"]
    assert "evaluation (iteration 0)" in err and "evaluation (iteration 10)" in err
    assert re.search(r"final evaluation: 100%.*32/32", err), err[-2000:]


def test_the_report_of_a_ppo_run_shows_its_final_evaluation(run):
    """shifu report of the run: the summary table's final evaluation with its standard errors, and the sample
    table of the same prompts, the run's start beside its final policy."""
    from shifu.reporting.report import render_report

    s = run["summary"]
    page = render_report(run["out"]).read_text()
    assert "Final evaluation on 16 held-out prompts, gold judge ppo_task:frac_a" in page
    assert f"{s['gold_gain']:+.3f} ± {s['gold_gain_se']:.3f}" in page
    table = page[page.index("Samples on held-out prompts") :]
    assert "before PPO (SFT policy), sampled at T=0.7" in table
    first = rows_of(run["out"] / "samples_before.jsonl")[0]
    assert f'<td class="text">{first["prompt"]}</td>' in table


def test_progress_false_keeps_stderr_quiet_and_final_prompts_0_turns_it_off(task, tmp_path, capsys):
    out = tmp_path / "quiet"
    args = ppo_args(task, out, "progress=false", "eval.final_prompts=0", "iterations=2")
    assert cli.main(["ppo", *args]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        next(x for x in err.splitlines() if x.startswith("shifu ppo: 2 iterations"))
    ], err
    assert "(last evaluation: 8 prompts sampled at T=0.7)" in err
    s = json.loads((out / "summary.json").read_text())
    assert "gold_before" not in s and not (out / "samples_before.jsonl").exists()
    assert load_config(ppo.Config, None, ppo_args(task, out)).eval.final_prompts == 16
    with pytest.raises(Exception, match="eval.final_prompts must be >= 0"):
        load_config(ppo.Config, None, ppo_args(task, out, "eval.final_prompts=-1"))


def _eval(capsys, *argv):
    code = cli.main(["eval", *map(str, argv)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    return captured.out


def _check_record(rec, printed):
    """Every figure of the record recomputed from its per-prompt rows, and the printed lines saying them."""
    labels = list(rec["policies"])
    for label in labels:
        p = rec["policies"][label]
        mean, se = mean_se([r[label]["score"] for r in rec["rows"]])
        assert (p["mean"], p["se"]) == pytest.approx((mean, se), abs=1e-12)
        assert f"{p['mean']:.4f} ± {p['se']:.4f}" in printed
    if len(labels) == 2:
        gain, gain_se = mean_se([r["B"]["score"] - r["A"]["score"] for r in rec["rows"]])
        paired = rec["paired"]
        assert (paired["gain"], paired["gain_se"]) == pytest.approx((gain, gain_se), abs=1e-12)
        assert f"{gain:+.4f} ± {gain_se:.4f} (paired over {len(rec['rows'])} prompts" in printed
        assert paired["kl"] == pytest.approx(sum(r["B"]["kl"] for r in rec["rows"]) / len(rec["rows"]))
    return rec


def test_eval_two_policies_with_a_reward_function_agrees_with_its_record(task, run, tmp_path, capsys):
    """The SFT policy against the PPO run (a run directory: its final/), on a prompt file: B gains, the gain's
    standard error is the paired one, the record holds the command and the settings."""
    out = tmp_path / "rec.json"
    argv = [task["model"], run["out"], "--prompts", task["eval"], "--reward-function", "ppo_task:frac_a"]
    printed = _eval(capsys, *argv, "--max-new-tokens", 6, "--seed", 3, "--out", out)
    rec = _check_record(json.loads(out.read_text()), printed)
    assert rec["prompts"] == {"from": str(task["eval"]), "count": HELD_OUT}
    assert rec["policies"]["B"]["directory"] == str(run["out"] / "final")
    assert rec["settings"]["seed"] == 3 and rec["settings"]["max_new_tokens"] == 6
    assert rec["command"].startswith("shifu eval ") and "--reward-function ppo_task:frac_a" in rec["command"]
    assert rec["paired"]["gain"] > 3 * rec["paired"]["gain_se"] > 0
    # frac_a by hand on the recorded responses
    assert all(
        r["A"]["score"] == r["A"]["response"].count("a") / max(1, len(r["A"]["response"]))
        for r in rec["rows"]
    )
    # an existing record is never replaced silently
    assert cli.main(["eval", *map(str, argv), "--out", str(out)]) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err
    _eval(capsys, *argv, "--out", out, "--overwrite", "--num-prompts", 5, "--no-progress")
    assert json.loads(out.read_text())["prompts"]["count"] == 5


def test_eval_one_policy_against_itself_gains_exactly_zero(task, tmp_path, capsys):
    out = tmp_path / "same.json"
    argv = [task["model"], task["model"], "--prompts", task["eval"], "--reward-function", "ppo_task:frac_a"]
    printed = _eval(capsys, *argv, "--out", out, "--no-progress")
    rec = _check_record(json.loads(out.read_text()), printed)
    assert rec["paired"]["gain"] == 0.0 and rec["paired"]["gain_se"] == 0.0 and rec["paired"]["kl"] == 0.0
    assert rec["policies"]["A"]["se"] > 0
    one = tmp_path / "one.json"
    printed = _eval(
        capsys, task["model"], "--prompts", task["eval"], "--reward-function", "ppo_task:frac_a", "--out", one
    )
    single = _check_record(json.loads(one.read_text()), printed)
    assert "paired" not in single and single["policies"]["A"]["mean"] == rec["policies"]["A"]["mean"]


def test_eval_with_a_reward_model_agrees_with_its_record(task, run, tmp_path, capsys):
    """A reward model (a shifu rm run directory) scores each response as PPO would; the record's figures are
    its own rows' (this untrained model's scores still differ from prompt to prompt)."""
    from shifu.models.scalar import ScalarModel

    rm = tmp_path / "rm_run"
    ScalarModel.from_backbone(task["model"], seed=0).save_pretrained(rm / "final")
    out = tmp_path / "rm.json"
    argv = [task["model"], run["out"], "--prompts", task["eval"], "--reward-model", rm]
    printed = _eval(capsys, *argv, "--max-new-tokens", 6, "--out", out, "--no-progress")
    rec = _check_record(json.loads(out.read_text()), printed)
    assert rec["judge"] == f"reward model {rm}" and rec["policies"]["A"]["se"] > 0


def test_eval_with_an_environment_agrees_with_its_record(task, run, tmp_path, capsys):
    """Episodes through a third party's environment (two turns, tool calls reported): the return is the
    score, tool use is counted, and the figures are the record's."""
    out = tmp_path / "env.json"
    argv = [task["model"], run["out"], "--prompts", task["eval"], "--env", "thirdparty_env:Echo"]
    episodes = [
        "--env-kwargs",
        '{"turns": 2}',
        "--stop",
        "l",
        "--max-new-tokens",
        6,
        "--max-total-tokens",
        30,
    ]
    printed = _eval(capsys, *argv, *episodes, "--out", out)
    rec = _check_record(json.loads(out.read_text()), printed)
    assert rec["judge"] == "episode return of thirdparty_env:Echo"
    for p in rec["policies"].values():
        assert 1 <= p["turns"] <= 2 and 0 <= p["tool_use"] <= 1 and "tool use" in printed
    assert rec["paired"]["gain"] > 0
    assert cli.main(["eval", *map(str, argv), "--env-kwargs", "[2]", "--out", str(tmp_path / "x.json")]) == 2
    assert "--env-kwargs must be a JSON object" in capsys.readouterr().err


def test_eval_reads_a_run_directory_for_everything_it_used(task, run, tmp_path, capsys):
    """--run alone: the run's start (model.path) against its final policy, on its held-out prompts (the first
    eval.final_prompts), judged by its gold judge at eval.temperature; flags override."""
    out = tmp_path / "run.json"
    printed = _eval(capsys, "--run", run["out"], "--out", out)
    rec = _check_record(json.loads(out.read_text()), printed)
    assert rec["judge"] == "gold judge ppo_task:frac_a"
    assert rec["policies"]["A"]["directory"] == str(task["model"])
    assert rec["policies"]["B"]["directory"] == str(run["out"] / "final")
    assert [r["prompt"] for r in rec["rows"]] == [r["prompt"] for r in task["held_out"][:16]]
    st = rec["settings"]
    assert (st["temperature"], st["max_new_tokens"], st["batch_size"]) == (0.7, 6, 32)  # micro_batch_size
    assert rec["paired"]["gain"] > 0
    printed = _eval(
        capsys, "--run", run["out"], "--out", out, "--overwrite", "--temperature", 0, "--num-prompts", 4
    )
    rec = json.loads(out.read_text())
    assert "greedy" in printed and rec["settings"]["temperature"] == 0 and rec["prompts"]["count"] == 4


def test_eval_refuses_what_it_cannot_measure(task, tmp_path, capsys):
    assert cli.main(["eval", str(task["model"]), "--prompts", str(task["eval"])]) == 2
    assert "shifu eval needs a judge: --reward-function" in capsys.readouterr().err
    assert cli.main(["eval", "--reward-function", "ppo_task:frac_a", "--prompts", str(task["eval"])]) == 2
    assert "takes one policy (A) or two" in capsys.readouterr().err
    assert cli.main(["eval", str(task["model"]), "--run", str(tmp_path)]) == 2
    assert "no config.yaml in it" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_sample_with_a_reward_function_ends_with_the_mean_and_its_standard_error(task, run, capsys):
    argv = ["sample", str(run["out"]), "--prompts", str(task["eval"]), "--reward-function", "ppo_task:frac_a"]
    assert cli.main([*argv, "-n", "2", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    scores = [float(x) for x in re.findall(r"score (-?[0-9.]+)\)", printed)]
    assert len(scores) == 2 * HELD_OUT
    # each prompt's two responses count once, by their mean (printed scores are rounded to 4 digits)
    mean, se = mean_se([(scores[i] + scores[i + 1]) / 2 for i in range(0, len(scores), 2)])
    last = printed.strip().splitlines()[-1]
    m = re.fullmatch(
        r"### mean score (\S+) ± (\S+) \(standard error\) over 20 prompts, each the mean of its 2 .*", last
    )
    assert m, last
    assert float(m.group(1)) == pytest.approx(mean, abs=2e-4) and float(m.group(2)) == pytest.approx(
        se, abs=2e-4
    )
    assert math.isfinite(float(m.group(2)))


def test_pipelines_turn_the_trainers_final_evaluation_off(tmp_path):
    """The quickstart and the study measure their policies on their own held-out prompts: a ppo stage runs
    without the trainer's final evaluation (eval.final_prompts=0, unless its plan sets it), and its recorded
    plan (what it trains) does not change."""
    from shifu.config.schema import PPOConfig, SFTConfig
    from shifu.pipelines.stages import ppo_overrides, stage_overrides

    files = {"prompts_train": "t.jsonl", "prompts_val": "v.jsonl"}
    plan = ppo_overrides({"eval": {"every": 2}}, tmp_path / "sft", files, {"function": "m:f"}, 0)
    assert plan["eval"] == {"every": 2}
    over = stage_overrides(PPOConfig, plan, tmp_path / "ppo")
    assert over["eval"] == {"final_prompts": 0, "every": 2} and over["out_dir"] == str(tmp_path / "ppo")
    assert load_config(PPOConfig, None, over).eval.final_prompts == 0
    mine = stage_overrides(PPOConfig, {**plan, "eval": {"final_prompts": 32}}, tmp_path / "ppo")
    assert mine["eval"]["final_prompts"] == 32
    assert "eval" not in stage_overrides(SFTConfig, {"seed": 0}, tmp_path / "sft")

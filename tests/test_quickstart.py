"""`shifu quickstart` end to end: arith (PPO must beat SFT on held-out prompts) and a short imdb smoke run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shifu.cli.main import main as cli_main

torch.set_num_threads(1)


def _read(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.integration
@pytest.mark.slow
def test_arith_quickstart_ppo_beats_sft(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        cli_main(["quickstart", "--task", "arith", "--preset", "tiny", "--out", str(out), "--seed", "0"]) == 0
    )
    s = json.loads((out / "summary.json").read_text())
    for key in ("gold_before", "gold_after", "kl", "rm_accuracy", "seconds", "task", "preset", "seed"):
        assert key in s, key
    assert s["task"] == "arith" and s["rm_accuracy"] is None
    assert s["eval_prompts"] >= 256
    # exact-match accuracy, sampled at T=1 on 512 held-out sums. Measured +0.213 at seed 0 against the
    # documented target of +0.20 (docs, issue); the bound is 0.15 so float drift across machines/BLAS
    # builds cannot fail a run that meets the target
    assert s["gold_after"] >= s["gold_before"] + 0.15, s
    assert 0 < s["kl"] < 20, s
    before, after = _read(out / "samples_before.jsonl"), _read(out / "samples_after.jsonl")
    assert [r["prompt"] for r in before] == [r["prompt"] for r in after]
    assert sum(r["gold"] for r in after) / len(after) == pytest.approx(s["gold_after"])
    for stage in ("data", "sft", "ppo"):
        assert (out / stage / "DONE").exists(), stage
    assert (out / "ppo" / "metrics.jsonl").exists()
    printed = capsys.readouterr()
    lines = printed.err.rstrip().splitlines()  # shifu's own lines: stderr, nothing on stdout
    assert printed.out == "" and lines[-3].startswith("  sampled at T=1: before") and "greedy" in lines[-2]
    assert lines[-1].endswith(f"outputs in {out} (summary.json, report.html; policy in ppo/final)")

    # a rerun continues: every stage is cached, only the evaluation runs again (same samples, same figures)
    mtime = (out / "ppo" / "final").stat().st_mtime
    assert cli_main(["quickstart", "--task", "arith", "--out", str(out)]) == 0
    assert (out / "ppo" / "final").stat().st_mtime == mtime
    assert json.loads((out / "summary.json").read_text())["gold_after"] == s["gold_after"]
    assert s["policy"] == "ppo/final"

    _check_soup(tmp_path, out, s, capsys)


def _check_soup(tmp_path, out, s: dict, capsys) -> None:
    """The soup part of :func:`test_arith_quickstart_ppo_beats_sft`, on the finished run ``out`` (summary
    ``s``)."""
    # a soup plan (on a copy of the run's finished data and SFT stages, with short PPO members to keep CI's
    # time: the soup's gains are measured in docs/benchmarks/alignment.md): two PPO runs (seeds 0 and 1000) and their
    # merge, which is what is judged; a rerun asking for the soup keeps ppo/ and adds only what is new
    out_soup = tmp_path / "soup-run"
    for stage in ("data", "sft"):
        shutil.copytree(out / stage, out_soup / stage)
    short = ["--set", "ppo.iterations=8"]
    assert cli_main(["quickstart", "--task", "arith", "--out", str(out_soup), *short]) == 0
    one = json.loads((out_soup / "summary.json").read_text())
    mtime = (out_soup / "ppo" / "final").stat().st_mtime
    assert (
        cli_main(["quickstart", "--task", "arith", "--out", str(out_soup), *short, "--set", "soup.members=2"])
        == 0
    )
    assert (out_soup / "ppo" / "final").stat().st_mtime == mtime
    out = out_soup
    soup = json.loads((out / "summary.json").read_text())
    assert soup["policy"] == "soup/final" and set(soup["cpu_seconds"]) >= {"ppo", "ppo-2", "soup"}
    assert yaml.safe_load((out / "ppo-2" / "config.yaml").read_text())["seed"] == 1000
    merged = json.loads((out / "soup" / "final" / "merge.json").read_text())
    assert merged["policies"] == [str(out / "ppo" / "final"), str(out / "ppo-2" / "final")]
    assert soup["gold_before"] == s["gold_before"] == one["gold_before"], soup  # the copied SFT policy
    assert 0 < soup["kl"] < one["kl"], (soup, one)  # two runs' own noise partly cancels in their mean
    assert "Merged (`shifu merge`)" in (out / "soup" / "final" / "README.md").read_text()
    printed = capsys.readouterr()  # shifu's lines: stderr
    assert printed.err.rstrip().endswith("policy in soup/final)") and printed.out == ""
    # another scale re-merges the same runs (the stage's marker records what it merged); nothing retrains
    mtime2 = (out / "ppo-2" / "final").stat().st_mtime
    half = [*short, "--set", "soup.members=2", "--set", "soup.scale=0.5"]
    assert cli_main(["quickstart", "--task", "arith", "--out", str(out), *half]) == 0
    assert json.loads((out / "soup" / "final" / "merge.json").read_text())["scale"] == 0.5
    assert (out / "ppo-2" / "final").stat().st_mtime == mtime2
    assert json.loads((out / "summary.json").read_text())["kl"] < soup["kl"]  # halfway back to SFT
    # another ppo.* plan is refused at the finished ppo stage, by key, before a third member trains under it
    mixed = ["--set", "soup.members=3", "--set", "ppo.iterations=2"]  # the members ran 8
    assert cli_main(["quickstart", "--task", "arith", "--out", str(out), *mixed]) == 2
    err = capsys.readouterr().err
    assert f"stage ppo in {out / 'ppo'} finished with another plan than this run's: iterations was" in err
    assert "now 2" in err and not (out / "ppo-3").exists()
    assert json.loads((out / "soup" / "final" / "merge.json").read_text())["scale"] == 0.5  # soup untouched
    for bad, says in [
        ("soup.members=0", "soup.members must be a whole number >= 1"),
        ("soup.scale=abc", "section 'soup': config key 'scale': expected a number, got 'abc'"),
    ]:  # refused with the plan before anything runs
        assert cli_main(["quickstart", "--task", "arith", "--out", str(out), *short, "--set", bad]) == 2
        assert says in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_imdb_quickstart_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIFU_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = [
        "quickstart",
        "--task",
        "imdb",
        "--preset",
        "tiny",
        "--out",
        str(out),
        "--set",
        "sft.max_steps=40",
        "--set",
        "ppo.iterations=2",
        "--set",
        "rm.max_steps=10",
    ]
    assert cli_main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["task"] == "imdb" and s["eval_prompts"] >= 256
    assert -1 <= s["gold_before"] <= 1 and -1 <= s["gold_after"] <= 1
    assert 0 <= s["rm_accuracy"] <= 1
    assert s["kl"] >= 0  # the headline is the k3 estimate: never negative (k1 can be)
    assert "kl_k1" in s and s["gold_gain_se"] >= 0 and s["gold_before_se"] > 0
    assert set(s["seconds"]) >= {"prepare", "sft", "pairs", "rm", "ppo", "eval"}
    assert set(s["cpu_seconds"]) == set(s["seconds"]) and all(v > 0 for v in s["cpu_seconds"].values())
    pairs = _read(out / "pairs" / "pairs_train.jsonl")
    assert all({"prompt", "chosen", "rejected"} <= set(r) for r in pairs)
    heldout = {r["prompt"] for r in _read(out / "data" / "prompts_eval.jsonl")}
    trained = {r["prompt"] for r in _read(out / "data" / "prompts_train.jsonl")} | {
        r["prompt"] for r in pairs
    }
    assert heldout.isdisjoint(trained)
    after = _read(out / "samples_after.jsonl")
    assert len(after) == s["eval_prompts"] and {"prompt", "response", "gold"} <= set(after[0])
    assert (out / "rm" / "metrics.jsonl").exists() and (out / "ppo" / "metrics.jsonl").exists()


@pytest.mark.unit
def test_quickstart_rejects_bad_input(tmp_path, capsys):
    assert cli_main(["quickstart", "--task", "arith", "--preset", "small", "--out", str(tmp_path)]) == 2
    assert "no quickstart plan" in capsys.readouterr().err
    assert cli_main(["quickstart", "--task", "arith", "--out", str(tmp_path), "--set", "iterations=3"]) == 2
    assert "stage.key=value" in capsys.readouterr().err
    # a key no stage reads is refused before anything runs (on a finished run it would otherwise read as a
    # change of plan); the message names the valid keys of the section it went wrong in
    for bad, says in [
        (
            "ppo.itrations=3",
            "unknown config key 'ppo.itrations'. Did you mean 'ppo.iterations'? Valid keys here:",
        ),
        ("ppo.kl.init_coeff=0.1", "unknown config key 'ppo.kl.init_coeff'. Did you mean 'ppo.kl.init_coef'?"),
        ("sfx.max_steps=3", "no stage 'sfx' in this plan; its stages are eval, ppo, sft, soup"),
        (
            "soup.member=2",
            "unknown config key 'soup.member'. Did you mean 'soup.members'? Valid keys here: members,",
        ),
    ]:
        out = tmp_path / "bad"
        assert cli_main(["quickstart", "--task", "arith", "--out", str(out), "--set", bad]) == 2
        assert f"--set '{bad}': {says}" in capsys.readouterr().err and not out.exists()
    assert (
        cli_main(
            [
                "quickstart",
                "--task",
                "imdb",
                "--preset",
                "smollm2",
                "--out",
                str(out),
                "--set",
                "sft.max_steps=3",
            ]
        )
        == 2
    )
    assert "this plan has no sft stage" in capsys.readouterr().err


@pytest.mark.unit
def test_imdb_pair_prompts_are_topped_up_from_training_prompts(tmp_path):
    from shifu.pipelines.quickstart import PLANS, preference_prompts

    files = {"prompts_pairs": str(tmp_path / "pairs.jsonl"), "prompts_train": str(tmp_path / "train.jsonl")}
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"t{i}"}) + "\n" for i in range(5)))
    assert preference_prompts(files) == ["p0", "p1", "p2"]
    assert preference_prompts(files, 2) == ["p0", "p1", "p2"]  # never fewer than the task's own
    assert preference_prompts(files, 5) == ["p0", "p1", "p2", "t0", "t1"]
    assert preference_prompts(files, 100) == ["p0", "p1", "p2", "t0", "t1", "t2", "t3", "t4"]
    # imdb small: 12000 prompts for its bag-of-tokens reward model (3000 gave it 0.71-0.77 held-out
    # accuracy, 12000 0.80-0.81), ties dropped; the imdb "reduced" study keeps 3000 and MiniLM, one epoch
    from shifu.study.budgets import BUDGETS

    small = PLANS[("imdb", "small")]
    assert small["pairs"]["num_prompts"] == 12000 and small["pairs"]["drop_ties"] is True
    assert small["rm"]["model"]["path"] == "bag-of-tokens" and small["ppo"]["reward"]["dense"] is True
    reduced = BUDGETS[("imdb", "reduced")]
    assert reduced["pairs"]["num_prompts"] == 3000 and reduced["rm"]["model"]["path"] == "minilm"
    assert reduced["rm"]["epochs"] == 1.0


@pytest.mark.unit
def test_unchanged_policy_gains_exactly_zero_with_error_bars(tiny_model_dir, tmp_path):
    """Before and after share prompts and the sampling seed: the SFT policy judged against itself gains 0.0
    exactly, at KL 0 (both estimates), while the per-policy scores still carry a standard error."""
    from shifu.core.stats import mean_se
    from shifu.evaluation.final import evaluate

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev = {"temperature": 1.0, "max_new_tokens": 4}
    s = evaluate("imdb", tiny_model_dir, tiny_model_dir, str(path), ev, 0, tmp_path)
    assert s["gold_gain"] == 0.0 and s["gold_gain_se"] == 0.0 and s["gold_before"] == s["gold_after"]
    assert s["kl"] == 0.0 and s["kl_k1"] == 0.0
    assert s["gold_before_se"] == s["gold_after_se"] > 0  # VADER differs between the sampled responses
    after = _read(tmp_path / "samples_after.jsonl")
    assert all(r["kl"] == 0.0 and r["kl_k1"] == 0.0 for r in after)
    assert mean_se([1.0, 3.0])[1] == pytest.approx(1.0) and mean_se([2.0])[1] is None


@pytest.mark.unit
def test_a_finished_stage_with_another_plan_is_refused_and_kept(tmp_path, capsys):
    """A rerun skips a finished stage only when its recorded plan is this run's; another plan is refused
    by key (the stage's files untouched, nothing later runs), in a moved run directory too."""
    from shifu.errors import ShifuError
    from shifu.pipelines.stages import Stages

    calls = []

    def work(stage_dir):
        calls.append(stage_dir)
        (stage_dir / "out.txt").parent.mkdir(parents=True, exist_ok=True)
        (stage_dir / "out.txt").write_text("made")
        return {"score": 1.5}

    root = tmp_path / "run"
    plan = {"optim": {"lr": 1e-3}, "model": {"path": str(root / "data" / "base")}, "seed": 0}
    marker = Stages(root, 0, "t").run("sft", root / "sft", "stage sft", work, plan)
    assert calls == [root / "sft"] and marker["score"] == 1.5
    assert marker["plan"]["model"]["path"] == "<run>/data/base"  # paths inside the run, as the run's
    assert Stages(root, 0, "t").run("sft", root / "sft", "stage sft", work, plan)["score"] == 1.5
    assert len(calls) == 1  # the same plan: kept, not run again
    other = {**plan, "optim": {"lr": 3e-4}, "seed": 1}
    with pytest.raises(ShifuError) as e:
        Stages(root, 0, "t").run("sft", root / "sft", "stage sft", work, other)
    msg = str(e.value)
    assert (
        f"stage sft in {root / 'sft'} finished with another plan than this run's: optim.lr was 0.001, now 0.0003"
        in msg
    )
    assert "(and seed differ)" in msg and "use a new --out" in msg
    assert len(calls) == 1 and (root / "sft" / "out.txt").read_text() == "made"
    # the run directory moved: its own paths are still its own, the plan matches
    moved = tmp_path / "moved"
    shutil.move(str(root), str(moved))
    plan_moved = {**plan, "model": {"path": str(moved / "data" / "base")}}
    Stages(moved, 0, "t").run("sft", moved / "sft", "stage sft", work, plan_moved)
    assert len(calls) == 1
    # a marker written before plans were recorded is kept as it is, and says so
    (moved / "sft" / "DONE").write_text(json.dumps({"seconds": 1.0, "cpu_seconds": 1.0}))
    Stages(moved, 0, "t").run("sft", moved / "sft", "stage sft", work, other)
    assert len(calls) == 1 and "did not record its plan; kept as it is" in capsys.readouterr().err


@pytest.mark.unit
def test_soup_refuses_members_trained_with_other_settings(tmp_path):
    """Members finished before stage plans were recorded are compared by their config.yaml: the seed and
    out_dir may differ, nothing else."""
    from shifu.errors import ShifuError
    from shifu.pipelines.quickstart import same_settings

    for name, seed, lr in (("ppo", 0, 1e-3), ("ppo-2", 1000, 1e-3), ("ppo-3", 2000, 3e-4)):
        (tmp_path / name).mkdir()
        cfg = {"seed": seed, "out_dir": str(tmp_path / name), "optim": {"lr": lr}}
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    same_settings(tmp_path, [tmp_path / "ppo", tmp_path / "ppo-2"])
    with pytest.raises(ShifuError, match="ppo-3 was trained with other settings than .*optim.lr"):
        same_settings(tmp_path, [tmp_path / "ppo", tmp_path / "ppo-2", tmp_path / "ppo-3"])


@pytest.mark.integration
def test_print_config_prints_the_resolved_plan_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from shifu.pipelines.quickstart import PLANS

    monkeypatch.chdir(tmp_path)
    argv = [
        "quickstart",
        "--task",
        "arith",
        "--print-config",
        "--set",
        "ppo.iterations=3",
        "--set",
        "soup.members=2",
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("# shifu quickstart plan: ") and "arith-tiny.yaml --set ppo.iterations=3" in out
    plan = yaml.safe_load(out)
    expected = json.loads(json.dumps(PLANS[("arith", "tiny")]))
    expected["ppo"]["iterations"], expected["soup"] = 3, {"members": 2}
    # the shipped plan unchanged
    assert plan == expected and PLANS[("arith", "tiny")]["ppo"]["iterations"] == 40
    assert cli_main(["quickstart", "--print-config"]) == 0  # imdb's default preset, small
    assert yaml.safe_load(capsys.readouterr().out) == PLANS[("imdb", "small")]
    # a --set value of the wrong type is refused with the plan, the section and the key
    assert cli_main(["quickstart", "--task", "arith", "--print-config", "--set", "ppo.iterations=many"]) == 2
    err = capsys.readouterr().err
    assert "the arith/tiny plan with --set ppo.iterations=many, section 'ppo'" in err
    assert "config key 'iterations': expected an integer, got 'many'" in err
    assert list(tmp_path.iterdir()) == []  # nothing was run or written


@pytest.mark.unit
def test_a_mistake_in_a_plan_file_names_the_file_the_section_and_the_key(tmp_path):
    from shifu.config.loader import shipped
    from shifu.errors import ConfigError
    from shifu.pipelines.quickstart import PLANS, read_plans

    shutil.copytree(shipped("quickstart"), tmp_path, dirs_exist_ok=True)
    assert read_plans(tmp_path) == PLANS  # the shipped files are what quickstart runs
    path = tmp_path / "arith-tiny.yaml"
    good = path.read_text()
    for old, new, says in [
        (
            "ppo_epochs: 4",
            "ppo_epoch: 4",
            "section 'ppo': unknown config key 'ppo_epoch'. Did you mean 'ppo_epochs'?",
        ),
        (
            "controller: fixed",
            "controller: fixd",
            "section 'ppo': config key 'kl.controller': 'fixd' is not one",
        ),
        ("max_steps: 260", "max_steps: 260.5", "section 'sft': config key 'max_steps': expected an integer"),
        (
            "batch_size: 128\n  minibatch_size: 64",
            "batch_size: 128\n  minibatch_size: 100",
            "section 'ppo': ",
        ),
        ("eval: {max_new_tokens: 5,", "eval: {max_new_token: 5,", "section 'eval': unknown config key"),
        ("lr: 2.0e-4", "lr: 2e-4", "'ppo.optim.lr' is a number written as text ('2e-4')"),
        (
            "\nppo:",
            "\nppp: {}\nppo:",
            "unknown config key 'ppp'. Valid keys here: eval, gold, pairs, ppo, rm,",
        ),
    ]:
        assert old in good, old
        path.write_text(good.replace(old, new, 1))
        with pytest.raises(ConfigError) as e:
            read_plans(tmp_path)
        assert f"config file '{path}'" in str(e.value) and says in str(e.value), str(e.value)


@pytest.mark.integration
def test_soup_members_train_side_by_side_as_one_after_the_other(tmp_path, capsys):
    """With a torch thread per member, a soup's PPO runs train at once, one forked process and one thread
    each; each run is the very run it would be alone on one thread, and the run's total time counts the
    stretch they shared once."""
    short = [
        "--task",
        "arith",
        "--set",
        "sft.max_steps=4",
        "--set",
        "ppo.iterations=2",
        "--set",
        "soup.members=2",
    ]
    short += ["--set", "ppo.eval.every=0", "--set", "eval.num_prompts=16"]
    apart, together = tmp_path / "apart", tmp_path / "together"
    assert cli_main(["quickstart", "--out", str(apart), "--threads", "1", *short]) == 0
    assert "side by side" not in capsys.readouterr().err
    for stage in ("data", "sft"):  # (the same SFT policy, trained on one thread)
        shutil.copytree(apart / stage, together / stage)
    try:
        assert cli_main(["quickstart", "--out", str(together), "--threads", "2", *short]) == 0
    finally:
        torch.set_num_threads(1)
    assert (
        "stages ppo, ppo-2 side by side: one process each, 1 torch thread(s) each" in capsys.readouterr().err
    )
    for run in ("ppo", "ppo-2"):
        marker = json.loads((together / run / "DONE").read_text())
        assert marker["side_by_side"] == ["ppo", "ppo-2"]
        assert "side_by_side" not in json.loads((apart / run / "DONE").read_text())
        mine, theirs = (load_file(d / run / "final" / "model.safetensors") for d in (together, apart))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), run
    s, alone = (json.loads((d / "summary.json").read_text()) for d in (together, apart))
    assert s["gold_after"] == alone["gold_after"] and s["kl"] == alone["kl"]
    secs = s["seconds"]
    shared = secs["ppo"] + secs["ppo-2"] - max(secs["ppo"], secs["ppo-2"])
    assert s["seconds_total"] == pytest.approx(sum(secs.values()) - shared, abs=0.02)

"""``shifu study frontier``: a one-seed arith frontier with two points per method (the CI run), and the
pieces it is built from (point selection, aggregation over seeds, the shared measurement)."""

from __future__ import annotations

import json

import pytest
import torch

from shifu.cli.main import main as cli_main
from shifu.pipelines.stages import merge
from shifu.study import analysis, budgets
from shifu.study import frontier as study
from shifu.study import runs as study_runs

torch.set_num_threads(1)


@pytest.mark.unit
def test_spread_keeps_first_and_last_points():
    labels = ["a", "b", "c", "d"]
    assert study._spread(labels, 2) == ["a", "d"]
    assert study._spread(labels, 3) == ["a", "c", "d"]
    assert study._spread(labels, None) == labels
    assert study._spread(labels, 9) == labels


@pytest.mark.unit
def test_aggregate_means_and_sample_std_over_seeds():
    results = [
        {
            "method": "ppo",
            "point": "beta=0.1",
            "seed": s,
            "gold": g,
            "kl": k,
            "response_len": 3.0,
            "train_seconds": 10.0,
            "proxy": None,
        }
        for s, g, k in [(0, 0.2, 1.0), (1, 0.4, 3.0)]
    ]
    agg = analysis.aggregate(results, {"ppo": ["beta=0.1"], "dpo": []})
    p = agg["ppo"]["points"][0]
    assert p["gold_mean"] == pytest.approx(0.3) and p["kl_mean"] == pytest.approx(2.0)
    assert p["gold_std"] == pytest.approx(0.1414, abs=1e-4)  # sample std (n - 1)
    assert agg["ppo"]["train_seconds_per_run"] == 10.0
    assert agg["dpo"]["points"] == []


@pytest.mark.unit
def test_std_at_kl_removes_the_part_of_the_seed_spread_that_kl_explains():
    # every seed on one line gold = 0.5 - 0.1 * kl: seeds differ only in how far they drifted
    on_line = [[(k, 0.5 - 0.1 * k) for k in (1.0, 2.0, 3.0)], [(k, 0.5 - 0.1 * k) for k in (5.0, 7.0)]]
    assert analysis._resid_std(on_line) == pytest.approx(0.0, abs=1e-12)
    same_kl = [[(1.0, 0.6), (1.0, 0.4)], [(2.0, 0.3), (2.0, 0.1)]]
    assert analysis._resid_std(same_kl) is None  # no KL spread within points: no slope to fit
    scattered = [[(1.0, 0.6), (2.0, 0.4), (3.0, 0.6)], [(1.0, 0.3), (3.0, 0.3)]]
    # slope 0; deviations from the point means 0.067, -0.133, 0.067, 0, 0: SS 0.0267 over 5 - 2 - 1
    assert analysis._resid_std(scattered) == pytest.approx(0.1155, abs=1e-4)
    assert analysis._resid_std([[(1.0, 0.2)], [(2.0, 0.3)]]) is None  # one seed per point


def _runs(method: str, curves: dict[int, list[tuple[float, float]]]) -> list[dict]:
    return [
        {
            "method": method,
            "point": f"p{i}",
            "seed": seed,
            "gold": g,
            "kl": k,
            "response_len": 1.0,
            "train_seconds": 1.0,
            "proxy": None,
        }
        for seed, pts in curves.items()
        for i, (k, g) in enumerate(pts)
    ]


@pytest.mark.unit
def test_matched_kl_reads_every_seed_along_its_own_frontier():
    import math

    # gold = a + 0.25 ln KL per seed: PPO seeds at a = 0.10 / 0.14, DPO at 0.05 / 0.07 / 0.09, each
    # stopping at different KLs; along ln KL the interpolation is exact, so the answer is known
    def line(a, kls):
        return [(k, a + 0.25 * math.log(k)) for k in kls]

    results = _runs("ppo", {0: line(0.10, [2.0, 6.0, 16.0]), 1: line(0.14, [1.5, 5.0, 12.0])})
    results += _runs(
        "dpo", {0: line(0.05, [4.0, 9.0]), 1: line(0.07, [3.0, 20.0]), 2: line(0.09, [5.0, 8.0])}
    )
    order = {"ppo": ["p0", "p1", "p2"], "dpo": ["p0", "p1"]}
    mk = analysis.matched_kl(analysis.aggregate(results, order), grid_points=3)
    # range: PPO's 2nd-lowest start 2.0 .. 2nd-highest end 12; DPO's 4.0 .. 9.0 -> grid 4 .. 9 (in ln KL)
    assert mk["kl_grid"][0] == pytest.approx(4.0) and mk["kl_grid"][-1] == pytest.approx(9.0)
    assert mk["kl_grid"][1] == pytest.approx(6.0)  # geometric middle
    for row, kl in zip(mk["methods"]["ppo"], mk["kl_grid"]):
        assert row["seeds"] == 2 and row["gold_mean"] == pytest.approx(0.12 + 0.25 * math.log(kl))
        assert row["gold_std"] == pytest.approx(0.04 / math.sqrt(2))
    dpo = mk["methods"]["dpo"]
    assert [r["seeds"] for r in dpo] == [2, 3, 2]  # seed 2 covers only 5..8, seed 0 only up to 9
    assert dpo[1]["gold_mean"] == pytest.approx(0.07 + 0.25 * math.log(6.0))
    diff = mk["vs_ppo"]["dpo"][1]
    assert diff["ppo_minus"] == pytest.approx(0.05)
    assert diff["se"] == pytest.approx(math.sqrt(0.04**2 / 2 / 2 + 0.02**2 / 3))


@pytest.mark.unit
def test_matched_kl_needs_two_methods_with_overlapping_ranges():
    one = analysis.aggregate(
        _runs("ppo", {0: [(1.0, 0.1), (2.0, 0.2)], 1: [(1.0, 0.1), (3.0, 0.3)]}), {"ppo": ["p0", "p1"]}
    )
    assert analysis.matched_kl(one) is None
    apart = _runs("ppo", {s: [(1.0, 0.1), (2.0, 0.2)] for s in (0, 1)})
    apart += _runs("dpo", {s: [(5.0, 0.1), (9.0, 0.2)] for s in (0, 1)})
    mk = analysis.matched_kl(analysis.aggregate(apart, {"ppo": ["p0", "p1"], "dpo": ["p0", "p1"]}))
    assert mk["kl_grid"] == [] and "do not overlap" in mk["note"]
    assert analysis._gold_at([(1.0, 0.1), (4.0, 0.3)], 2.0) == pytest.approx(0.2)  # halfway in ln KL
    assert analysis._gold_at([(1.0, 0.1), (4.0, 0.3)], 5.0) is None  # never extrapolated


@pytest.mark.unit
def test_each_method_meets_ppo_on_the_range_the_two_share():
    """Two methods whose KL ranges miss each other but each overlap PPO's: no common grid, but each is
    still compared with PPO where the two of them overlap (gold = a + ln KL: the difference is known)."""
    import math

    def line(a, kls):
        return [(k, a + math.log(k)) for k in kls]

    results = _runs("ppo", {0: line(0.10, [1.0, 10.0]), 1: line(0.20, [1.0, 10.0])})
    results += _runs("dpo", {s: line(0.0, [1.0, 2.0]) for s in (0, 1)})
    results += _runs("grpo", {s: line(0.05 * s, [5.0, 10.0]) for s in (0, 1)})
    order = {m: ["p0", "p1"] for m in ("ppo", "dpo", "grpo")}
    methods = analysis.aggregate(results, order)
    assert analysis.matched_kl(methods)["kl_grid"] == []
    pairs = analysis.vs_ppo_pairwise(methods)
    assert [d["kl"] for d in pairs["dpo"]] == pytest.approx([1.0, math.sqrt(2.0), 2.0])
    assert [d["kl"] for d in pairs["grpo"]] == pytest.approx([5.0, math.sqrt(50.0), 10.0])
    for d in pairs["dpo"]:
        assert d["ppo_minus"] == pytest.approx(0.15) and d["dpo"] == pytest.approx(math.log(d["kl"]))
        assert d["se"] == pytest.approx(math.sqrt(0.1**2 / 2 / 2))
    assert all(d["ppo_minus"] == pytest.approx(0.125) for d in pairs["grpo"])


@pytest.mark.unit
def test_only_selects_points_in_budget_order_and_rejects_unknown_ones(tmp_path, capsys):
    plan = budgets.BUDGETS[("arith", "ci")]
    assert budgets.select_points(plan, ["reinforce:beta=0.01", "ppo:beta=0.3"]) == {
        "ppo": ["beta=0.3"],
        "reinforce": ["beta=0.01"],
    }
    code = cli_main(
        [
            "study",
            "frontier",
            "--task",
            "arith",
            "--budget",
            "ci",
            "--only",
            "ppo:beta=9",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 2
    assert "no point 'ppo:beta=9'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any stage ran


@pytest.mark.unit
def test_imdb_reduced_budget_uses_the_small_preset_without_tie_pairs():
    from shifu.pipelines.quickstart import PLANS

    plan = budgets.BUDGETS[("imdb", "reduced")]
    assert plan["preset"] == "small"
    pairs = merge(PLANS[("imdb", "small")]["pairs"], plan["pairs"])
    assert pairs["drop_ties"] is True and pairs["num_prompts"] == 3000
    # evaluation prompts are cut as the RL trainers cut them (the small model has 64 positions)
    assert plan["eval"]["max_prompt_len"] == plan["ppo"]["data"]["max_prompt_len"]


@pytest.mark.unit
def test_measure_of_the_reference_itself_has_zero_kl(tiny_model_dir):
    rows = [{"prompt": p} for p in ("the movie", "hello there", "tell me a story")]
    m = study_runs.measure(
        tiny_model_dir, tiny_model_dir, rows, lambda ps, ys, rs: [float(len(y)) for y in ys], 6, 1.0, 0
    )
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["gold"] > 0  # the judge saw the sampled text


@pytest.mark.unit
def test_unknown_budget_exits_2(tmp_path, capsys):
    code = cli_main(["study", "frontier", "--task", "arith", "--budget", "huge", "--out", str(tmp_path)])
    assert code == 2
    assert "no frontier budget 'huge'" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_arith_frontier_one_seed_every_method(tmp_path, monkeypatch, capsys):
    """The ``ci`` budget, one seed: both points of PPO, REINFORCE and DPO, the weak-KL point of each
    critic-free method (their hand-computed tests are in test_core_group.py and test_ppo_estimators.py; here
    each runs through the study end to end)."""
    out = tmp_path / "frontier"
    dpo = ["dpo:beta=1.0", "dpo:beta=0.03"]
    two = [f"{m}:beta={b}" for m in ("ppo", "reinforce") for b in (0.3, 0.01)] + dpo
    one = [f"{m}:beta=0.01" for m in budgets.METHODS if m not in ("ppo", "reinforce", "dpo")]
    argv = ["study", "frontier", "--task", "arith", "--budget", "ci", "--seeds", "1", "--out", str(out)]
    assert cli_main([*argv, "--only", *two, *one]) == 0
    report = json.loads((out / "frontier.json").read_text())
    assert (out / "frontier.png").stat().st_size > 10_000
    assert report["eval"]["prompts"] == 256 and report["sft"]["kl"] == pytest.approx(0.0, abs=1e-6)
    for method in budgets.METHODS:
        m = report["methods"][method]
        assert len(m["points"]) == (2 if method in ("ppo", "reinforce", "dpo") else 1), method
        assert m["train_seconds_per_run"] > 0
        for p in m["points"]:
            assert 0.0 <= p["gold_mean"] <= 1.0
            assert p["kl_mean"] > 0.01, (method, p)  # every method moved its policy off the reference
    # DPO's beta is a direct KL knob (beta 1 vs 0.03); measured 2.0 vs 5.9 nats. The fixed-beta penalty of
    # a 12-iteration PPO/REINFORCE run is not (KL 1.3 vs 1.6 and 0.66 vs 0.59), so no order is asserted there.
    strong, weak = report["methods"]["dpo"]["points"]
    assert weak["kl_mean"] > strong["kl_mean"]

    # a rerun reuses the finished run of its plan; under another plan (here the held-out sampling
    # temperature) the finished run is refused by key, not reported as if measured under it
    again = [
        "study",
        "frontier",
        "--task",
        "arith",
        "--budget",
        "ci",
        "--seeds",
        "1",
        "--out",
        str(out),
        "--only",
        "ppo:beta=0.3",
        "--name",
        "again",
    ]
    result = out / "runs" / "ppo-beta0.3-s0" / "RESULT.json"
    before = result.read_text()
    assert cli_main(again) == 0
    assert (
        json.loads((out / "again.json").read_text())["methods"]["ppo"]["points"][0]["gold_mean"]
        == (report["methods"]["ppo"]["points"][0]["gold_mean"])
    )
    plan = budgets.BUDGETS[("arith", "ci")]
    monkeypatch.setitem(
        budgets.BUDGETS, ("arith", "ci"), {**plan, "eval": {**plan["eval"], "temperature": 0.5}}
    )
    capsys.readouterr()
    assert cli_main(again) == 2
    err = capsys.readouterr().err
    assert f"run ppo beta=0.3 seed 0 in {result.parent} finished with another plan" in err
    assert "eval.temperature was 1.0, now 0.5" in err and result.read_text() == before


@pytest.mark.integration
def test_print_config_prints_the_budget_as_the_study_runs_it(tmp_path, monkeypatch, capsys):
    import yaml

    from shifu.pipelines.quickstart import PLANS

    monkeypatch.chdir(tmp_path)
    assert cli_main(["study", "frontier", "--task", "imdb", "--print-config"]) == 0  # budget reduced
    out = capsys.readouterr().out
    assert out.startswith("# shifu study frontier budget: ") and "imdb-reduced.yaml" in out
    plan, budget, small = yaml.safe_load(out), budgets.BUDGETS[("imdb", "reduced")], PLANS[("imdb", "small")]
    # the shared stages as they run: the budget's keys over the quickstart small plan's
    assert plan["sft"] == {**small["sft"], "max_steps": 400}  # the study's own SFT length
    assert plan["pairs"] == {**small["pairs"], "num_prompts": 3000}
    assert plan["rm"]["model"] == {"path": "minilm"} and plan["rm"]["l2_coef"] == 0.0
    # every method's settings and points, the critic-free ones included
    assert {k: plan[k] for k in budgets.METHODS} == {k: budget[k] for k in budgets.METHODS}
    assert plan["points"] == budget["points"] and list(plan["points"]["grpo"]) == list(
        budget["points"]["ppo"]
    )
    assert cli_main(["study", "frontier", "--task", "arith", "--budget", "huge", "--print-config"]) == 2
    assert "no frontier budget 'huge'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing was run or written


@pytest.mark.unit
def test_a_mistake_in_a_budget_file_names_the_file_and_the_key(tmp_path):
    import shutil

    from shifu.config.loader import shipped
    from shifu.errors import ConfigError

    shutil.copytree(shipped("study"), tmp_path, dirs_exist_ok=True)
    assert budgets.read_budgets(tmp_path) == budgets.BUDGETS  # the shipped files are what the study runs
    path = tmp_path / "arith-ci.yaml"
    good = path.read_text()
    for old, new, says in [
        (
            "beta=0.01: {kl: {controller: fixed, init_coef: 0.01}}\n  reinforce",
            "beta=0.01: {kl: {controler: fixed, init_coef: 0.01}}\n  reinforce",
            "point 'beta=0.01' of ppo (over its section): unknown config key 'kl.controler'",
        ),
        (
            "ppo_epochs: 1,",
            "ppo_epochs: 2,",
            "section 'reinforce': algo=reinforce is on-policy: set ppo_epochs=1",
        ),
        (
            "samples_per_prompt: 4",
            "samples_per_promt: 4",
            "section 'pairs' (over the quickstart plan's): unknown",
        ),
        ("num_prompts: 256}", "num_prompts: 256, seed: 1}", "section 'eval': unknown config key 'seed'"),
        ("preset: tiny", "preset: huge", "preset 'huge' is no quickstart plan of task arith"),
        (
            "critic_free_betas: [0.3, 0.01]",
            "critic_free_betas: 0.3",
            "critic_free_betas must be a list of numbers",
        ),
    ]:
        assert old in good, old
        path.write_text(good.replace(old, new, 1))
        with pytest.raises(ConfigError) as e:
            budgets.read_budgets(tmp_path)
        assert f"config file '{path}'" in str(e.value) and says in str(e.value), str(e.value)

"""``shifu ppo`` with an environment (``ppo.env``): a third-party environment written only against the public
interface trains; every advantage estimator runs on episodes; a bad factory is refused before anything is
written; a faulty environment stops the run by name with its checkpoints intact, or ends its episodes."""

from __future__ import annotations

import json
import re

import pytest
from ppo_task import build_char_model, write_prompts

from shifu.cli import main as cli
from shifu.runs import checkpoint as ckpt

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppo_env")
    return {"char": build_char_model(d / "char"), "prompts": write_prompts(d / "prompts.jsonl", 64)}


def argv(data, out, *extra: str) -> list[str]:
    return [
        "ppo",
        "--out",
        str(out),
        f"model.path={data['char']}",
        f"data.train={data['prompts']}",
        f"data.eval={data['prompts']}",
        "env.factory=thirdparty_env:Echo",
        "generation.stop=[g,h,i,j,k,l]",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=12",
        "batch_size=32",
        "minibatch_size=16",
        "ppo_epochs=2",
        "eval.every=12",
        "eval.num_prompts=32",
        "eval.temperature=1.0",
        "critic.init=sft",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.01",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_third_party_environment_trains(data, tmp_path):
    """thirdparty_env.Echo imports nothing from shifu but Step. PPO (GAE on a critic) raises the episode
    return, the fraction of `a` in the policy's second turn (random policy: ~0.08)."""
    out = tmp_path / "run"
    assert cli.main(argv(data, out)) == 0
    rows = [r for r in metrics(out) if "env/return" in r]
    early = sum(r["env/return"] for r in rows[:3]) / 3
    late = sum(r["env/return"] for r in rows[-3:]) / 3
    assert late > early + 0.1, (early, late)
    evals = [r for r in metrics(out) if "gold/score" in r]
    assert evals[-1]["gold/score"] > evals[0]["gold/score"] + 0.1, evals
    assert all(r["eval/score"] == r["gold/score"] == r["eval/env/return"] for r in evals)
    assert all(1.5 < r["env/turns"] <= 2 for r in rows)  # Echo is done after two turns (unless one was cut)
    # only sampled tokens count: a response is ~2 turns of a few letters, never the observations
    assert all(0 < r["rollout/response_len"] < 2 * 6 for r in rows)
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["response"].startswith("\u27e6") and sample["turns"] == 2  # the policy's turns marked
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evals"][-1]["gold/score"] == evals[-1]["gold/score"]


@pytest.mark.parametrize(
    "estimator",
    ["grpo", "dr_grpo", "rloo", "bon", "reinforce_pp", "reinforce_pp_baseline", "reinforce", "gae_tis"],
)
def test_every_estimator_runs_on_episodes(data, tmp_path, estimator):
    extra = ["iterations=2", "eval.num_prompts=8"]
    if estimator == "gae_tis":
        extra += ["tis_cap=2.0"]
    elif estimator == "reinforce":
        extra += ["algo=reinforce", "ppo_epochs=1"]
    else:
        extra += [f"advantage_estimator={estimator}", "group_size=4", "kl.penalty=loss"]
        if estimator == "dr_grpo":
            extra += ["loss_aggregation=token_sum_norm"]
    out = tmp_path / estimator
    assert cli.main(argv(data, out, *extra)) == 0
    rows = [r for r in metrics(out) if "env/return" in r]
    assert len(rows) == 2 and all(r["rollout/rows"] == 32 for r in rows)
    assert all(abs(r["loss/policy"]) < 1e3 for r in rows)
    if estimator == "gae_tis":
        assert all("rollout/mismatch_is_weight_mean" in r for r in rows)


def test_a_bad_factory_is_refused_before_anything_is_written(data, tmp_path, capsys):
    for factory, said in [
        ("thirdparty_env:Nope", "has no class or function 'Nope'"),
        ("scripted_envs:NoStep", "which has no step() method"),
        ("thirdparty_env", "must look like 'package.module:Name'"),
    ]:
        out = tmp_path / "never"
        assert cli.main(argv(data, out, f"env.factory={factory}")) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err
        assert not out.exists()
    assert cli.main(argv(data, tmp_path / "never", "reward.function=ppo_task:frac_a")) == 2
    assert "error: env.factory rewards the episodes" in capsys.readouterr().err


def test_a_faulty_environment_stops_by_name_with_its_checkpoints_or_ends_its_episodes(data, tmp_path, capsys):
    """A step that raises once 200 steps were taken (iteration 4: 32 episodes of 2 steps each per iteration):
    the run stops with exit 2 and a message naming the environment, the row and the turn; the checkpoint of
    iteration 2 is intact. With on_error=end_episode the same faults end their episodes with reward 0 (counted)
    and the run finishes."""
    import scripted_envs

    scripted_envs.STEPS.clear()
    faulty = [
        "env.factory=scripted_envs:Scripted",
        "env.kwargs={fault: raise, fault_turn: 1, fault_after: 200, done_after: 2, rewards: [0.0, 1.0]}",
        "save_every=2",
        "iterations=6",
    ]
    out = tmp_path / "raise"
    assert cli.main(argv(data, out, *faulty)) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"environment scripted_envs:Scripted, row '[a-l]+', turn 2: step\(\) raised at "
        r"tests/scripted_envs\.py:\d+ ValueError: scripted failure",
        err,
    ), err
    assert "Traceback" not in err and "set env.on_error=end_episode" in err
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and latest.name.endswith("2")
    ckpt.load_checkpoint(latest, {})  # loadable: --resume would continue from it
    scripted_envs.STEPS.clear()
    out2 = tmp_path / "end"
    assert cli.main(argv(data, out2, *faulty, "env.on_error=end_episode", "save_every=0")) == 0
    errors = [r["env/errors"] for r in metrics(out2) if "env/errors" in r]
    assert len(errors) == 6 and errors[0] == 0 and errors[-1] > 0.5  # (a turn cut by its budget never steps)

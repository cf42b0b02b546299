"""Model cards from real runs: sft -> rm -> ppo and dpo on the character task (tiny models, seconds), each
final/README.md parsed back with huggingface_hub's ModelCard (metadata) and its results checked against
the run's own files, including gold standard errors computed here from the per-prompt samples."""

from __future__ import annotations

import json
import random
import re
import shutil
import statistics
from pathlib import Path

import pytest
import yaml
from conftest import write_jsonl
from ppo_task import ALPHABET, build_char_model, write_prompts

from shifu.cli import main as cli
from shifu.reporting.modelcard import main as card_main
from shifu.reporting.modelcard import read_card_metadata, write_model_card

pytestmark = pytest.mark.integration

QUIET = ["progress=false", "tensorboard=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Real sft, rm (on the SFT trunk), ppo (against that reward model, gold judge frac_a) and dpo runs."""
    root = tmp_path_factory.mktemp("cards")
    base = build_char_model(root / "base")
    prompts = write_prompts(root / "prompts.jsonl")
    rng = random.Random(0)

    def prompt() -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(3))

    sft = write_jsonl(
        root / "sft.jsonl", [{"prompt": prompt(), "response": "a" * rng.randint(1, 4)} for _ in range(64)]
    )
    pairs = write_jsonl(
        root / "pairs.jsonl",
        [{"prompt": prompt(), "chosen": "a" * rng.randint(2, 4), "rejected": prompt()} for _ in range(64)],
    )
    out = {k: root / k for k in ("sft", "rm", "ppo", "dpo")}
    argvs = {
        "sft": [f"model.path={base}", f"data.train={sft}", "max_steps=10", "batch_size=8", *QUIET],
        "rm": [
            f"model.path={out['sft'] / 'final'}",
            f"data.train={pairs}",
            "max_steps=10",
            "batch_size=8",
            *QUIET,
        ],
        "ppo": [
            f"model.path={out['sft'] / 'final'}",
            f"data.train={prompts}",
            f"reward.model_path={out['rm'] / 'final'}",
            "eval.gold_function=ppo_task:frac_a",
            "critic.init=sft",
            "iterations=4",
            "batch_size=8",
            "minibatch_size=8",
            "optim.lr=1e-2",
            "generation.max_new_tokens=6",
            "eval.every=2",
            "eval.num_prompts=16",
            "save_every=0",
        ],
        "dpo": [
            f"model.path={out['sft'] / 'final'}",
            f"data.train={pairs}",
            "max_steps=6",
            "batch_size=8",
            *QUIET,
        ],
    }
    for kind in ("sft", "rm", "ppo", "dpo"):
        assert cli.main([kind, "--out", str(out[kind]), *argvs[kind]]) == 0, kind
    return out | {"base": base, "pairs": pairs}


def card_table(text: str) -> dict[str, str]:
    """measure -> value of the card's Markdown tables."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {r[0].strip(): r[1].strip() for r in rows if len(r) == 2}


def test_every_stage_gets_a_card_with_metadata_and_results(runs):
    from huggingface_hub import ModelCard

    base_of = {"sft": "base", "rm": "sft/final", "ppo": "sft/final", "dpo": "sft/final"}
    tags = {"sft": "sft", "rm": "reward-model", "ppo": "ppo", "dpo": "dpo"}
    for kind in ("sft", "rm", "ppo", "dpo"):
        written = (runs[kind] / "final" / "README.md").read_text(encoding="utf-8")  # by the run itself
        path = write_model_card(runs[kind] / "final", runs[kind], kind)
        assert path.read_text(encoding="utf-8") == written  # the same card, written again from its files
        assert path == runs[kind] / "final" / "README.md"
        meta = ModelCard.load(path).data.to_dict()  # the Hub's own parser
        assert meta == read_card_metadata(path)
        assert meta["base_model"] == base_of[kind]  # relative to the run (quickstart-style layout)
        assert meta["library_name"] == ("shifu" if kind == "rm" else "transformers")
        assert meta["tags"] == ["shifu", "rlhf", tags[kind]]
        assert ("pipeline_tag" in meta) == (kind != "rm")
        text = path.read_text(encoding="utf-8")
        assert "## Training recipe" in text and "## Key config" in text and "Not recorded" not in text
        assert "```yaml" in text  # the full config

    summary = {k: json.loads((runs[k] / "summary.json").read_text()) for k in ("sft", "rm", "dpo")}
    rm = card_table((runs["rm"] / "final" / "README.md").read_text())
    assert rm["reward-model accuracy, held-out pairs"] == f"{summary['rm']['eval/rm/accuracy']:.4f}"
    assert rm["data.train"] == "`pairs.jsonl` (64 rows)"
    dpo = card_table((runs["dpo"] / "final" / "README.md").read_text())
    assert dpo["implicit-reward accuracy, held-out pairs"] == f"{summary['dpo']['eval/dpo/accuracy']:.4f}"
    assert dpo["beta"] == "`0.1`"
    sft = card_table((runs["sft"] / "final" / "README.md").read_text())
    first = json.loads((runs["sft"] / "metrics.jsonl").read_text().splitlines()[0])["eval/sft/loss"]
    assert sft["held-out SFT loss, before -> after (nats/token)"] == (
        f"{first:.4f} -> {summary['sft']['eval/sft/loss']:.4f}"
    )

    # PPO: gold at the first and last evaluation with standard errors, from samples.jsonl by hand
    ppo = card_table((runs["ppo"] / "final" / "README.md").read_text())
    samples = [json.loads(x) for x in (runs["ppo"] / "samples.jsonl").read_text().splitlines()]
    before = [s["gold"] for s in samples if s["iteration"] == 0]
    after = [s["gold"] for s in samples if s["iteration"] == 4]
    n = len(after)

    def pm(xs: list[float], sign: str = "") -> str:
        return f"{statistics.mean(xs):{sign}.4f} ± {statistics.stdev(xs) / n**0.5:.4f}"

    label = f"gold (`ppo_task:frac_a`), held-out prompts, iteration 0 -> 4 (n = {n})"
    assert ppo[f"{label}: before"] == pm(before)
    assert ppo[f"{label}: after"] == pm(after)
    assert ppo[f"{label}: gain (paired standard error)"] == pm([a - b for a, b in zip(after, before)], "+")
    assert ppo["reward-model accuracy, held-out pairs"] == f"{summary['rm']['eval/rm/accuracy']:.4f}"
    assert ppo["kl.controller"] == "`adaptive`" and ppo["reward.model_path"] == "`rm/final`"


def test_quickstart_layout_and_missing_files(runs, tmp_path, capsys):
    """A quickstart run: the PPO card carries the end-to-end gold (standard errors from samples_before/
    after), KL and reward-model accuracy; `python -m shifu.reporting.modelcard RUN` writes every stage's card. A
    final/ with no run files still gets a valid card that says what was not recorded."""
    quick = tmp_path / "quickstart-arith-tiny-s0"
    for k in ("sft", "rm", "ppo"):
        shutil.copytree(runs[k], quick / k)
    before, after = [0.0, 0.5, 0.25, 1.0], [0.5, 1.0, 0.25, 1.0]
    for name, golds in (("samples_before", before), ("samples_after", after)):
        write_jsonl(
            quick / f"{name}.jsonl",
            [{"prompt": f"p{i}", "response": "r", "gold": g} for i, g in enumerate(golds)],
        )
    summary = {"gold_before": 0.4375, "gold_after": 0.6875, "kl": 1.25, "rm_accuracy": 0.8, "eval_prompts": 4}
    (quick / "summary.json").write_text(json.dumps(summary))
    assert card_main([str(quick)]) == 0
    assert capsys.readouterr().err.count("wrote ") == 3
    text = (quick / "ppo" / "final" / "README.md").read_text()
    assert (
        text.splitlines()[text.splitlines().index("---", 1) + 2]
        == "# quickstart-arith-tiny-s0/ppo: policy aligned with PPO"
    )
    table = card_table(text)
    label = "gold, end-to-end evaluation (n = 4)"
    se = statistics.stdev(before) / 2
    assert table[f"{label}: before"] == f"0.4375 ± {se:.4f}"
    gain_se = statistics.stdev([a - b for a, b in zip(after, before)]) / 2
    assert table[f"{label}: gain (paired standard error)"] == f"+0.2500 ± {gain_se:.4f}"
    assert table["KL to the reference, end-to-end (nats/response)"] == "1.2500"
    assert table["reward-model accuracy, held-out pairs (quickstart)"] == "0.8000"
    assert read_card_metadata(quick / "rm" / "final" / "README.md")["tags"] == [
        "shifu",
        "rlhf",
        "reward-model",
    ]

    bare = tmp_path / "bare"
    shutil.copytree(runs["ppo"] / "final", bare / "final")
    (bare / "final" / "README.md").unlink()
    meta = read_card_metadata(write_model_card(bare / "final", bare, "ppo"))
    assert meta == {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["shifu", "rlhf", "ppo"],
    }
    text = (bare / "final" / "README.md").read_text()
    assert "no config.yaml in the run directory" in text and "No results were recorded." in text
    with pytest.raises(Exception, match="unknown model kind 'ppx'"):
        write_model_card(bare / "final", bare, "ppx")


# a path that starts at the root or the home directory, wherever it stands in the text
ABSOLUTE = re.compile(r"(^|[\s`'\"(=:\[])(/|~/)[\w.]")


@pytest.fixture(scope="module")
def families(runs, tmp_path_factory) -> dict[str, Path]:
    """Short real runs of the other estimator families, from the same SFT policy: GRPO (KL in the loss),
    RLOO (KL in the reward), and REINFORCE on a third-party environment's episodes."""
    root = runs["sft"].parent
    common = [
        f"model.path={runs['sft'] / 'final'}",
        f"data.train={root / 'prompts.jsonl'}",
        "iterations=2",
        "batch_size=8",
        "minibatch_size=8",
        "eval.every=1",
        "eval.num_prompts=8",
        "save_every=0",
        *QUIET,
    ]
    rewarded = ["reward.function=ppo_task:frac_a", "eval.gold_function=ppo_task:frac_a"]
    argvs = {
        "grpo": [*rewarded, "advantage_estimator=grpo", "group_size=4", "kl.penalty=loss"],
        "rloo": [*rewarded, "advantage_estimator=rloo", "group_size=4"],
        "env": [
            "env.factory=thirdparty_env:Echo",
            "generation.stop=[g,h,i,j,k,l]",
            "generation.max_new_tokens=6",
            "generation.max_total_tokens=24",
            "algo=reinforce",
            "ppo_epochs=1",
        ],
    }
    for name, extra in argvs.items():
        assert (
            cli.main(["ppo", "--out", str(root / name), *common, "generation.max_new_tokens=6", *extra]) == 0
        )
    return {name: root / name for name in argvs}


def check_card(run: Path, must: list[str], never: list[str]) -> str:
    """The card of ``run``: no absolute path, each of ``must`` in it, none of ``never``; every row of its Key
    config table is the value config.yaml recorded (a path as the card shows it, relative to the run)."""
    from shifu.config.loader import lookup
    from shifu.reporting.names import shown_path

    text = (run / "final" / "README.md").read_text(encoding="utf-8")
    assert not ABSOLUTE.search(text), ABSOLUTE.search(text)
    assert str(run.resolve().parent) not in text and str(Path.home()) not in text
    assert [m for m in must if m not in text] == [], text
    assert [n for n in never if n in text] == [], text
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    keys = card_table(text.split("## Key config", 1)[1].split("## Results", 1)[0])
    assert keys.pop("key") == "value" and len(keys) > 10  # (the header row)
    for key, shown in keys.items():
        recorded = lookup(config, key)
        if key == "advantage_estimator" and recorded is None:  # the default, shown as it ran
            continue
        value = shown_path(recorded, run)
        assert shown == "`" + (value if isinstance(value, str) else json.dumps(value)) + "`", key
    return text


# what a card of a critic-free run never says
NO_CRITIC = ["GAE", "critic", "vf_coef", "lambda", "| lam |", "lam:", "value_clip"]


def test_each_estimator_familys_card_says_what_ran_and_no_absolute_path(runs, families):
    """GRPO, RLOO, PPO with a critic, DPO and an environment run (REINFORCE): each card names its estimator,
    group size, critic (only when there was one), where the KL went and the reward as the config named it."""
    grpo = check_card(
        families["grpo"],
        [
            "# grpo: policy aligned with GRPO",
            "RL with `shifu ppo` (GRPO): the policy samples a group of 4 responses to each training prompt, "
            "scored by the reward function ppo_task:frac_a.",
            "minus the mean of its group of 4, divided by the group's standard deviation",
            "| group_size | `4` |",
            "| advantage_estimator | `grpo` |",
            "is a term of the loss, not of the reward",
            "| kl.loss_estimator | `k3` |",
            "score by the reward function ppo_task:frac_a, held-out",
            'from_pretrained("grpo/final"',
        ],
        [*NO_CRITIC, "reward model", "reward-model", "| kl.estimator |", "env"],
    )
    assert read_card_metadata(families["grpo"] / "final" / "README.md")["tags"] == ["shifu", "rlhf", "grpo"]
    assert "base_model: cards0/sft/final" in grpo  # a model outside the run: its run's name
    check_card(
        families["rloo"],
        [
            "RL with `shifu ppo` (RLOO)",
            "minus the mean of the other 3 responses to its prompt",
            "| group_size | `4` |",
            "is subtracted from the reward",
            "| kl.estimator | `k1` |",
        ],
        [*NO_CRITIC, "reward model", "reward-model", "loss_estimator"],
    )
    check_card(
        runs["ppo"],
        [
            "RL with `shifu ppo` (PPO): the policy samples one response to each training prompt, scored by "
            "the reward model rm/final.",
            "GAE (gamma 1.0, lambda 0.95) on a learned critic (critic.init=sft; value loss weight vf_coef 0.1)",
            "the clipped PPO objective (ratio clipped to [1 - 0.2, 1 + 0.2])",
            "| critic.init | `sft` |",
            "| vf_coef | `0.1` |",
            "| lam | `0.95` |",
            "score by the reward model rm/final, held-out",
        ],
        ["| group_size |", "GRPO", "reward function", "reward-model score"],
    )
    check_card(
        runs["dpo"],
        ["# cards0/dpo: policy aligned with DPO", "Direct preference optimisation", "| beta | `0.1` |"],
        ["GAE", "critic", "group_size", "PPO", "reward model"],
    )
    env = check_card(
        families["env"],
        [
            "RL with `shifu ppo` (REINFORCE): the policy plays an episode per training prompt with the "
            "environment thirdparty_env:Echo",
            "the episode's return is its reward",
            "each response's whole-sequence return minus the batch mean",
            "| env.factory | `thirdparty_env:Echo` |",
            "episode return of `thirdparty_env:Echo`, held-out prompts, iteration 0 -> 2",
        ],
        [
            *NO_CRITIC,
            "reward function",
            "reward model",
            "reward-model",
            "| group_size |",
            "clip_",
        ],
    )
    assert read_card_metadata(families["env"] / "final" / "README.md")["tags"] == [
        "shifu",
        "rlhf",
        "reinforce",
        "environment",
    ]
    assert "| generation.max_turns | `3` |" in env and "| generation.max_new_tokens | `6` |" in env


def test_records_name_paths_relative_to_the_run_or_by_the_models_own_name(tmp_path):
    from shifu.reporting.names import shown_config, shown_path

    cache = tmp_path / "cache" / "smollm2-135m-instruct"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": str(cache)}))
    hub = tmp_path / "cache" / "snapshot-1"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    run = tmp_path / "runs" / "quickstart-x" / "ppo"
    (run / "final").mkdir(parents=True)
    other = tmp_path / "runs" / "grpo-1"
    (other / "final").mkdir(parents=True)
    (other / "config.yaml").write_text("seed: 0\n")
    config = {
        "model": {"path": str(cache), "ref_path": str(hub)},
        "data": {"train": str(tmp_path / "data" / "prompts.jsonl"), "eval": "data/held_out.jsonl"},
        "reward": {"model_path": str(run.parent / "rm" / "final"), "function": "mytask.rewards:score"},
        "critic": {"path": str(other / "final")},
        "out_dir": str(run),
        "trackers": ["wandb"],
    }
    assert shown_config(config, run) == {
        "model": {"path": "smollm2-135m-instruct", "ref_path": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "data": {"train": "prompts.jsonl", "eval": "data/held_out.jsonl"},  # relative paths as typed
        "reward": {"model_path": "rm/final", "function": "mytask.rewards:score"},  # inside the quickstart run
        "critic": {"path": "grpo-1/final"},  # another shifu run's model: by its run's name
        "out_dir": "ppo",
        "trackers": ["wandb"],
    }
    assert shown_path("~/x/model.safetensors", run) == "model.safetensors"


def test_a_ppo_card_says_what_made_the_rollouts_as_the_run_recorded_it(tmp_path):
    """The card reads what made the rollouts from the run's summary.json (``source``), not from the settings:
    a run whose config names a reward function but whose recorded source is an agent is described as the
    agent's (and a run that recorded none is described from its config, as before)."""
    from shifu.reporting.modelcard import render_card

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    config = {"model": {"path": "base"}, "iterations": 2, "reward": {"function": "m:f"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    source = {"kind": "agent", "scored_by": "agent's reward", "spec": "pkg.agents:solve", "gold": True}
    (run / "summary.json").write_text(json.dumps({"iterations": 2, "source": source}))
    card = render_card("ppo", run / "final", run)
    assert "through the agent pkg.agents:solve" in card and "the agent's return is its reward" in card
    assert "| agent.factory |" not in card  # (not set in this config: the table shows set keys only)
    assert "- agent" in card and "reward function m:f" not in card
    (run / "summary.json").write_text(json.dumps({"iterations": 2}))
    card = render_card("ppo", run / "final", run)
    assert "scored by the reward function m:f" in card and "- agent" not in card

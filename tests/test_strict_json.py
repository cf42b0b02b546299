"""Every JSON file shifu writes is strict JSON (RFC 8259): a statistic that is undefined is null, never a bare
NaN or Infinity that strict parsers refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_jsonl

from shifu.cli import main as cli
from shifu.runs.jsonfile import dumps, finite_or_null, keep_rows, read_jsonl
from shifu.runs.jsonfile import write_jsonl as write_strict_jsonl

pytestmark = pytest.mark.integration


def strict_load(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_run_dir(run: Path) -> int:
    """Parse every .json and .jsonl file under ``run`` strictly; returns how many were read."""
    n = 0
    for path in sorted(run.rglob("*.json*")):
        if path.suffix == ".json":
            strict_load(path.read_text(encoding="utf-8"))
        elif path.suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    strict_load(line)
        n += 1
    return n


def test_dumps_writes_null_for_what_is_not_a_finite_number():
    assert dumps({"a": float("nan"), "b": [1.0, float("inf")], "c": (float("-inf"), 2)}) == (
        '{"a": null, "b": [1.0, null], "c": [null, 2]}'
    )
    assert finite_or_null({"x": 0.5}) == {"x": 0.5}
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_jsonl_files_are_written_strict_read_back_and_trimmed_line_for_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_strict_jsonl(path, [{"step": 1, "x": float("nan")}, {"step": 2, "x": 0.1 + 0.2}, {"step": 3}])
    text = path.read_text(encoding="utf-8")
    assert text == '{"step": 1, "x": null}\n{"step": 2, "x": 0.30000000000000004}\n{"step": 3}\n'
    assert [strict_load(line) for line in text.splitlines()] == read_jsonl(path)
    # a line another writer spelled its own way (and a blank line) is kept as it was, or dropped whole
    path.write_text(text.replace("null", '"nan"') + "\n", encoding="utf-8")
    keep_rows(path, lambda row: row["step"] != 2)
    assert path.read_text(encoding="utf-8") == '{"step": 1, "x": "nan"}\n{"step": 3}\n'


def test_a_reward_model_whose_pairs_never_have_a_longer_chosen_writes_strict_json(tiny_model_dir, tmp_path):
    """acc_chosen_longer has no pair to average over: null in summary.json (it was a bare NaN)."""
    rows = [{"prompt": f"q{i}:", "chosen": " great", "rejected": " bad bad bad"} for i in range(48)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    run = tmp_path / "rm"
    argv = [
        "rm",
        "--out",
        str(run),
        f"model.path={tiny_model_dir}",
        f"data.train={data}",
        "max_steps=3",
        "batch_size=8",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    summary = strict_load((run / "summary.json").read_text())
    assert "eval/rm/acc_chosen_longer" in summary and summary["eval/rm/acc_chosen_longer"] is None
    assert check_run_dir(run) >= 2


def test_a_ppo_run_with_undefined_scores_writes_strict_json(tmp_path):
    from ppo_task import build_char_model, write_prompts

    model, prompts = build_char_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl")
    run = tmp_path / "ppo"
    argv = [
        "ppo",
        "--out",
        str(run),
        f"model.path={model}",
        f"data.train={prompts}",
        "reward.function=ppo_task:nan_some",
        "critic.init=sft",
        "iterations=2",
        "batch_size=16",
        "minibatch_size=8",
        "generation.max_new_tokens=4",
        "eval.every=1",
        "eval.num_prompts=16",
        "save_every=1",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    assert check_run_dir(run) >= 4  # summary.json, samples.jsonl, metrics.jsonl, a checkpoint's files

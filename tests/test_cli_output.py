"""What a command prints: shifu's own lines only (third-party bars and warnings need --verbose), DeepSpeed
left unimported by a run that does not use it, and --help-config naming the values each key accepts."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_sft import make_cfg as sft_cfg

from shifu.cli import main as cli
from shifu.config.loader import describe, load_config
from shifu.errors import ConfigError
from shifu.runs import tracking

ROOT = Path(__file__).resolve().parents[1]
# `shifu ...` in a fresh process (the console script is `shifu.cli.main:main`), reporting afterwards whether
# DeepSpeed was imported
RUN = "import sys; from shifu.cli.main import main; rc = main(sys.argv[1:]); print('deepspeed imported:', 'deepspeed' in sys.modules); sys.exit(rc)"
NOISE = ("Setting accelerator to", "Loading weights", "Writing model shards", "it/s]", "Warning")


def shifu_sft(tmp_path: Path, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    data = sft_cfg(model_dir, tmp_path).data
    out = tmp_path / "run"
    argv = [
        "sft",
        "--out",
        str(out),
        "--overwrite",
        f"model.path={model_dir}",
        f"data.train={data.train}",
        f"data.eval={data.eval}",
        "max_steps=2",
        "batch_size=4",
        "progress=false",
        "tensorboard=false",
        "--threads",
        "1",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "HF_", "SHIFU_VERBOSE"))}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", RUN, *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.integration
def test_a_run_prints_only_its_own_lines_and_never_imports_deepspeed(tiny_model_dir, tmp_path):
    r = shifu_sft(tmp_path, tiny_model_dir)
    assert "deepspeed imported: False" in r.stdout
    for noise in NOISE:
        assert noise not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    # one line: the closing line, saying where the outputs are
    assert len(lines) == 1 and lines[0].startswith("shifu sft: 2 steps"), r.stderr
    assert lines[0].endswith(f"model in {tmp_path / 'run' / 'final'}")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: nothing would import it anyway (the output was checked)")


@pytest.mark.integration
def test_verbose_shows_the_libraries_output(tiny_model_dir, tmp_path):
    r = shifu_sft(tmp_path, tiny_model_dir, "--verbose")
    # transformers' own bars, while shifu's bar stays off (progress=false)
    assert "Loading weights" in r.stderr and "Writing model shards" in r.stderr
    assert "sft:" not in r.stderr.replace("shifu sft:", "")
    assert r.stderr.rstrip().splitlines()[-1].startswith("shifu sft: 2 steps")
    # --verbose does not bring DeepSpeed in: it is imported only when a run uses it
    assert "deepspeed imported: False" in r.stdout


@pytest.mark.unit
def test_verbose_flag_is_taken_anywhere_and_nothing_else_is():
    from shifu.cli.quiet import verbose_requested

    assert verbose_requested(["sft", "a=1", "--verbose", "--out", "x"]) == (
        True,
        ["sft", "a=1", "--out", "x"],
    )
    assert verbose_requested(["--verbose", "report", "r"]) == (True, ["report", "r"])
    assert verbose_requested(["sample", "--", "--verbose"]) == (False, ["sample", "--", "--verbose"])
    assert not verbose_requested(["sft", "--verbose=1"])[0]
    assert cli.parse_trainer_args("ppo", ["--verbose", "x=1"]).verbose  # declared, so --help lists it


@pytest.mark.unit
@pytest.mark.parametrize("cmd", sorted(cli.TRAINERS))
def test_help_config_lists_the_values_the_errors_accept(cmd, capsys):
    assert cli.main([cmd, "--help-config"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    config = importlib.import_module(cli.TRAINERS[cmd][0]).Config
    checked = 0
    for key, _, help_ in describe(config):
        assert key in lines
        if "one of " not in help_:
            continue
        listed = help_.rsplit("one of ", 1)[1].rstrip(")")
        assert listed in lines[key]  # printed by --help-config
        # the error for a value outside the set names the same values
        bad = "[not_a_choice]" if key == "trackers" else "not_a_choice"
        with pytest.raises(ConfigError) as e:
            load_config(config, None, ["out_dir=o", "model.path=m", "data.train=t", f"{key}={bad}"])
        for value in listed.split(", "):
            assert value.strip("'") in str(e.value), (key, value, str(e.value))
        checked += 1
    # every key with a fixed set of values says so
    literal = {
        "distributed.strategy",
        "distributed.frozen",
        "optim.schedule",
        "data.prompt_policy",
        "trackers",
    }
    assert literal <= {k for k, _, h in describe(config) if "one of " in h}
    assert checked >= len(literal)


@pytest.mark.unit
def test_help_config_names_every_tracker():
    (_, _, help_) = next(row for row in describe(cli_config("sft")) if row[0] == "trackers")
    assert help_.endswith("(each one of " + ", ".join(map(repr, tracking.TRACKERS)) + ")")


def cli_config(cmd: str):
    return importlib.import_module(cli.TRAINERS[cmd][0]).Config

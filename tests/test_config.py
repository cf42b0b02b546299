"""Config machinery: presets parse, unknown keys and bad values are rejected by name, nested defaults kept."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from shifu.config import from_dict, load_config, read_yaml
from shifu.errors import ConfigError
from shifu.trainers import ppo

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"sft": "shifu.trainers.sft", "rm": "shifu.trainers.reward", "ppo": "shifu.trainers.ppo"}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_shipped_presets_parse(name):
    cfg_cls = importlib.import_module(MODULES[name]).Config
    from_dict(cfg_cls, read_yaml(ROOT / "configs" / f"{name}.yaml"))


def test_partial_section_keeps_the_fields_own_defaults():
    cfg = load_config(
        ppo.Config,
        None,
        [
            "out_dir=x",
            "actor_path=a",
            "data.prompts=p",
            "reward.function=m:f",
            "critic.init=sft",
            "critic.optim.eps=1e-6",
        ],
    )
    assert cfg.critic.optim.lr == 1e-4  # the critic's default, not OptimConfig's
    assert cfg.critic.optim.eps == 1e-6 and cfg.optim.lr == 1e-5


def test_exponent_without_dot_is_a_number():
    cfg = load_config(
        ppo.Config,
        None,
        [
            "out_dir=x",
            "actor_path=a",
            "data.prompts=p",
            "reward.function=m:f",
            "critic.init=sft",
            "optim.lr=3e-3",
        ],
    )
    assert cfg.optim.lr == 3e-3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'"),
        ("ppo_epochs=two", "'ppo_epochs': expected an integer"),
        ("kl.controller=pid", "'kl.controller': 'pid' is not one of"),
        ("minibatch_size=7", "multiple of minibatch_size"),
        ("dual_clip=0.5", "dual_clip must be > 1"),
    ],
)
def test_bad_values_are_named(override, needle):
    base = ["out_dir=x", "actor_path=a", "data.prompts=p", "reward.function=m:f", "critic.init=sft"]
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(ppo.Config, None, base + [override])


def test_cli_reports_config_errors_with_exit_2(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "shifu", "ppo", "--out", str(out), "kl.target=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error:" in r.stderr and not out.exists()

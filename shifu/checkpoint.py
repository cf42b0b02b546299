"""The only module that writes checkpoints. Atomic, complete, and safe to load.

Layout of a run directory::

    RUN/checkpoints/step-00000010/
        model-<name>.safetensors     weights of each trained (or stateful) module
        state.pt                     optimiser / scheduler state dicts (loaded with weights_only=True)
        state.json                   counters, KL controller, score normaliser, RNG states, data position, config
    RUN/checkpoints/latest           name of the newest complete checkpoint, written last

A checkpoint is written into ``.tmp-step-…``, every file fsynced, then renamed into place; only then is
``latest`` replaced (atomically) and old checkpoints beyond ``keep_last`` deleted. A crash at any moment
leaves the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from shifu.errors import OutputDirError, ShifuError

CKPT_DIR = "checkpoints"
RUN_MARKER = ".shifu-run"  # written into every run directory; --overwrite deletes only such directories
# what a failed write raises: the OS, torch.save's zip writer, the safetensors writer
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def looks_like_run(d: Path) -> bool:
    """A directory shifu wrote: it has the run marker (or, from older runs, metrics or a checkpoint pointer)."""
    return any((d / m).exists() for m in (RUN_MARKER, "metrics.jsonl", f"{CKPT_DIR}/latest"))


def _why(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e)


def prepare_run_dir(run_dir: str | Path, resume: bool = False, overwrite: bool = False) -> Path:
    """Create (or reuse) a run directory; refuse to clobber anything by accident.

    A fresh run into a non-empty directory is refused unless ``resume`` (continue the run there) or
    ``overwrite`` (delete it first). Both refuse a non-empty directory that does not look like a shifu run
    (no ``.shifu-run`` marker, ``metrics.jsonl`` or checkpoint pointer), so a typo in ``--out`` never wipes
    or litters a user's files. The directory is probed for writability; errors name the path.
    """
    d = Path(run_dir)
    if d.exists() and not d.is_dir():
        raise OutputDirError(f"output path '{d}' exists and is not a directory; choose another --out")
    if d.exists() and any(d.iterdir()):
        if not (resume or overwrite):
            raise OutputDirError(
                f"output directory '{d}' is not empty. Pass --resume to continue the run there, "
                "--overwrite to replace it, or choose another --out"
            )
        if not looks_like_run(d):
            raise OutputDirError(
                f"refusing to {'--resume in' if resume else '--overwrite'} '{d}': it is not empty and does "
                f"not look like a shifu run directory (no {RUN_MARKER}); choose another --out"
            )
        if not resume:
            shutil.rmtree(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".write-test"
        probe.write_text("ok")
        probe.unlink()
        (d / RUN_MARKER).write_text("a shifu run directory (safe for shifu --overwrite to delete)\n")
    except OSError as e:
        raise OutputDirError(f"cannot write to output directory '{d}': {_why(e)}") from None
    return d


def rng_state() -> dict[str, Any]:
    """Every RNG state as JSON-able data (python, numpy, torch CPU and CUDA)."""
    st: dict[str, Any] = {
        "python": _py_state_to_json(random.getstate()),
        "numpy": _np_state_to_json(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(_py_state_from_json(st["python"]))
    np.random.set_state(_np_state_from_json(st["numpy"]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])


def generator_state(g: torch.Generator) -> list[int]:
    return g.get_state().tolist()


def set_generator_state(g: torch.Generator, state: list[int]) -> None:
    g.set_state(torch.tensor(state, dtype=torch.uint8))


def _py_state_to_json(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def _py_state_from_json(s: list) -> tuple:
    return (s[0], tuple(s[1]), s[2])


def _np_state_to_json(s: tuple) -> list:
    return [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]


def _np_state_from_json(s: list) -> tuple:
    return (s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    modules: dict[str, torch.nn.Module],
    tensor_state: dict[str, Any],
    json_state: dict[str, Any],
    keep_last: int = 2,
    shards: str | Path | None = None,
) -> Path:
    """Write a complete checkpoint atomically; returns its directory.

    ``modules``: name -> module whose ``state_dict`` is saved as safetensors (shared tensors handled).
    ``tensor_state``: optimiser/scheduler state dicts (torch.save; reloaded with ``weights_only=True``).
    ``json_state``: everything else, JSON-serialisable (counters, controllers, RNG, data position, config).
    ``shards``: sharded training (FSDP2 / DeepSpeed), rank 0 only: a directory every rank already wrote its
    shards into (``shifu.distributed.save_sharded``) before a barrier. It is moved in as ``sharded/``, so the
    shards, the weights and the state appear together when the directory is renamed and ``latest`` updated.
    """
    root = Path(run_dir) / CKPT_DIR
    name = f"step-{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if shards is not None and not Path(shards).is_dir():
        raise ShifuError(f"sharded checkpoint of step {step}: no shards were written to '{shards}'")
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # left by a crash in an earlier write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        if shards is not None:
            os.replace(shards, tmp / "sharded")
        for mname, module in modules.items():
            save_model(module, str(tmp / f"model-{mname}.safetensors"))
        torch.save(tensor_state, tmp / "state.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **json_state}), encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name, encoding="utf-8")
        with open(pointer_tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(pointer_tmp, root / "latest")
        _fsync_dir(root)
    except WRITE_ERRORS as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShifuError(
            f"could not write checkpoint '{final}': {_why(e)}. "
            "Check free disk space and permissions; the previous checkpoint is intact"
        ) from None
    # Only now that `latest` points at the new one: drop the oldest beyond keep_last.
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[: max(0, len(done) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / CKPT_DIR
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text(encoding="utf-8").strip()
    return path if (path / "state.json").exists() else None


def load_checkpoint(
    path: str | Path, modules: dict[str, torch.nn.Module]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights into ``modules`` in place; return ``(tensor_state, json_state)``."""
    p = Path(path)
    for mname, module in modules.items():
        f = p / f"model-{mname}.safetensors"
        if not f.exists():
            raise ShifuError(f"checkpoint '{p}' has no weights for '{mname}' ({f.name} missing)")
        missing, unexpected = load_model(module, str(f), strict=False)
        if missing or unexpected:
            raise ShifuError(
                f"checkpoint '{f}' does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
    tensor_state = torch.load(p / "state.pt", weights_only=True, map_location="cpu")
    json_state = json.loads((p / "state.json").read_text(encoding="utf-8"))
    return tensor_state, json_state


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_diff(a, b, prefix + k + "."))
        elif a != b:
            out.append(prefix + k)
    return out


def _atomic_dir(path: str | Path, write) -> Path:
    """Write a directory through ``write(tmp_dir)``, then swap it into place (the old one stays until then)."""
    final = Path(path)
    tmp = final.with_name(f".tmp-{final.name}")
    old = final.with_name(f".old-{final.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except WRITE_ERRORS as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShifuError(
            f"could not write '{final}': {_why(e)}. Check free disk space and permissions"
        ) from None
    return final


def save_hf_dir(model, tokenizer, path: str | Path) -> Path:
    """An HF directory (safetensors weights, config, tokenizer) that ``from_pretrained`` loads; atomic."""

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return _atomic_dir(path, write)


def save_scalar_dir(model, path: str | Path) -> Path:
    """A shifu ScalarModel directory (reward model / critic); atomic."""
    return _atomic_dir(path, lambda tmp: model.save_pretrained(tmp))


def save_checkpoint_with_shards(
    run_dir: str | Path,
    step: int,
    modules: dict[str, torch.nn.Module],
    tensor_state: dict[str, Any],
    json_state: dict[str, Any],
    keep_last: int = 2,
    shards: str | Path | None = None,
) -> Path:
    """:func:`save_checkpoint` for sharded training: ``shards`` is required."""
    if shards is None:
        raise ShifuError(f"sharded checkpoint of step {step}: no shards directory given")
    return save_checkpoint(run_dir, step, modules, tensor_state, json_state, keep_last, shards=shards)

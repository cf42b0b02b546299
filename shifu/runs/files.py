"""Durable files of a run: fsynced writes, model directories (``final/``, ``best/``, ``critic/``) swapped into
place atomically, complete safetensors files, and which model directory a path names (a run directory means
its ``final/``). Training checkpoints (:mod:`shifu.runs.checkpoint`) are built on these."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors import SafetensorError

from shifu.errors import ShifuError

# what a failed write raises: the OS, torch.save's zip writer, the safetensors writer
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def failure_reason(e: BaseException) -> str:
    """What went wrong in a failed write, in a few words (the OS's reason where it gives one)."""
    return getattr(e, "strerror", None) or str(e)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Make every file under ``path``, and ``path`` itself, durable."""
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader finds one or the other
    under each name, never neither. False where the system or file system cannot (then nothing happened)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def atomic_dir(path: str | Path, write) -> Path:
    """Write a directory through ``write(tmp_dir)``, then swap it into place. A reader (``shifu sample``,
    ``from_pretrained``, another process) always finds a complete directory under ``path``: the old one until
    the swap, the new one after it (one ``RENAME_EXCHANGE``; where the system has none, two renames leave a
    moment with no directory, and ``.old-NAME`` holds the previous one during it)."""
    final = Path(path)
    tmp = final.with_name(f".tmp-{final.name}")
    old = final.with_name(f".old-{final.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        fsync_tree(tmp)
        if final.exists() and exchange_dirs(tmp, final):  # tmp now holds the old directory
            fsync_dir(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except WRITE_ERRORS as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShifuError(
            f"could not write '{final}': {failure_reason(e)}. Check free disk space and permissions"
        ) from None
    return final


def save_hf_dir(model, tokenizer, path: str | Path) -> Path:
    """An HF directory (safetensors weights, config, tokenizer) that ``from_pretrained`` loads; atomic."""

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return atomic_dir(path, write)


def save_scalar_dir(model, path: str | Path) -> Path:
    """A shifu ScalarModel directory (reward model / critic); atomic."""
    return atomic_dir(path, lambda tmp: model.save_pretrained(tmp))


def check_safetensors(path: str | Path, hint: str = "") -> None:
    """ShifuError naming ``path`` unless it is a complete safetensors file: an 8-byte header length, a JSON
    header, then exactly the tensor bytes the header's ``data_offsets`` cover (a truncated copy or an
    interrupted download fails here, by name, instead of deep inside the loader)."""
    p = Path(path)
    hint = hint or f"the directory '{p.parent}' is damaged (an interrupted copy?): copy or save it again"
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
    except OSError as e:
        raise ShifuError(f"cannot read '{p}': {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ShifuError(f"'{p}' is not a safetensors file ({size} bytes, no readable header); {hint}")
    try:
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"], default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ShifuError(f"'{p}' has a damaged safetensors header; {hint}") from None
    expected = 8 + n + end
    if size < expected:
        raise ShifuError(
            f"'{p}' is truncated: it holds {size} of the {expected} bytes its header declares; {hint}"
        )
    if size > expected:
        raise ShifuError(f"'{p}' has {size - expected} bytes after its last tensor (a damaged file); {hint}")


POLICY_STAGES = ("soup", "ppo", "dpo", "sft")  # a quickstart run's policies, the last stage first
REWARD_MARKERS = ("shifu_scalar.json", "ensemble.json")  # written by `shifu rm` into final/


def resolve_policy(path: str | Path, reward_as: str = "--reward-model", policy_as: str = "MODEL") -> Path:
    """The HF policy directory that ``path`` names: itself, its ``final/``, or a quickstart run's last
    policy. A reward model, or a directory with no model, is a :class:`ShifuError` that says what to pass
    (``reward_as``: where a reward model goes instead, ``policy_as``: where the policy goes)."""
    p = Path(path)
    if not p.is_dir():
        raise ShifuError(f"{p} is not a directory: pass a run directory with final/ or a local HF model dir")
    candidates = [p, p / "final", *(p / s / "final" for s in POLICY_STAGES)]
    for c in candidates:
        if any((c / m).exists() for m in REWARD_MARKERS):
            raise ShifuError(
                f"{c} is a reward model (shifu rm), not a policy: pass it as {reward_as}, and give a "
                f"policy (an sft/ppo/dpo run directory or an HF causal-LM directory) as {policy_as}"
            )
        if (c / "config.json").is_file():
            return c
    raise ShifuError(
        f"{p} holds no model: expected config.json in it, in {p / 'final'} (a trainer's run directory), "
        f"or in {p}/{{{','.join(POLICY_STAGES)}}}/final (a quickstart run)"
    )

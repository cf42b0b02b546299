"""The only module that writes checkpoints. Atomic, complete, and safe to load.

Layout of a run directory::

    RUN/checkpoints/step-00000010/
        model-<name>.safetensors     weights of each trained (or stateful) module; of a module with frozen
                                     parameters (LoRA) only its trained parameters and buffers
        state.pt                     optimiser / scheduler state dicts (loaded with weights_only=True)
        state.json                   counters, KL controller, score normaliser, RNG states, data position, config
    RUN/checkpoints/latest           name of the newest complete checkpoint, written last

A checkpoint is written into ``.tmp-step-…``, every file fsynced, then renamed into place; only then is
``latest`` replaced (atomically) and old checkpoints beyond ``keep_last`` deleted. A crash at any moment
leaves the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import pickle
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_file, save_model

from shifu.errors import OutputDirError, ShifuError
from shifu.runs.files import WRITE_ERRORS, check_safetensors
from shifu.runs.files import failure_reason as _why
from shifu.runs.files import fsync_dir as _fsync_dir
from shifu.runs.files import fsync_tree as _fsync_tree

CKPT_DIR = "checkpoints"
MANIFEST = "manifest.json"  # in every checkpoint, written last: {relative path: size} of its files
PREV_DIR = ".prev"  # checkpoints/.prev/step-N: step-N's files (hard links) while step-N is being replaced
SHARDED_DIR = "sharded"  # in a checkpoint of sharded training: every rank's shards, in the backend's format
RUN_MARKER = ".shifu-run"  # written into every run directory; --overwrite deletes only such directories
STAGE_MARKER = ".shifu-stage"  # a pipeline's stage directory (pipelines.run_dirs), not run content
PIPELINE_MARKER = ".shifu-pipeline"  # the run directory of a pipeline (shifu quickstart / study)


def looks_like_run(d: Path) -> bool:
    """A directory shifu wrote: it has the run marker (or, from older runs, metrics or a checkpoint pointer)."""
    return any((d / m).exists() for m in (RUN_MARKER, "metrics.jsonl", f"{CKPT_DIR}/latest"))


def prepare_run_dir(run_dir: str | Path, resume: bool = False, overwrite: bool = False) -> Path:
    """Create (or reuse) a run directory; refuse to clobber anything by accident.

    A fresh run into a non-empty directory is refused unless ``resume`` (continue the run there) or
    ``overwrite`` (delete it first). Both refuse a non-empty directory that does not look like a shifu run
    (no ``.shifu-run`` marker, ``metrics.jsonl`` or checkpoint pointer), so a typo in ``--out`` never wipes
    or litters a user's files, and a directory whose run is still alive (:func:`lock_run_dir`). The
    directory is probed for writability; errors name the path.
    """
    d = Path(run_dir)
    if d.exists() and not d.is_dir():
        raise OutputDirError(f"output path '{d}' exists and is not a directory; choose another --out")
    refuse_in_live_pipeline(d)  # a stage of a running pipeline is not restarted (or resumed) under it
    if (d / LOCK_FILE).exists():
        lock_run_dir(d)  # a live run's directory is refused before anything in it is judged or deleted
    if d.exists() and any(p.name not in (LOCK_FILE, STAGE_MARKER) for p in d.iterdir()):
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
            for p in d.iterdir():  # (the lock, held by this process, stays; so does a stage marker)
                if p.name not in (LOCK_FILE, STAGE_MARKER):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".write-test"
        probe.write_text("ok")
        probe.unlink()
        lock_run_dir(d)
        (d / RUN_MARKER).write_text("a shifu run directory (safe for shifu --overwrite to delete)\n")
    except OSError as e:
        raise OutputDirError(f"cannot write to output directory '{d}': {_why(e)}") from None
    return d


LOCK_FILE = ".shifu-lock"  # held (flock) by the process running in the directory; its pid and command inside
# run directory -> (the descriptor of its lock, the pid that took it); a forked child shares its parent's
_held: dict[str, tuple[int, int]] = {}


def lock_run_dir(d: Path) -> None:
    """Hold ``d/.shifu-lock`` for the rest of this process (an exclusive ``flock``), or refuse: another live
    process holds it. The kernel drops the lock of a process that dies in any way (SIGKILL, power off...),
    so the lock of a killed run is free again: it is taken over, and a line says so."""
    key = str(d.resolve())
    if key in _held:
        try:
            same = os.fstat(_held[key][0]).st_ino == (d / LOCK_FILE).stat().st_ino
        except OSError:
            same = False
        if same:
            return
        fd, pid = _held.pop(key)  # the directory was deleted and made again since: lock the new one
        if pid == os.getpid():
            os.close(fd)
    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _lock_owner(fd)
        for _ in range(40):  # taken this very moment: its owner writes who it is right after
            if holder:
                break
            time.sleep(0.05)
            holder = _lock_owner(fd)
        os.close(fd)
        pid = holder.get("pid", "?")
        raise OutputDirError(
            f"output directory '{d}' is in use by a running shifu process ({_who(holder)}). Wait for it to "
            f"end, stop it (kill -TERM {pid} checkpoints and exits), or choose another --out"
        ) from None
    before = _lock_owner(fd)
    if before.get("pid") not in (None, os.getpid()):
        print(
            f"shifu: '{d}' was locked by pid {before['pid']} ({before.get('command', '?')}), which is no longer "
            "running; taking its lock over",
            file=sys.stderr,
        )
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["shifu", *sys.argv[1:]])[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    if not _held:
        atexit.register(release_run_dirs)
    _held[key] = (fd, os.getpid())


def refuse_in_live_pipeline(d: Path) -> None:
    """OutputDirError when ``d`` lies inside the run directory of a pipeline (``shifu quickstart``, ``shifu
    study``: :data:`PIPELINE_MARKER`) whose lock another live process holds: that pipeline may be training,
    restarting or reading the very stage ``d`` is. This process's own pipeline is no obstacle."""
    for parent in Path(os.path.abspath(d)).parents:
        lock = parent / LOCK_FILE
        if not (parent / PIPELINE_MARKER).exists() or not lock.exists() or str(parent.resolve()) in _held:
            continue
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: no pipeline runs there (closing unlocks)
        except OSError:
            holder = _lock_owner(fd)
            raise OutputDirError(
                f"output directory '{d}' is inside '{parent}', the run directory of a running shifu pipeline "
                f"({_who(holder)}). Wait for it to end, stop it (kill -TERM {holder.get('pid', '?')}), or "
                "choose an --out outside it"
            ) from None
        finally:
            os.close(fd)


def release_run_dirs() -> None:
    """Let go of every run directory this process locked, its lock file emptied (a run that ended, unlike
    a killed one, leaves no owner behind). The command line calls it when a run ends; so does exit."""
    for key, (fd, pid) in list(_held.items()):
        if pid == os.getpid():
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)
            del _held[key]


def _who(holder: dict[str, Any]) -> str:
    """A lock owner (:func:`_lock_owner`) in words: pid, host, start time and command."""
    return (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}: "
        f"{holder.get('command', '?')}"
    )


def _lock_owner(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def trained_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """What a checkpoint holds of a module with frozen parameters (a LoRA actor or critic): its trainable
    parameters and persistent buffers, by ``state_dict`` name (copies, fit for ``save_file``); the frozen
    base is loaded from its own directory again on resume. None when every parameter trains: all of it."""
    params = dict(module.named_parameters(remove_duplicate=False))
    if all(p.requires_grad for p in params.values()):
        return None
    return {
        name: t.detach().clone().contiguous()
        for name, t in module.state_dict(keep_vars=True).items()
        if name not in params or params[name].requires_grad
    }


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
    ``shards``: sharded training (FSDP2 / DeepSpeed), rank 0 only: the :func:`shards_staging_dir` every rank
    already wrote its shards into (in its backend's format, which this module never reads) before a barrier.
    It is moved in as ``sharded/``, so the shards, the weights and the state appear together when the
    directory is renamed and ``latest`` updated.

    Writing a step that already exists (PPO's closing save after a scheduled one, a resumed finished run)
    replaces it without a moment where ``latest`` names a missing directory (see :func:`_replace`).
    """
    root = Path(run_dir) / CKPT_DIR
    name = f"step-{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if shards is not None and not Path(shards).is_dir():
        raise ShifuError(f"sharded checkpoint of step {step}: no shards were written to '{shards}'")
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(root, keep=Path(shards) if shards is not None else None)
        tmp.mkdir()
        if shards is not None:
            os.replace(shards, tmp / SHARDED_DIR)
        for mname, module in modules.items():
            trained = trained_state_dict(module)
            if trained is None:
                save_model(module, str(tmp / f"model-{mname}.safetensors"))
            else:  # frozen parameters (LoRA): only what trains; the base comes from its directory again
                save_file(
                    trained, str(tmp / f"model-{mname}.safetensors"), metadata={"shifu": "trained-only"}
                )
        torch.save(tensor_state, tmp / "state.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **json_state}), encoding="utf-8")
        _write_manifest(tmp)  # last: a directory with a manifest that matches its files is complete
        _fsync_tree(tmp)
        if final.exists():
            _replace(root, final, tmp)
        else:
            os.replace(tmp, final)
            _fsync_dir(root)
            _point(root, name)
            shutil.rmtree(root / PREV_DIR, ignore_errors=True)  # a crash's copy, no longer named
    except WRITE_ERRORS as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShifuError(
            f"could not write checkpoint '{final}': {_why(e)}. "
            "Check free disk space and permissions; the previous checkpoint is intact"
        ) from None
    # Only now that `latest` points at the new one: drop the oldest beyond keep_last.
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[: max(0, len(done) - keep_last)]:
        _remove(old)
    return final


def shards_staging_dir(run_dir: str | Path, step: int) -> Path:
    """Where every rank writes its shards of step ``step`` before rank 0 calls :func:`save_checkpoint` with
    it (a crash's leftover is removed by the next checkpoint)."""
    return Path(run_dir) / CKPT_DIR / f".shards-step-{step:08d}"


def _point(root: Path, name: str) -> None:
    """Make ``root/latest`` name ``name`` (relative to ``root``): a fsynced file renamed over the old one."""
    pointer_tmp = root / ".latest.tmp"
    pointer_tmp.write_text(name, encoding="utf-8")
    with open(pointer_tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)


def _replace(root: Path, final: Path, tmp: Path) -> None:
    """Swap the complete ``tmp`` in for the existing ``final`` so that ``latest`` always names a complete
    checkpoint: a hard-linked copy of ``final`` (``.prev/step-N``, no data copied) becomes ``latest`` while
    ``final`` is renamed away and ``tmp`` renamed into its place; then ``latest`` names ``final`` again.
    A crash at any point leaves ``latest`` naming the old or the new step-N, complete."""
    prev = root / PREV_DIR / final.name
    if _pointer(root) == f"{PREV_DIR}/{final.name}":  # left by a crash here: final is complete, name it first
        _point(root, final.name)
    shutil.rmtree(prev, ignore_errors=True)
    _link_tree(final, prev)
    _fsync_tree(prev)
    _fsync_dir(prev.parent)
    _point(root, f"{PREV_DIR}/{final.name}")
    trash = root / f".trash-{final.name}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(root)
    _point(root, final.name)
    shutil.rmtree(trash, ignore_errors=True)
    shutil.rmtree(root / PREV_DIR, ignore_errors=True)


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` with the same files as ``src``, hard-linked (copied where the filesystem has no links)."""
    for p in sorted(src.rglob("*")):
        target = dst / p.relative_to(src)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)
        except OSError:
            shutil.copy2(p, target)
    dst.mkdir(parents=True, exist_ok=True)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted ``step-*``: renamed away first."""
    trash = path.with_name(f".trash-{path.name}")
    try:
        os.replace(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _clear_leftovers(root: Path, keep: Path | None) -> None:
    """Remove what a crash in an earlier write left: torn ``.tmp-*`` writes, ``.trash-*`` deletions, shard
    directories of other steps, and a ``.prev`` copy that ``latest`` no longer names."""
    pointed = _pointer(root)
    for p in root.iterdir():
        if p.name.startswith((".tmp-step-", ".trash-")) or (
            p.name.startswith(".shards-step-") and (keep is None or p.resolve() != keep.resolve())
        ):
            shutil.rmtree(p, ignore_errors=True)
    if pointed is not None and not pointed.startswith(PREV_DIR + "/"):
        shutil.rmtree(root / PREV_DIR, ignore_errors=True)


def _write_manifest(d: Path) -> None:
    files = {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}
    (d / MANIFEST).write_text(json.dumps(files, indent=0), encoding="utf-8")


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is: every file its manifest lists, at its
    size (older checkpoints without a manifest: state.json, state.pt and intact weight files)."""
    if not path.is_dir():
        return "it does not exist"
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        manifest = None
    except (OSError, ValueError):
        return f"its {MANIFEST} is damaged"
    if isinstance(manifest, dict):
        for rel, size in manifest.items():
            f = path / rel
            if not f.is_file():
                return f"{rel} is missing"
            if f.stat().st_size != size:
                return f"{rel} has {f.stat().st_size} bytes, not {size}"
        return None
    for rel in ("state.json", "state.pt"):
        if not (path / rel).is_file():
            return f"{rel} is missing"
    for f in path.glob("*.safetensors"):
        try:
            check_safetensors(f)
        except ShifuError:
            return f"{f.name} is damaged"
    return None


def _pointer(root: Path) -> str | None:
    try:
        return (root / "latest").read_text(encoding="utf-8").strip() or None
    except (FileNotFoundError, UnicodeDecodeError, IsADirectoryError):
        return None


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names; None when the run has none yet.

    Should ``latest`` be missing or name a missing or incomplete directory (a directory damaged by hand),
    the newest complete ``step-*`` is used instead, and a line on stderr says so; a run with checkpoints of
    which none is complete is an error (its progress cannot be continued, only replaced)."""
    root = Path(run_dir) / CKPT_DIR
    named = _pointer(root)
    if named is not None and checkpoint_problem(root / named) is None:
        return root / named
    candidates = sorted((p for p in root.glob("step-*") if p.is_dir()), key=_step_of, reverse=True)
    if (root / PREV_DIR).is_dir():
        candidates += sorted((root / PREV_DIR).glob("step-*"), key=_step_of, reverse=True)
    if named is None and not candidates:
        return None
    why = "is missing" if named is None else f"names '{named}', but {checkpoint_problem(root / named)}"
    for path in candidates:
        if checkpoint_problem(path) is None:
            if os.environ.get("RANK", "0") == "0":
                print(
                    f"shifu: {root / 'latest'} {why}; using {path}, the newest complete checkpoint",
                    file=sys.stderr,
                )
            return path
    raise ShifuError(
        f"{root / 'latest'} {why}, and no other checkpoint in '{root}' is complete: the run cannot be "
        "continued. Start it again with --overwrite (or restore the checkpoints from a backup)"
    )


def read_state(path: str | Path) -> dict[str, Any]:
    """The JSON state of a checkpoint (step, config, counters), without loading any tensor."""
    return json.loads((Path(path) / "state.json").read_text(encoding="utf-8"))


def load_checkpoint(
    path: str | Path, modules: dict[str, torch.nn.Module]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights into ``modules`` in place; return ``(tensor_state, json_state)``."""
    p = Path(path)
    hint = f"the checkpoint '{p}' is damaged; delete it to resume from an older one, or start again with --overwrite"
    for mname, module in modules.items():
        f = p / f"model-{mname}.safetensors"
        if not f.exists():
            raise ShifuError(f"checkpoint '{p}' has no weights for '{mname}' ({f.name} missing)")
        check_safetensors(f, hint)
        missing, unexpected = load_model(module, str(f), strict=False)
        frozen = {n for n, q in module.named_parameters(remove_duplicate=False) if not q.requires_grad}
        missing = [k for k in missing if k not in frozen]  # (saved without its frozen base: LoRA)
        if missing or unexpected:
            raise ShifuError(
                f"checkpoint '{f}' does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
    try:
        tensor_state = torch.load(p / "state.pt", weights_only=True, map_location="cpu")
        json_state = json.loads((p / "state.json").read_text(encoding="utf-8"))
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise ShifuError(f"cannot read the state of checkpoint '{p}': {_why(e)}; {hint}") from None
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

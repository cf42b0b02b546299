"""What a pipeline (``shifu quickstart``, ``shifu study``) may touch in its run directory: nothing shifu did
not write is deleted or overwritten.

The run directory carries ``.shifu-pipeline`` (written when a pipeline takes a missing or empty directory;
JSON: the command, and the digest of each file it wrote at the top, e.g. ``summary.json``): a non-empty
directory without it is refused, as is a top-level file the pipeline did not write or that was changed since.
Each stage directory carries ``.shifu-stage`` (written when the stage makes it): a stage directory without it
(or without a ``DONE`` / ``.shifu-run`` of an older shifu) that is not empty is refused, and a stage that runs
again refuses to start while its directory holds anything its stage does not write (:data:`STAGE_FILES`),
naming it; starting again deletes only what the stage writes. One pipeline per directory: :func:`claim_run`
holds the run directory's lock (``.shifu-lock``, :func:`shifu.runs.checkpoint.lock_run_dir`) for the whole
run, so a second pipeline on a live directory is refused, naming the live process, before it changes anything;
a killed pipeline's lock is taken over. A trainer pointed into a live pipeline's directory (``shifu sft --out
RUN/sft --overwrite``) is refused too (:func:`shifu.runs.checkpoint.refuse_in_live_pipeline`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from shifu.errors import ShifuError

# What shifu's stages write in a stage directory (trainers' run files, task files, preference pairs, a
# merge, study results): a stage that starts again deletes these, and refuses while anything else is there
STAGE_FILES = tuple(
    """
    .shifu-stage .shifu-run .shifu-lock .write-test .trackers.json .trackers.json.tmp DONE RESULT.json
    config.yaml metrics.jsonl summary.json samples.jsonl trained.jsonl checkpoints tb wandb mlruns member-* final best episodes
    critic .tmp-final .tmp-best .tmp-critic .old-final .old-best .old-critic
    sft_*.jsonl prompts_*.jsonl tokenizer base pairs.jsonl pairs_train.jsonl pairs_eval.jsonl
    sft_samples.jsonl
    """.split()
)


def _listing(names: list[str], at: Path) -> str:
    shown = [n + ("/" if (at / n).is_dir() else "") for n in names[:5]]
    return ", ".join(shown) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def claim_stage(stage_dir: Path, name: str) -> None:
    """Make ``stage_dir`` stage ``name``'s directory (created, or a missing or empty one adopted, with the
    ``.shifu-stage`` marker), or refuse, changing nothing: a non-empty directory shifu did not make (no
    marker, no ``DONE`` or ``.shifu-run`` of an older shifu), or one holding anything but what the stage
    writes (:data:`STAGE_FILES`): a user's file is never deleted when the stage starts again."""
    from shifu.runs.checkpoint import LOCK_FILE, RUN_MARKER, STAGE_MARKER

    if stage_dir.exists() and not stage_dir.is_dir():
        raise ShifuError(
            f"stage {name}: '{stage_dir}' is a file, not a directory; move it out of the run "
            "directory, or use a new --out"
        )
    found = sorted(p.name for p in stage_dir.iterdir() if p.name != LOCK_FILE) if stage_dir.exists() else []
    if found and not any((stage_dir / m).exists() for m in (STAGE_MARKER, "DONE", RUN_MARKER)):
        raise ShifuError(
            f"stage {name}: '{stage_dir}' holds {_listing(found, stage_dir)}, but shifu did not make it (no "
            f"{STAGE_MARKER}); nothing in it was changed. Move it out of the run directory, or use a new "
            "--out"
        )
    if foreign := [n for n in found if not any(fnmatch.fnmatchcase(n, pat) for pat in STAGE_FILES)]:
        them = "it" if len(foreign) == 1 else "them"
        raise ShifuError(
            f"stage {name} would start again in '{stage_dir}', which holds {_listing(foreign, stage_dir)}: "
            f"not written by shifu, so never deleted. Nothing in it was changed; move {them} out of "
            f"'{stage_dir}' (or use a new --out)"
        )
    stage_dir.mkdir(parents=True, exist_ok=True)
    if not (stage_dir / STAGE_MARKER).exists():
        (stage_dir / STAGE_MARKER).write_text(f"stage {name} of a shifu pipeline (its files are shifu's)\n")


def clear_stage(stage_dir: Path, name: str) -> None:
    """Start stage ``name`` again: what it wrote in ``stage_dir`` is deleted (its marker and lock stay),
    after :func:`claim_stage` found nothing else there."""
    from shifu.runs.checkpoint import LOCK_FILE, STAGE_MARKER

    claim_stage(stage_dir, name)
    for p in stage_dir.iterdir():
        if p.name not in (LOCK_FILE, STAGE_MARKER):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()  # (a link: not followed)


def claim_run(out: Path, kind: str, outputs: list[str]) -> None:
    """Hold ``out`` as the run directory of a ``kind`` pipeline (``quickstart``, ``study``) that writes the
    top-level files ``outputs`` for the rest of this process (:func:`shifu.runs.checkpoint.release_run_dirs`
    lets go), or refuse, changing nothing: another live process runs a pipeline there (its pid, host and
    start time are named), ``out`` is not empty and not a ``kind`` pipeline's run directory (a trainer's
    run, a project folder...), or one of ``outputs`` there is not the pipeline's (:func:`check_outputs`).
    A missing or empty ``out`` becomes one (``.shifu-pipeline``); so does the run directory of a shifu that
    wrote no marker (its ``data/DONE``; ``shared/data/DONE`` for a study), whose ``outputs`` are its own."""
    from shifu.errors import OutputDirError
    from shifu.runs import checkpoint as ckpt

    if out.exists() and not out.is_dir():
        raise OutputDirError(f"--out '{out}' exists and is not a directory; choose a new --out")
    _check_run_dir(out, kind)  # before the lock file is made in a directory that is not the pipeline's
    out.mkdir(parents=True, exist_ok=True)
    ckpt.lock_run_dir(out)
    marker = _check_run_dir(out, kind)  # again, under the lock: another pipeline may have been faster
    if marker is None:
        older = [n for n in outputs if (out / n).is_file()]  # an older shifu's own files
        _write_marker(out, {"command": kind, "outputs": {n: _digest(out / n) for n in older}})
    check_outputs(out, outputs)  # a user's file in the way is named now, not after hours of training


LEGACY_DONE = {"quickstart": "data/DONE", "study": "shared/data/DONE"}  # a run of a shifu without the marker


def _check_run_dir(out: Path, kind: str) -> dict | None:
    """``out``'s pipeline marker; None for a missing or empty ``out``, or one an older shifu made; refuses
    any other non-empty ``out``, saying what is there."""
    from shifu.errors import OutputDirError
    from shifu.runs.checkpoint import LOCK_FILE, PIPELINE_MARKER, looks_like_run

    found = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.exists() else []
    marker = _read_marker(out)
    if marker is not None and marker.get("command") != kind:
        raise OutputDirError(
            f"'{out}' is the run directory of a shifu {marker.get('command')}, not of a {kind}; nothing in it "
            "was changed. Choose a new --out"
        )
    if marker is not None or not found:
        return marker
    with contextlib.suppress(OSError, ValueError):
        older = json.loads((out / LEGACY_DONE[kind]).read_text(encoding="utf-8"))
        if isinstance(older, dict) and "seconds" in older:
            return None
    what = "a shifu trainer's run directory, holding" if looks_like_run(out) else "not empty: it holds"
    raise OutputDirError(
        f"refusing to run the {kind} in '{out}': it is {what} {_listing(found, out)}, and is not a shifu "
        f"{kind} run directory (no {PIPELINE_MARKER}), whose files the {kind} could delete or overwrite. "
        "Nothing in it was changed. Choose a new --out: a missing or empty directory"
    )


def _read_marker(out: Path) -> dict | None:
    from shifu.runs.checkpoint import PIPELINE_MARKER

    try:
        marker = json.loads((out / PIPELINE_MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ShifuError(f"'{out / PIPELINE_MARKER}' is damaged ({e}); use a new --out") from None
    return marker if isinstance(marker, dict) else {}


def _write_marker(out: Path, marker: dict) -> None:
    from shifu.runs.checkpoint import PIPELINE_MARKER

    tmp = out / (PIPELINE_MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1), encoding="utf-8")
    os.replace(tmp, out / PIPELINE_MARKER)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_outputs(out: Path, names: list[str]) -> dict:
    """Refuse (naming it) a file ``out/<name>`` the pipeline did not write, or that was changed since it
    did (its digest is not the one recorded in ``.shifu-pipeline``); returns the marker."""
    marker = _read_marker(out) or {}
    recorded = marker.setdefault("outputs", {})
    for name in names:
        path = out / name
        if not path.is_file() or (name in recorded and recorded[name] in (None, _digest(path))):
            continue
        why = "was changed since the pipeline wrote it" if name in recorded else "was not written by it"
        raise ShifuError(
            f"'{path}' would be overwritten, but it {why}: it is never overwritten. Move it out of "
            f"'{out}' (or use a new --out); nothing was changed"
        )
    return marker


@contextlib.contextmanager
def writing(out: Path, names: list[str]) -> Iterator[None]:
    """Around the pipeline writing its top-level files ``out/<name>``: :func:`check_outputs` first, then
    the digests of what was written are recorded (while being written, whatever is there is the pipeline's:
    a crash in between leaves nothing it would refuse)."""
    marker = check_outputs(out, names)
    marker["outputs"].update(dict.fromkeys(names))
    _write_marker(out, marker)
    yield
    for name in names:
        if (out / name).is_file():
            marker["outputs"][name] = _digest(out / name)
        else:
            marker["outputs"].pop(name)
    _write_marker(out, marker)

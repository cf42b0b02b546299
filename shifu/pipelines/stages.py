"""What ``shifu quickstart`` and ``shifu study`` share: prepare -> SFT -> preference pairs -> reward model.

:class:`Stages` runs each stage in its own directory under one root::

    ROOT/data/   task files: sft_*.jsonl, prompts_*.jsonl, tokenizer/, base/ (untrained or converted model)
    ROOT/sft/    shifu sft run: final/ (the SFT policy: where every later stage starts, and the reference)
    ROOT/pairs/  preference pairs sampled from the SFT policy
    ROOT/rm/     imdb: shifu rm run on those pairs: final/ (the reward model)

A finished stage leaves ``DONE`` in its directory: JSON with the wall-clock ``seconds``, the process
``cpu_seconds``, what the stage reports (e.g. ``rm_accuracy``) and the ``plan`` it ran (its settings and
inputs, paths inside the run written ``<run>/...``). A rerun skips finished stages whose plan is this run's,
and refuses, naming the keys, a finished stage whose plan differs (it is never kept silently, nor redone in
place); a trainer stage that was interrupted resumes from its checkpoint, or starts again when it has none.

Nothing shifu did not write is deleted or overwritten: what a pipeline may touch in its run directory and
its stage directories is :mod:`shifu.pipelines.run_dirs`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError

# (`x as x`: names quickstart and evaluation import from here, defined in pipeline_dirs and runs.jsonfile)
from shifu.pipelines.run_dirs import claim_run as claim_run
from shifu.pipelines.run_dirs import claim_stage, clear_stage
from shifu.pipelines.run_dirs import writing as writing
from shifu.runs.jsonfile import read_jsonl as read_jsonl
from shifu.runs.jsonfile import write_jsonl as write_jsonl

# ------------------------------------------------------------------------------------------- helpers


def merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` laid on top, section by section (neither is changed)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def log(who: str, msg: str) -> None:
    print(f"[{who}] {msg}", file=sys.stderr, flush=True)


def clock() -> tuple[float, float]:
    """(wall-clock, CPU) time now: the start that :func:`elapsed` measures from."""
    return time.time(), cpu_time()


def cpu_time() -> float:
    """CPU seconds of this process (all its threads) and of its children that have ended (a stage's forked
    parts, its subprocesses)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def elapsed(t0: tuple[float, float]) -> dict[str, float]:
    """Wall-clock ``seconds`` and ``cpu_seconds`` since ``t0`` (a :func:`clock`).

    CPU time (all threads of this process and of the children it waited for) is the figure to compare on a
    shared machine: with one torch thread it is what the stage takes on an idle core.
    """
    return {"seconds": round(time.time() - t0[0], 2), "cpu_seconds": round(cpu_time() - t0[1], 2)}


def portable(obj: Any, root: Path) -> Any:
    """``obj`` with every string path inside ``root`` written ``<run>/...``: a stage's plan that does not
    change when the run directory is moved or given as another path to the same place."""
    if isinstance(obj, dict):
        return {k: portable(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith(("/", ".")):
        # abspath, not resolve: links are not followed (a linked base model in the run is the run's)
        with contextlib.suppress(ValueError):
            return "<run>/" + Path(os.path.abspath(obj)).relative_to(os.path.abspath(root)).as_posix()
    return obj


def digest(texts: list[str]) -> dict[str, Any]:
    """A list of texts as its length and SHA-256 (a plan records which prompts, not the prompts)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    return {"count": len(texts), "sha256": h.hexdigest()}


def as_recorded(plan: dict, root: Path) -> dict:
    """``plan`` as a marker records it: :func:`portable` and through JSON (tuples are lists)."""
    return json.loads(json.dumps(portable(plan, root)))


def check_plan(what: str, where: Path, marker: dict, plan: dict, say: Callable[[str], None]) -> None:
    """ShifuError when the finished ``what`` (a stage, a study run) in ``where`` ran another plan than
    ``plan`` (:func:`as_recorded`): its outputs are kept, and all that follows would silently build on
    them. A marker of a shifu that did not record plans is kept as it is (``say`` tells)."""
    from shifu.runs.checkpoint import config_diff

    if "plan" not in marker:
        say(f"{what}: finished by a shifu that did not record its plan; kept as it is")
        return
    if diff := config_diff(marker["plan"], plan):

        def at(tree: dict, dotted: str) -> Any:
            for part in dotted.split("."):
                tree = tree.get(part, "not set") if isinstance(tree, dict) else "not set"
            return tree

        k, others = diff[0], diff[1:6] + (["..."] if len(diff) > 6 else [])
        more = f" (and {', '.join(others)} differ)" if others else ""
        raise ShifuError(
            f"{what} in {where} finished with another plan than this run's: {k} was {at(marker['plan'], k)!r}, "
            f"now {at(plan, k)!r}{more}. What is finished is kept, never redone in place: use a new --out for "
            f"this plan, or delete {where} and what follows it to redo them"
        )


def done(stage_dir: Path) -> dict | None:
    """The stage's ``DONE`` marker, or None when it has not finished."""
    marker = stage_dir / "DONE"
    return json.loads(marker.read_text(encoding="utf-8")) if marker.exists() else None


def mark_done(stage_dir: Path, t0: tuple[float, float], **extra: Any) -> None:
    """Write ``DONE``: the time since ``t0`` (:func:`elapsed`) and ``extra``."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / "DONE").write_text(json.dumps({**elapsed(t0), **extra}), encoding="utf-8")


def stage_overrides(config: type, overrides: dict, stage_dir: Path) -> dict:
    """A trainer stage's config overrides: the stage's plan in ``stage_dir``; a PPO stage without the trainer's
    final evaluation unless the plan sets ``eval.final_prompts`` (a pipeline measures its policies on its own
    held-out prompts; kept out of the recorded plan, which says what the stage trains)."""
    from shifu.config.schema import PPOConfig

    base = {"eval": {"final_prompts": 0}} if config is PPOConfig else {}
    return merge(merge(base, overrides), {"out_dir": str(stage_dir)})


def train_stage(module_name: str, stage_dir: Path, overrides: dict) -> dict:
    """Run a trainer (``Config`` + ``train``) in ``stage_dir``; resume from its checkpoint if it has one,
    else start it again (:func:`clear_stage`)."""
    import importlib

    from shifu.config.imports import key_prefix
    from shifu.config.loader import load_config
    from shifu.parallel.threads import release_freed_memory
    from shifu.runs import checkpoint as ckpt

    module = importlib.import_module(module_name)
    cfg = load_config(module.Config, None, stage_overrides(module.Config, overrides, stage_dir))
    claim_stage(stage_dir, stage_dir.name)
    ckpt.lock_run_dir(stage_dir)  # a trainer running there on its own is refused before anything is deleted
    resume = ckpt.latest_checkpoint(stage_dir) is not None
    if not resume:
        clear_stage(stage_dir, stage_dir.name)  # an unfinished stage without a checkpoint starts again
    with key_prefix(f"{stage_dir.name}."):  # messages name the plan's keys (ppo.env.factory)
        result = module.train(cfg, resume=resume, overwrite=False) or {}
    release_freed_memory()  # the next stage starts from what is live, not from this one's heap
    if result.get("stopped"):  # SIGINT/SIGTERM: the stage checkpointed; the same command again resumes it
        raise SystemExit(0)
    return result


def ppo_overrides(plan: dict, sft_final: str | Path, files: dict[str, str], reward: dict, seed: int) -> dict:
    """A PPO (or REINFORCE) run's config: ``plan`` from the SFT policy (the actor's start and the
    reference), on the task's training prompts with its validation prompts held out (a source with prompts of
    its own, a verifiers taskset, on its tasks), rewarded by ``reward`` (``model_path``, ``function`` or a
    service's ``url``)."""
    from shifu.rollout.build import own_prompts

    data = (
        {} if own_prompts(plan) else {"data": {"train": files["prompts_train"], "eval": files["prompts_val"]}}
    )
    over = merge(plan, {"seed": seed, "model": {"path": str(sft_final)}, "reward": dict(reward), **data})
    if "function" not in reward:  # a reward model or service replaces the plan's reward function
        over["reward"].pop("function", None)
    return over


# -------------------------------------------------------------------------------------------- stages


class Stages:
    """The shared stages of one run, in ``root``; ``seed`` seeds every one of them, ``who`` prefixes logs.

    Each stage's ``DONE`` marker is kept in ``markers`` (stage name -> marker, in the order they ran).
    """

    def __init__(self, root: Path, seed: int, who: str):
        self.root, self.seed, self.who = root, seed, who
        self.markers: dict[str, dict[str, Any]] = {}

    def log(self, msg: str) -> None:
        log(self.who, msg)

    def run(
        self,
        name: str,
        stage_dir: Path,
        note: str,
        work: Callable[[Path], dict | None],
        plan: dict | None = None,
    ) -> dict:
        """Stage ``name``: ``work(stage_dir)`` unless ``stage_dir`` is DONE; its marker holds what
        ``work`` returns and ``plan`` (JSON-able: what the stage computes from), which a finished stage's
        marker must match (:func:`check_plan`). Returns the marker."""
        recorded = None if plan is None else as_recorded(plan, self.root)
        if (marker := done(stage_dir)) is None:
            claim_stage(stage_dir, name)
            self.log(note)
            t0 = clock()
            extra = work(stage_dir) or {}
            mark_done(stage_dir, t0, **extra, **({} if recorded is None else {"plan": recorded}))
            marker = done(stage_dir)
        elif recorded is not None:
            check_plan(f"stage {name}", stage_dir, marker, recorded, self.log)
        self.markers[name] = marker
        return marker

    def train(self, name: str, module_name: str, overrides: dict) -> dict:
        """A trainer stage in ``root/name`` (:func:`train_stage`); returns its marker."""

        def work(stage_dir: Path) -> None:
            train_stage(module_name, stage_dir, overrides)

        return self.run(name, self.root / name, f"stage {name}", work, plan=overrides)

    def seconds(self) -> dict[str, float]:
        return {name: m["seconds"] for name, m in self.markers.items()}

    def cpu_seconds(self) -> dict[str, float | None]:
        """Per stage; None for a stage finished by a version that did not measure CPU time."""
        return {name: m.get("cpu_seconds") for name, m in self.markers.items()}

    def prepare(self, task: str, preset: str) -> dict[str, str]:
        """Task files, tokenizer and base model in ``root/data``; returns the files (stem -> path)."""
        data_dir = self.root / "data"

        def work(stage_dir: Path) -> None:
            from shifu.tasks import arith, arith_chain, arith_tool, imdb

            clear_stage(stage_dir, "prepare")
            tasks = {"arith": arith, "arith_tool": arith_tool, "arith_chain": arith_chain, "imdb": imdb}
            tasks[task].prepare(stage_dir, preset, self.seed)

        base = data_dir / "base"
        if base.is_symlink() and not base.exists() and (data_dir / "DONE").exists():
            (data_dir / "DONE").unlink()  # the cached model it links to was deleted: prepare again
        plan = {"task": task, "preset": preset, "seed": self.seed}
        self.run("prepare", data_dir, f"prepare task {task} (preset {preset}) in {data_dir}", work, plan)
        return {p.stem: str(p) for p in data_dir.glob("*.jsonl")}

    def sft(self, plan: dict, files: dict[str, str]) -> Path:
        """SFT of the base model on the task's demonstrations; returns the policy (``root/sft/final``)."""
        over = {
            "seed": self.seed,
            "model": {"path": str(self.root / "data" / "base")},
            "data": {"train": files["sft_train"], "eval": files["sft_eval"]},
        }
        self.train("sft", "shifu.trainers.sft", merge(plan, over))
        return self.root / "sft" / "final"

    def imdb_pairs(self, sft_final: Path, prompts: list[str], plan: dict) -> dict:
        """Two SFT samples per prompt, labelled by the noisy VADER judge (:func:`shifu.tasks.imdb.
        make_preference_pairs`); the marker holds its label statistics."""

        def work(pairs_dir: Path) -> dict:
            from shifu.tasks import imdb

            info = imdb.make_preference_pairs(
                sft_final,
                prompts,
                pairs_dir,
                max_new_tokens=plan["max_new_tokens"],
                tau=plan["tau"],
                seed=self.seed,
                temperature=plan["temperature"],
                drop_ties=plan.get("drop_ties", False),
                shards=plan.get("shards", 1),
            )
            return {k: v for k, v in info.items() if not k.startswith("pairs_")}

        note = "stage pairs: two SFT samples per prompt, noisy VADER preference"
        inputs = {"policy": str(sft_final), "seed": self.seed, "prompts": digest(prompts)}
        return self.run("pairs", self.root / "pairs", note, work, {**plan, **inputs})

    def rm(self, plan: dict, sft_final: Path) -> dict:
        """The reward model on ``root/pairs`` (``model.path`` sft or unset: on the SFT policy); the marker
        holds its held-out ``rm_accuracy``. Returns the marker."""
        pairs_dir = self.root / "pairs"
        over = merge(
            plan,
            {
                "seed": self.seed,
                "data": {
                    "train": str(pairs_dir / "pairs_train.jsonl"),
                    "eval": str(pairs_dir / "pairs_eval.jsonl"),
                },
                # SFT-policy samples on training prompts get RM scores of mean 0, std 1; 1024 of them
                # (of ~6000) fit the mean and std as well and cost 13 s instead of 78 s of one core
                "normalize": {"responses": str(pairs_dir / "sft_samples.jsonl"), "max_rows": 1024},
            },
        )
        path = over.get("model", {}).get("path", "sft")
        if path == "sft":
            over = merge(over, {"model": {"path": str(sft_final)}})
        elif path == "bag-of-tokens" and not over["model"].get("tokenizer"):  # weights for the policy's ids
            over = merge(over, {"model": {"tokenizer": str(sft_final)}})

        def work(rm_dir: Path) -> dict:
            result = train_stage("shifu.trainers.reward", rm_dir, over)
            return {"rm_accuracy": result.get("eval/rm/accuracy")}

        return self.run("rm", self.root / "rm", "stage rm", work, plan=over)

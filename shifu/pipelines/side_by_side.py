"""Independent trainer stages of a pipeline trained at once, one forked process each (:func:`side_by_side`):
a soup's PPO runs (``soup.members``) on a machine with a core for each."""

from __future__ import annotations

import sys
from pathlib import Path

from shifu.pipelines.stages import Stages, done


def side_by_side(stages: Stages, runs: dict[str, dict]) -> None:
    """Train the unfinished PPO runs of ``runs`` (stage name -> overrides) at once, one process each (forked:
    the pipeline's run directory stays held), when this process has a torch thread for each; a run gets
    ``threads // runs`` threads (one each on two cores: models of the quickstart's size gain less from a second
    thread than from a core of their own). Each run is the very run it is alone with those threads. A run that did
    not finish (stopped, failed) is left to the caller's :meth:`Stages.train`, which resumes or restarts
    it in this process. Their ``DONE`` markers name the runs that shared the machine (``side_by_side``), so
    the run's total time counts that stretch once (:func:`overlap`)."""
    import multiprocessing

    import torch

    todo = [name for name in runs if done(stages.root / name) is None]
    threads = torch.get_num_threads()
    if len(todo) < 2 or threads < len(todo) or "fork" not in multiprocessing.get_all_start_methods():
        return
    each = threads // len(todo)
    stages.log(f"stages {', '.join(todo)} side by side: one process each, {each} torch thread(s) each")
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush(), sys.stderr.flush()  # (a forked child would write what is buffered again)
    procs = [ctx.Process(target=_train_member, args=(stages, name, runs[name], each, todo)) for name in todo]
    try:
        for proc in procs:
            proc.start()
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.join()


def _train_member(stages: Stages, name: str, overrides: dict, threads: int, together: list[str]) -> None:
    """One PPO run of :func:`side_by_side`, in its forked process."""
    import torch

    from shifu.pipelines.stages import train_stage

    torch.set_num_threads(threads)

    def work(stage_dir: Path) -> dict:
        train_stage("shifu.trainers.ppo", stage_dir, overrides)
        return {"side_by_side": together}

    stages.run(name, stages.root / name, f"stage {name}", work, plan=overrides)


def overlap(markers: dict[str, dict]) -> float:
    """Seconds counted twice when stage times are summed: for each group of stages that ran side by side
    (their markers' ``side_by_side``), every stage's time but the longest."""
    groups: dict[tuple[str, ...], list[float]] = {}
    for marker in markers.values():
        if together := marker.get("side_by_side"):
            groups.setdefault(tuple(together), []).append(marker["seconds"])
    return sum(sum(times) - max(times) for times in groups.values())

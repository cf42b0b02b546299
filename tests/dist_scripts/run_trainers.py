"""Run several ``shifu sft`` / ``shifu rm`` / ``shifu dpo`` trainings in ONE torchrun launch (start-up costs seconds),
for ``tests/test_distributed_sft_rm.py``::

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/run_trainers.py --runs RUNS.json

``RUNS.json``: a list of ``{"cmd": "sft" | "rm" | "dpo", "overrides": ["key=value", ...], "resume": bool,
"copy_final": DIR | null}``, run in order on every rank exactly as the CLI would (``load_config`` +
``train``). ``copy_final``: rank 0 copies ``OUT/final`` there afterwards (a snapshot before a later run
resumes into the same directory). The checks themselves are in the test, against 1-process runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from shifu.config.loader import load_config
from shifu.parallel import distributed as D
from shifu.trainers import dpo, reward, sft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    runs = json.loads(Path(ap.parse_args().runs).read_text())
    for run in runs:
        module = {"sft": sft, "rm": reward, "dpo": dpo}[run["cmd"]]
        cfg = load_config(module.Config, overrides=run["overrides"])
        module.train(cfg, resume=run.get("resume", False))
        if run.get("copy_final") and D.is_main():
            shutil.copytree(Path(cfg.out_dir) / "final", run["copy_final"])
        D.barrier()
    D.destroy()


if __name__ == "__main__":
    main()

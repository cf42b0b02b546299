"""``torchrun ... slow_checkpoint.py SECONDS RC_DIR CMD ARGS...`` = ``shifu_rc.py RC_DIR CMD ARGS...`` on a slow
disk: every checkpoint write spends SECONDS more in its fsync, before the directory is renamed into place (a
process killed meanwhile leaves only its ``.tmp-step-N``). For ``tests/test_torchrun_stops.py``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from shifu.cli.main import main
from shifu.runs import checkpoint

if __name__ == "__main__":
    seconds, rc_dir, argv = float(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    fsync_tree = checkpoint._fsync_tree

    def slow_fsync_tree(path):
        print(f"slow disk: {path.name} takes {seconds:g} s more", file=sys.stderr, flush=True)
        time.sleep(seconds)
        fsync_tree(path)

    checkpoint._fsync_tree = slow_fsync_tree
    code = main(argv)
    rc_dir.mkdir(parents=True, exist_ok=True)
    (rc_dir / f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))
    raise SystemExit(code)

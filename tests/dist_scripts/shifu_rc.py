"""``torchrun ... shifu_rc.py RC_DIR CMD ARGS...`` = ``torchrun ... -m shifu CMD ARGS...``, and each process writes
its exit status to ``RC_DIR/rank-<RANK>`` before it exits (torchrun reports no worker's status after a
signal; a process killed before it returned writes nothing). For ``tests/test_torchrun_faults.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from shifu.cli.main import main

if __name__ == "__main__":
    rc_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    code = main(argv)
    rc_dir.mkdir(parents=True, exist_ok=True)
    (rc_dir / f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))
    raise SystemExit(code)

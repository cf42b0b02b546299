"""``python run_shifu.py ARGS...`` = ``shifu ARGS...``, with fault injection for the resume/fault tests.

Test-only hooks, read from the environment (production code has none):

- ``SHIFU_TEST_CRASH_IN_CHECKPOINT=<step>``: while the checkpoint of that step is being written, after
  its first weights file, truncate that file to half its size and ``os._exit(137)`` -- a process killed
  in the middle of a checkpoint write (as SIGKILL would, no cleanup, no flush).
- ``SHIFU_TEST_NAN_LOSS_AT=<k>``: the k-th (1-based) SFT micro-batch loss of this process is NaN.
"""

from __future__ import annotations

import os
import sys


def install_hooks() -> None:
    crash_step = os.environ.get("SHIFU_TEST_CRASH_IN_CHECKPOINT")
    if crash_step:
        from shifu.runs import checkpoint

        marker = f".tmp-step-{int(crash_step):08d}"

        def then_crash(real_save):  # save_model (whole modules) or save_file (LoRA: what trains)
            def save_then_crash(what, filename, *args, **kwargs):
                real_save(what, filename, *args, **kwargs)
                if marker in str(filename):
                    size = os.path.getsize(filename)
                    with open(filename, "r+b") as f:
                        f.truncate(size // 2)
                    os._exit(137)

            return save_then_crash

        checkpoint.save_model = then_crash(checkpoint.save_model)
        checkpoint.save_file = then_crash(checkpoint.save_file)

    nan_at = os.environ.get("SHIFU_TEST_NAN_LOSS_AT")
    if nan_at:
        from shifu.trainers import sft

        real_nll = sft.sft_nll_sum
        calls = {"n": 0}

        def nll_with_nan(*args, **kwargs):
            nll, n = real_nll(*args, **kwargs)
            calls["n"] += 1
            return (nll * float("nan") if calls["n"] == int(nan_at) else nll), n

        sft.sft_nll_sum = nll_with_nan


if __name__ == "__main__":
    install_hooks()
    from shifu.cli.main import main

    raise SystemExit(main(sys.argv[1:]))

"""``shifu launch``: torchrun with the exit status that schedulers and shells read.

``shifu launch [torchrun options] COMMAND ARGS...`` runs ``torchrun [torchrun options] -m shifu COMMAND
ARGS...``; a script (``train.py``) or ``-m module`` in COMMAND's place runs as torchrun runs it. The
launcher is torch's own (``torch.distributed.run``, in this process, with all its options); only its exit
status differs:

- **A signal to the launcher** (SIGTERM from a scheduler preempting the job, SIGINT from Ctrl-C):
  torchrun passes it on to every process; each shifu process finishes its step, the ranks write one
  checkpoint together and exit 0 (``--resume`` continues bit-identically). The launcher then exits with
  128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a process ended by that signal would.
  Plain ``torchrun`` exits 1 here: torch elastic turns the signal into an exception. A signal sent to every
  process of the job (Slurm's ``scancel``, systemd) reaches each rank twice, directly and forwarded; a
  rank takes the second as the same request (:class:`shifu.trainers.common.GracefulStop`). torchrun
  forwards SIGHUP and SIGQUIT as well; those end the processes without a checkpoint.
- **A process that failed**: the launcher exits with that process's status (2 for a shifu error such as a
  bad config; 128 + N for a process killed by signal N) instead of torchrun's 1.

After the signal, the launcher waits ``--shutdown-timeout`` seconds for the processes to stop, then kills
them. torchrun's own default is 30 s (or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), which a step plus a checkpoint
of a large model can outlast; ``shifu launch`` waits ``SHUTDOWN_TIMEOUT_S`` unless given either (a torch
whose torchrun has no ``--shutdown-timeout`` waits 30 s). A scheduler kills the job after its own grace
period whatever this says.
"""

from __future__ import annotations

import os
import sys

SHUTDOWN_TIMEOUT_S = (
    300  # room for the step a signal interrupts (a PPO iteration) and the checkpoint after it
)


def main(argv: list[str]) -> int:
    """Run ``argv`` (torchrun's options, then a shifu command or a script) under torchrun; the exit status
    is 0, 128 + a signal the launcher got, or the status of the first process that failed."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = parse_args(argv)
    try:
        torchrun.run(args)
    except SignalException as e:
        print(
            f"shifu launch: got {e.sigval.name}; the processes were told to stop (each writes its checkpoint "
            f"first); exit status {128 + int(e.sigval)}",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -N: killed by signal N
        print(f"shifu launch: process {rank} exited with status {code}", file=sys.stderr)
        return code
    return 0


def parse_args(argv: list[str]):
    """torchrun's arguments for ``argv``: a shifu command in the script's place runs as ``-m shifu
    COMMAND``; without ``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` the launcher waits
    ``SHUTDOWN_TIMEOUT_S`` for the processes to stop after a signal."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "shifu launch"
    parser.description = (
        "torchrun for shifu: `shifu launch [torchrun options] COMMAND ARGS...` runs `shifu COMMAND ARGS...` "
        "on every process (a script path or -m module runs as under torchrun); a signal to the launcher "
        "stops every process at a checkpoint and exits 128 + its number (143 for SIGTERM); after it, the "
        f"launcher waits --shutdown-timeout seconds (shifu's default: {SHUTDOWN_TIMEOUT_S}) before it kills "
        "the processes"
    )
    args = parser.parse_args(argv)
    if not (args.module or args.no_python or _is_script(args.training_script)):
        args.training_script_args = [args.training_script, *args.training_script_args]
        args.training_script, args.module = "shifu", True
    # (an older torchrun, without --shutdown-timeout, always waits 30 s)
    if getattr(args, "shutdown_timeout", 0) is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    return args


def _is_script(name: str) -> bool:
    """Whether torchrun's positional argument names a Python file rather than a shifu command."""
    return name.endswith(".py") or os.sep in name

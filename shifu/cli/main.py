"""``shifu`` command line: ``shifu sft|rm|ppo|dpo --config FILE.yaml key.sub=value ...`` and friends.

Trainer flags and ``key.sub=value`` overrides mix in any order (``--out runs/x --resume max_steps=200``).

Trainer commands share one shape: a config dataclass (``Config``) and a ``train(cfg, resume, overwrite)``
function in their module. Other commands (quickstart, report, demo, bench, study) take their own argv.
Errors the user can fix (:class:`shifu.errors.ShifuError`) print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import traceback
from pathlib import Path

from shifu.cli import quiet
from shifu.parallel.threads import keep_freed_memory, set_threads

# command -> (module, description); trainer modules expose `Config` and `train`
TRAINERS = {
    "sft": ("shifu.trainers.sft", "stage 1: supervised fine-tuning on (prompt, response) data"),
    "rm": ("shifu.trainers.reward", "stage 2: Bradley-Terry reward model on preference pairs"),
    "ppo": ("shifu.trainers.ppo", "stage 3: PPO with actor, critic, reference and reward model"),
    "dpo": ("shifu.trainers.dpo", "DPO on the same preference pairs (baseline)"),
}
# command -> (module, description); these modules expose `main(argv) -> int`
TOOLS = {
    "quickstart": (
        "shifu.pipelines.quickstart",
        "run a built-in task end to end (SFT -> RM -> PPO -> report)",
    ),
    "report": ("shifu.reporting.compare", "render report.html for a run directory, or compare several runs"),
    "sample": (
        "shifu.generation.sample",
        "generate from a policy; optionally score it with a reward model/function",
    ),
    "eval": (
        "shifu.evaluation.measure",
        "measure a policy on your prompts and judge, or two paired: mean, gain and standard errors",
    ),
    "demo": ("shifu.demo.bandit", "toy demos: `shifu demo bandit`"),
    "bench": (
        "shifu.bench.timing",
        "time full PPO iterations on a fixed offline setup (random weights)",
    ),
    "study": ("shifu.study.frontier", "studies: `shifu study frontier`"),
    "init-model": (
        "shifu.data.starter",
        "a small model with a tokenizer trained on your data, to start in minutes",
    ),
    "traces": (
        "shifu.rollout.traces",
        "export a run's recorded episodes: `shifu traces export RUN --format atif --out FILE`",
    ),
    "merge": ("shifu.models.merge", "merge RL runs from one base policy into one (a model soup)"),
    "serve": (
        "shifu.serve.server",
        "serve a reward model, ensemble or rule reward over HTTP (docs/how-to/reward-service.md)",
    ),
    "install": ("shifu.tasks.assets", "install the SmolLM2 presets' assets: `shifu install smollm2`"),
    "launch": (
        "shifu.parallel.launch",
        "torchrun for shifu: a command on several processes; SIGTERM checkpoints and exits 143",
    ),
}


def trainer_parser(cmd: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"shifu {cmd}", description=description)
    p.add_argument("--config", help="YAML file with config keys (overrides the defaults)")
    p.add_argument("--out", help="output run directory (same as out_dir=...)")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its latest checkpoint"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: SHIFU_THREADS or torch's)"
    )
    p.add_argument(
        "--help-config",
        action="store_true",
        help="list every config key with its default, meaning and allowed values",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show third-party progress bars, warnings and log messages (transformers, peft, ...)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override, the same as a bare key.sub=value (repeatable)",
    )
    if cmd == "rm":
        p.add_argument(
            "--ensemble", type=int, metavar="K", help="train K reward models (same as ensemble.k=K)"
        )
    p.add_argument(
        "overrides",
        nargs="*",
        help="key.sub=value overrides, applied after --config; they may come before, between or after flags",
    )
    return p


def parse_trainer_args(cmd: str, argv: list[str]) -> argparse.Namespace:
    """A trainer command's flags and ``key.sub=value`` overrides, in any order.

    Plain ``parse_args`` takes the positional overrides as one run, so ``a=1 --resume b=2`` (overrides on
    both sides of a flag) failed with "unrecognized arguments: b=2"; the intermixed parse collects every
    override, keeping their order (a later override of the same key wins).
    """
    return trainer_parser(cmd, TRAINERS[cmd][1]).parse_intermixed_args(argv)


def run_trainer(cmd: str, argv: list[str]) -> int:
    from shifu.config.loader import describe, load_config

    module_name, _ = TRAINERS[cmd]
    args = parse_trainer_args(cmd, argv)
    module = importlib.import_module(module_name)
    if args.help_config:
        for key, default, help_ in describe(module.Config):
            print(f"{key:32s} {default:>14s}  {help_}")
        return 0
    set_threads(args.threads)
    overrides = list(args.overrides) + list(args.sets)
    if args.out:
        overrides.append(f"out_dir={args.out}")
    if getattr(args, "ensemble", None):
        overrides.append(f"ensemble.k={args.ensemble}")
    base = resumed_config(args, overrides)
    cfg = load_config(module.Config, args.config, overrides, base=base)
    from shifu.parallel import distributed
    from shifu.runs import checkpoint

    try:
        module.train(cfg, resume=args.resume, overwrite=args.overwrite)
    except Exception as e:  # a collective that failed because another process of a torchrun job is gone
        why = distributed.lost_peer(e)
        if why is None:
            raise
        raise lost_peer_error(cmd, cfg.out_dir, why, argv) from None
    finally:
        checkpoint.release_run_dirs()  # the next command in this process may use the directory
    distributed.destroy()  # under torchrun: every rank leaves the process group together (else a no-op)
    return 0


def resumed_config(args: argparse.Namespace, overrides: list[str]) -> dict | None:
    """With ``--resume`` and no ``--config``: the run's own ``config.yaml`` (what it was started with), for the
    overrides to go on top of; the trainer then refuses any change that is not safe on resume. None otherwise."""
    from shifu.config.loader import lookup, parse_overrides, read_yaml

    if not args.resume or args.config is not None:
        return None
    out = lookup(parse_overrides(overrides), "out_dir")
    recorded = Path(str(out), "config.yaml") if out else None
    return read_yaml(recorded) if recorded is not None and recorded.is_file() else None


def lost_peer_error(cmd: str, out_dir: str, why: str, argv: list[str]):
    """The error of a process whose torchrun job lost another process (killed, crashed, or silent for
    ``distributed.timeout_s``): which process saw it, the last checkpoint, how to continue."""
    from shifu.errors import ShifuError
    from shifu.parallel import distributed
    from shifu.runs import checkpoint

    with contextlib.suppress(ValueError):  # (ValueError: not the main thread)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM must not cut the message short
    try:
        latest = checkpoint.latest_checkpoint(out_dir)
    except (ShifuError, OSError):
        latest = None
    where = f"the last checkpoint is {latest}" if latest else "no checkpoint was written yet"
    resume = "" if "--resume" in argv else " --resume"
    return ShifuError(
        f"process {distributed.rank()} of {distributed.world_size()} lost another process of this torchrun job "
        f"({why}); {where}. Once every process has exited, run the same torchrun command{resume} to continue"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose, argv = quiet.verbose_requested(argv)  # any command takes --verbose, anywhere
    commands = {**TRAINERS, **TOOLS}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: shifu COMMAND [options]\n\ncommands:")
        for name, (_, desc) in commands.items():
            print(f"  {name:11s} {desc}")
        print("\n`shifu COMMAND --help` for a command's options; --verbose (any command) also shows the")
        print("progress bars, warnings and log messages of transformers, datasets, peft and DeepSpeed.")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nshifu: error: unknown command '{argv[0]}'", file=sys.stderr)
            return 2
        return 0
    from shifu.errors import ShifuError, UserCodeError

    cmd, rest = argv[0], argv[1:]
    quiet.configure(verbose)  # before transformers & co. are imported
    quiet.tolerate_closed_console()  # a closed pipe (tee killed by the same Ctrl-C) must not end a run
    keep_freed_memory()  # before the first large tensor
    quiet.import_deepspeed_on_use()
    try:
        with quiet.verbose_while(verbose):
            if cmd in TRAINERS:
                return run_trainer(cmd, rest)
            return int(importlib.import_module(TOOLS[cmd][0]).main(rest) or 0)
    except ShifuError as e:
        if verbose and e.__cause__ is not None:  # the user's exception (or the library's) with its traceback
            traceback.print_exception(e)
        hint = " (--verbose prints the traceback)" if isinstance(e, UserCodeError) and not verbose else ""
        print(f"shifu {cmd}: error: {e}{hint}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"shifu {cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

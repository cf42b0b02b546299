"""Generate the reference pages that come from the code: configuration.md and metrics.md.

    python docs/gen_reference.py            # rewrite docs/reference/configuration.md and metrics.md
    python docs/gen_reference.py --check    # exit 1, naming the page, when a committed page is stale

``configuration.md`` is the text that ``shifu sft|rm|dpo|ppo --help-config`` prints, one table per command;
``metrics.md`` is :func:`shifu.runs.metrics.markdown_table`. ``make docs-reference`` runs the first form and
``tests/test_docs.py`` checks that both committed pages equal what this script writes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
COMMANDS = ("sft", "rm", "dpo", "ppo")
# a --help-config line: the key, its default (right-aligned, no two spaces in it), two spaces, the help
LINE = re.compile(r"^(\S+)\s+(.*?)  (.*)$")

INTRO = """\
# Configuration reference

Every config key of `shifu sft`, `shifu rm`, `shifu dpo` and `shifu ppo`, with its default and meaning:
the text that `shifu COMMAND --help-config` prints, generated from the config schema by
`make docs-reference` (a test keeps this page equal to the commands' output).

Keys are set, in this order, by the defaults below, a YAML file (`--config FILE`, nested sections such as
`optim:` / `lr: 1.0e-5`), and `KEY=VALUE` overrides on the command line (`optim.lr=1e-5`,
`trackers=[wandb]`, `dual_clip=null`). An unknown key, a value of the wrong type and an impossible
combination are refused with a message naming the key; `config.yaml` in the run directory records what ran.
KL settings are in nats per response. The quickstart's stages take the same keys through
`shifu quickstart --set STAGE.KEY=VALUE`.
"""


# run in one child process: `python -m shifu CMD --help-config` for each command, texts separated by SEP
SEP = "\n@@@ shifu gen_reference @@@\n"
CHILD = f"""
import contextlib, io, runpy, sys
for cmd in {COMMANDS!r}:
    sys.argv = ["shifu", cmd, "--help-config"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("shifu", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    sys.stdout.write(out.getvalue() + {SEP!r})
"""


def help_configs() -> dict[str, str]:
    """What ``shifu CMD --help-config`` prints for each command, from this checkout."""
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""))
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"`shifu COMMAND --help-config` failed (exit {done.returncode}):\n{done.stderr}")
    texts = done.stdout.split(SEP)[: len(COMMANDS)]
    return dict(zip(COMMANDS, texts, strict=True))


def cell(text: str) -> str:
    """A Markdown table cell: a bare | would split it."""
    return text.replace("|", r"\|")


def command_table(cmd: str, text: str) -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for line in text.splitlines():
        if not line.strip():
            continue
        match = LINE.match(line)
        if match is None:
            raise SystemExit(f"`shifu {cmd} --help-config`: cannot read the line {line!r}")
        key, default, meaning = match.groups()
        rows.append(f"| `{key}` | `{cell(default)}` | {cell(meaning)} |")
    return f"## shifu {cmd}\n\n" + "\n".join(rows) + "\n"


def configuration_md() -> str:
    texts = help_configs()
    return INTRO + "".join("\n" + command_table(cmd, texts[cmd]) for cmd in COMMANDS)


def metrics_md() -> str:
    sys.path.insert(0, str(ROOT))
    from shifu.runs.metrics import markdown_table

    return markdown_table()


def pages() -> dict[Path, str]:
    """Each generated page and its text."""
    return {REFERENCE / "configuration.md": configuration_md(), REFERENCE / "metrics.md": metrics_md()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that the committed pages are current")
    args = ap.parse_args(argv)
    stale = []
    for path, text in pages().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(stale)}; run `make docs-reference`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

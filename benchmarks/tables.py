"""The results tables of the docs, generated from the records in ``benchmarks/results/*.jsonl``.

    python benchmarks/tables.py            # rewrite every generated block in README.md and docs/benchmarks/
    python benchmarks/tables.py --check    # exit 1 and name the stale blocks instead (what the test runs)
    python benchmarks/tables.py --print quickstart   # one table on stdout

A page holds a generated table between two marker comments; everything outside them is prose:

    <!-- BEGIN results:NAME -->
    ...generated, never edited by hand...
    <!-- END results:NAME -->

Every table names the CPU and the commit of each figure, and ends with where its records are and the command
that made them (``make docs-tables`` runs this script). Each table is rendered by a module beside the script
that records it (``ppo_iteration_tables.py`` beside ``ppo_iteration.py``, ...; ``quickstart_tables.py`` and
``study_frontier_tables.py`` for runs of ``shifu quickstart`` and ``shifu study`` recorded with their own
command), from the parts in ``table_parts.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arith_tool_agents_tables  # noqa: E402
import async_longtail_tables  # noqa: E402
import async_objective_tables  # noqa: E402
import decode_weights_tables  # noqa: E402
import imdb_headroom_tables  # noqa: E402
import memory_tables  # noqa: E402
import ppo_iteration_tables  # noqa: E402
import provenance  # noqa: E402
import quickstart_methods_tables  # noqa: E402
import quickstart_profile_tables  # noqa: E402
import quickstart_tables  # noqa: E402
import rollout_tables  # noqa: E402
import serve_load_tables  # noqa: E402
import smollm2_recipe_tables  # noqa: E402
import study_frontier_tables  # noqa: E402
import verifiers_smollm2_tables  # noqa: E402

ROOT = provenance.ROOT
PAGES = ("README.md", "docs/benchmarks/*.md")
BLOCK = re.compile(r"(<!-- BEGIN results:([\w-]+) -->\n)(.*?)(<!-- END results:\2 -->)", re.S)
RENDERERS = (
    quickstart_methods_tables,
    smollm2_recipe_tables,
    quickstart_tables,
    quickstart_profile_tables,
    study_frontier_tables,
    imdb_headroom_tables,
    ppo_iteration_tables,
    decode_weights_tables,
    serve_load_tables,
    memory_tables,
    rollout_tables,
    async_longtail_tables,
    async_objective_tables,
    arith_tool_agents_tables,
    verifiers_smollm2_tables,
)


def collect(modules=RENDERERS) -> dict[str, Callable[[list[dict]], str]]:
    """Every table by its block name, from the renderer modules' ``TABLES``; a name two modules claim is refused."""
    out: dict[str, Callable[[list[dict]], str]] = {}
    for module in modules:
        for name, fn in module.TABLES.items():
            if name in out:
                raise SystemExit(f"results block {name!r} is rendered twice (in {module.__name__})")
            out[name] = fn
    return out


TABLES = collect()


# ---------------------------------------------------------------------------------------------- the pages
def pages() -> list[Path]:
    out = []
    for pattern in PAGES:
        out += sorted(ROOT.glob(pattern))
    return [p for p in out if p.exists()]


def render(text: str, records: list[dict], where: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown results block {name!r}; known: {', '.join(sorted(TABLES))}")
        return m.group(1) + TABLES[name](records) + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's generated block is stale")
    ap.add_argument("--print", dest="name", help="print one table")
    args = ap.parse_args(argv)
    records = provenance.load()
    if args.name:
        print(TABLES[args.name](records))
        return 0
    stale = []
    for page in pages():
        rel = str(page.relative_to(ROOT))
        text = page.read_text(encoding="utf-8")
        new = render(text, records, rel)
        if new != text:
            stale.append(rel)
            if not args.check:
                page.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale results tables in {', '.join(stale)}: run `make docs-tables`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

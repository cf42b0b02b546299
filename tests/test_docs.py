"""The documentation holds together: every relative link of README.md, CHANGELOG.md and docs/ resolves (file
and heading), docs/index.md reaches every page, the generated reference pages equal what the code prints, the
CLI page names every option, the algorithms page every public name of shifu.core, and the README stays short
and speaks of the product only."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shifu.core

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code blocks and code spans."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text, lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ...


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in links(page):
            if not relative(target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where} -> {path_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} -> no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_docs_index_reaches_every_page():
    seen, todo = set(), [DOCS / "index.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.exists():
            continue
        seen.add(page)
        for target in links(page):
            path_part = target.partition("#")[0]
            if relative(target) and path_part.endswith(".md"):
                dest = (page.parent / path_part).resolve()
                if DOCS in dest.parents:
                    todo.append(dest)
    unreached = sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p.resolve() not in seen)
    assert not unreached, f"pages docs/index.md does not reach: {unreached}"
    assert "docs/index.md" in links(ROOT / "README.md")


def test_slug_follows_github():
    assert (
        slug("Masked statistics — [`masked.py`](../../shifu/core/masked.py)") == "masked-statistics--maskedpy"
    )
    assert slug("shifu sft | rm | ppo | dpo") == "shifu-sft--rm--ppo--dpo"
    assert slug("Rollout/trainer mismatch — `offpolicy.py`") == "rollouttrainer-mismatch--offpolicypy"


def load_generator():
    spec = importlib.util.spec_from_file_location("shifu_docs_gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_equal_what_the_code_prints():
    stale = [
        str(path.relative_to(ROOT))
        for path, text in load_generator().pages().items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    assert not stale, f"stale generated pages: {stale}; run `make docs-reference`"


def test_configuration_reference_lists_every_key():
    text = (DOCS / "reference" / "configuration.md").read_text(encoding="utf-8")
    for key in ("model.path", "optim.lr", "kl.target", "reward.dense", "lora.critic", "ensemble.k"):
        assert f"| `{key}` |" in text, key


HELP_CHILD = """
import contextlib, io, runpy, sys
for argv in {argvs!r}:
    sys.argv = ["shifu", *argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("shifu", run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
    sys.stdout.write(out.getvalue())
"""
COMMANDS = [
    ["sft"],
    ["rm"],
    ["ppo"],
    ["dpo"],
    ["quickstart"],
    ["report"],
    ["sample"],
    ["merge"],
    ["traces", "export"],
    ["serve"],
    ["study", "frontier"],
    ["demo", "bandit"],
    ["bench"],
    ["install"],
]


def test_cli_reference_names_every_option():
    argvs = [[*cmd, "--help"] for cmd in COMMANDS]
    done = subprocess.run(
        [sys.executable, "-c", HELP_CHILD.format(argvs=argvs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    options = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", done.stdout)) - {"-h", "--help"}
    assert {"--help-config", "--ensemble", "--set", "--reward-model", "--exact", "--kl-budget"} <= options
    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    missing = sorted(o for o in options if not re.search(rf"`{re.escape(o)}(?![\w-])", page))
    assert not missing, f"options `--help` prints that docs/reference/cli.md does not name: {missing}"


def test_algorithms_page_names_every_core_function():
    page = (DOCS / "concepts" / "algorithms.md").read_text(encoding="utf-8")
    missing = [name for name in shifu.core.__all__ if f"`{name}`" not in page]
    assert not missing, f"shifu.core names docs/concepts/algorithms.md does not explain: {missing}"


# README, docs, docstrings and comments speak of the product as it is; history is in git log and CHANGELOG.md
DIARY = re.compile(r"\bsession\b|this machine|development machine|not met|we tried", re.I)
DATED_HEADING = re.compile(r"^#+ .*\b\d{4}-\d{2}-\d{2}\b", re.M)
# in code: the same words (pytest's scope="session" and start_new_session are not diary), dates, and pointers
# to the experiment notes that docs/benchmarks/ replaced
CODE_DIARY = re.compile(
    r"(?<!scope=\")(?<!new_)\bsession\b(?!\"|-scoped)|this machine|development machine|\bnot met\b|we tried|"
    r"later the same day|\b20\d\d-\d\d-\d\d\b|frontier\.md|performance\.md",
    re.I,
)


# where "session" is the product's own word: the policy gateway's recorded sessions (an agent's episode, named by
# its API key; POST /rl/start_session) and the rollout source built on them
SESSION_TERM = (
    "shifu/gateway/",
    "shifu/rollout/",
    "docs/how-to/policy-endpoint.md",
    "docs/how-to/agents.md",
    "tests/test_agent",  # test_agent.py, test_agents_sdk.py
    "tests/test_gateway",  # test_gateway.py, test_gateway_stream.py, test_gateway_forced.py, test_gateway_dialects.py
    "tests/test_http_fuzz.py",
    "tests/schemathesis_hooks.py",
)


def diary(match: re.Match, path: Path) -> bool:
    """A diary word, unless it is the gateway's "session" in a file about it."""
    term = match.group(0).lower() == "session"
    return not (term and str(path.relative_to(ROOT)).startswith(SESSION_TERM))


def test_readme_and_docs_speak_of_the_product():
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for match in [m for m in DIARY.finditer(text) if diary(m, page)] + [*DATED_HEADING.finditer(text)]:
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{page.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_code_comments_and_docstrings_speak_of_the_product():
    found = []
    files = [
        *sorted((ROOT / "shifu").rglob("*.py")),
        *sorted((ROOT / "shifu").rglob("*.yaml")),
        *sorted((ROOT / "benchmarks").glob("*.py")),
        *sorted((ROOT / "tests").rglob("*.py")),
    ]
    for path in files:
        if path.name == "test_docs.py":
            continue
        text = path.read_text(encoding="utf-8")
        for match in [m for m in CODE_DIARY.finditer(text) if diary(m, path)]:
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_readme_is_short_and_keeps_its_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for command in (
        "make setup",
        "pip install",
        "make quickstart",
        "make test",
        "make test-fast",
        "--threads 1",
    ):
        assert command in text, command
    assert "<!-- BEGIN results:quickstart -->" in text and "<!-- END results:quickstart -->" in text


def test_your_own_data_ppo_table_states_the_defaults():
    """The getting-started page's table of PPO settings gives each key's default as the schema has it
    (``off`` / ``none``: null)."""
    import yaml

    from shifu.config.loader import lookup, to_dict
    from shifu.config.schema import PPOConfig

    text = (DOCS / "getting-started" / "your-own-data.md").read_text(encoding="utf-8")
    table = text.split("The settings to look at first:", 1)[1].split("\n\n", 2)[1]
    defaults = to_dict(PPOConfig())
    checked = 0
    for row in table.splitlines()[2:]:
        keys_cell, values_cell = row.strip("|").split(" | ")[:2]
        keys = re.findall(r"`([^`]+)`", keys_cell)
        values = [v.strip() for v in values_cell.split(",")]
        if len(values) == 1:  # one value for every key of the row
            values *= len(keys)
        assert len(values) == len(keys), row
        for key, shown in zip(keys, values):
            value = None if shown in ("off", "none") else yaml.safe_load(shown.strip("`"))
            with contextlib.suppress(TypeError, ValueError):  # (YAML 1.1 reads 1e-5 as a string)
                value = float(value) if isinstance(value, str) else value
            assert value == lookup(defaults, key), (
                f"{key}: the page says {shown}, the default is {lookup(defaults, key)}"
            )
            checked += 1
    assert checked >= 15

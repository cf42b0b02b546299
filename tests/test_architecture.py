"""The layout the code promises: docs/reference/architecture.md names every module, the package is grouped
into wings that import only downwards, imports form no cycle, the math core and torch.distributed stay where
they belong, and the trainers stay short and branch-free."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "shifu"
# The wings of shifu/, lowest first (docs/reference/architecture.md): a module imports only from its own wing and
# from wings before it in this list. Nothing in shifu/ imports the CLI.
WINGS = [
    "core",
    "runs",
    "config",
    "models",
    "data",
    "parallel",
    "rewards",
    "envs",
    "generation",
    "http",
    "gateway",
    "rollout",
    "evaluation",
    "tasks",
    "reporting",
    "trainers",
    "pipelines",
    "study",
    "demo",
    "bench",
    "serve",
    "cli",
]
FLAT = {"__init__.py", "__main__.py", "errors.py"}
DATA = {"presets"}  # folders of shipped settings (YAML), not code
MAX_LINES = 500
# numeric literals in one module-level assignment: more make a table of settings, which goes to shifu/presets
MAX_NUMBERS = 10


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """The shifu modules ``name`` imports, anywhere in the file (functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y / from . import y
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    known = modules()
    return {m for m in found if m in known and m != name}


def test_architecture_doc_names_every_module():
    text = (ROOT / "docs" / "reference" / "architecture.md").read_text()
    block = text.split("```")[1]
    documented, stack = set(), []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if entry.endswith("/"):
            stack.append((indent, entry.rstrip("/")))
        elif entry.endswith(".py"):
            documented.add("/".join([d for _, d in stack] + [entry]))
    on_disk = {str(p.relative_to(ROOT)) for p in modules().values()}
    assert documented == on_disk, (
        f"undocumented: {sorted(on_disk - documented)}; documented but missing: {sorted(documented - on_disk)}"
    )


def test_no_import_cycle():
    graph = {name: imports(name, path) for name, path in modules().items()}
    done, path = set(), []

    def visit(node: str) -> None:
        if node in path:
            cycle = path[path.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for name in graph:
        visit(name)


def test_layering():
    allowed_trainer_users = {
        "shifu.cli.main",
        "shifu.bench.timing",
        "shifu.pipelines.stages",
        "shifu.pipelines.quickstart",
        "shifu.study.frontier",
    }
    for name, path in modules().items():
        deps = imports(name, path)
        if not name.startswith("shifu.trainers") and name not in allowed_trainer_users:
            assert not any(d.startswith("shifu.trainers") for d in deps), f"{name} imports a trainer"
        if name.startswith("shifu.core"):
            assert all(d.startswith("shifu.core") for d in deps), f"{name} imports {deps}"
        raw = [
            n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
        ]
        modules_imported = [a.name for n in raw if isinstance(n, ast.Import) for a in n.names] + [
            n.module or "" for n in raw if isinstance(n, ast.ImportFrom) and not n.level
        ]
        if not name.startswith("shifu.parallel"):  # the parallel wing is where processes talk to each other
            names = modules_imported + [a.name for n in raw if isinstance(n, ast.ImportFrom) for a in n.names]
            assert not any(m.startswith("torch.distributed") for m in names), (
                f"{name} touches torch.distributed"
            )
        if name != "shifu.parallel.deepspeed":  # the DeepSpeed backend is its one user
            assert not any(m.split(".")[0] == "deepspeed" for m in modules_imported), (
                f"{name} imports deepspeed"
            )


def test_trainers_are_short_and_have_no_world_size_or_deepspeed_branch():
    for path in sorted((PKG / "trainers").glob("*.py")):
        source = path.read_text()
        assert len(source.splitlines()) <= 300, f"{path.name}: {len(source.splitlines())} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                test = ast.unparse(node.test)
                assert not re.search(r"world|deepspeed|rank", test, re.I), f"{path.name}: branch on `{test}`"


SOURCE_TYPES = {
    "Environment",
    "Episodes",
    "SingleTurn",
    "AgentEpisodes",
    "RewardSource",
    "RemoteReward",
    "Gateway",
}


def test_trainers_never_ask_which_source_made_a_batch():
    """The trainers read the one trajectory batch (shifu.rollout): no trainer module imports the environments or
    the gateway, or tests the type of a source, an environment or a reward (a new way to make trajectories is a
    new source, not a branch in a trainer)."""
    for name, path in modules().items():
        if not name.startswith("shifu.trainers"):
            continue
        deps = imports(name, path)
        assert not any(d.startswith(("shifu.envs", "shifu.gateway")) for d in deps), f"{name} imports {deps}"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "type"):
                named = {n.id for a in node.args[1:] for n in ast.walk(a) if isinstance(n, ast.Name)}
                named |= {n.attr for a in node.args[1:] for n in ast.walk(a) if isinstance(n, ast.Attribute)}
                assert not named & SOURCE_TYPES, (
                    f"{name}:{node.lineno} tests a source's type: {ast.unparse(node)}"
                )


# the settings that name a rollout source, and the modules that build sources from them (and the config wing,
# which defines and checks them): everyone else asks the source (SourceDescription) or rollout.build.describe
SOURCE_KEYS = {
    "env.factory",
    "agent.factory",
    "verifiers.taskset",
    "reward.url",
    "reward.function",
    "reward.model_path",
}
READS = {"lookup", "get", "getattr"}  # calls that read a setting by its key
SOURCE_BUILDERS = {
    "shifu.rollout.build",
    "shifu.rollout.sources",
    "shifu.rollout.episodes",
    "shifu.rollout.agent",
}


def source_reads(tree: ast.AST) -> list[str]:
    """Where ``tree`` reads which source settings name: an attribute chain ``x.env.factory``,
    ``x.agent.factory``, ``x.reward.url`` / ``.function`` / ``.model_path``, or one of :data:`SOURCE_KEYS` as
    a subscript or an argument of a lookup (``s["env.factory"]``, ``lookup(config, "env.factory")``; a key
    named in a message, ``typed_key("env.factory")``, reads nothing)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            key = f"{node.value.attr}.{node.attr}"
            if key in SOURCE_KEYS:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in READS:
            keys = [*node.args, *(k.value for k in node.keywords)]
        for k in keys:
            if isinstance(k, ast.Constant) and k.value in SOURCE_KEYS:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_source_builders_ask_which_source_the_settings_name():
    """A rollout source answers for itself (its SourceDescription: kind, how it is scored, what it records):
    outside the modules that build sources and the config wing, nothing reads env.factory, agent.factory or
    which reward the settings name."""
    bad = []
    for name, path in modules().items():
        if name in SOURCE_BUILDERS or name.startswith("shifu.config"):
            continue
        bad += [f"{name}:{where}" for where in source_reads(ast.parse(path.read_text()))]
    assert not bad, "\n".join(bad)


def test_the_source_read_finder_sees_each_way_of_asking():
    code = (
        "cfg.env.factory\nif cfg.agent.factory: pass\ncfg.reward.url\ns['reward.function']\n"
        "lookup(config, 'reward.model_path')\nsection.get('factory')\nKEYS = ('env.factory',)\n"
        "typed_key('env.factory')\n"
    )
    assert len(source_reads(ast.parse(code))) == 5


def wing_of(name: str) -> str | None:
    """The wing of a dotted module name (``shifu.runs.checkpoint`` -> ``runs``); None for a flat module."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def test_every_module_lives_in_a_wing_and_flat_ones_are_few():
    flat = {p.name for p in PKG.glob("*.py")}
    assert flat == FLAT, f"modules left flat in shifu/: {sorted(flat - FLAT)} (put them in a wing)"
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WINGS) | DATA, (
        f"sub-packages that are not wings: {sorted(folders ^ (set(WINGS) | DATA))}"
    )
    for data in DATA:
        code = [str(p.relative_to(ROOT)) for p in (PKG / data).rglob("*") if p.suffix in (".py", ".pyc")]
        assert not code, f"shifu/{data}/ holds settings, not code: {code}"
    for wing in WINGS:
        init = PKG / wing / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 12, f"{init}: the wing needs a one-paragraph docstring"


def test_wings_import_only_downwards_and_nothing_imports_the_cli():
    rank = {w: i for i, w in enumerate(WINGS)}
    bad = []
    for name, path in modules().items():
        mine = wing_of(name)
        for dep in imports(name, path):
            theirs = wing_of(dep)
            if theirs is None:
                continue
            if theirs == "cli" and mine != "cli" and name != "shifu.__main__":  # `python -m shifu`
                bad.append(f"{name} imports {dep} (nothing imports the CLI)")
            elif mine is not None and rank[theirs] > rank[mine]:
                bad.append(f"{name} ({mine}) imports {dep} ({theirs}, a higher wing)")
    assert not bad, "\n".join(bad)


def test_no_module_is_over_the_size_cap():
    """The package's modules and the benchmark scripts (and their table renderers) alike."""
    files = [*PKG.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job, a wing's inside the wing): {long}"


def test_the_models_position_limit_is_asked_in_one_place():
    """``n_positions`` / ``max_position_embeddings`` are read off a config only by
    :func:`shifu.models.positions.position_limit`; every other module asks it."""
    read = re.compile(
        r"getattr\([^)]*[\"'](n_positions|max_position_embeddings)[\"']|config\.(n_positions|max_position_embeddings)\b"
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(PKG.rglob("*.py"))
        if path != PKG / "models" / "positions.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if read.search(line)
    ]
    assert not found, f"position limits read outside shifu/models/positions.py: {found}"


def test_no_formatter_escapes():
    """Code is laid out by ``ruff format``: no comment turns it off (``fmt: skip``, ``fmt: off`` / ``on``) to
    pack code onto long lines under the size caps. A long function is split into named helpers instead
    (ruff's C901 and PLR0915 bound a function's complexity and statements, pyproject.toml)."""
    escape = re.compile(r"\bfmt:\s*(skip|off|on)\b")
    found = []
    for folder in ("shifu", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
            found += [
                f"{path.relative_to(ROOT)}:{t.start[0]}"
                for t in tokens
                if t.type == tokenize.COMMENT and escape.search(t.string)
            ]
    assert not found, f"formatter escapes (remove them and let ruff format lay the code out): {found}"


def numbers_in(node: ast.AST) -> int:
    """The numeric literals (not booleans) anywhere under ``node``."""
    return sum(
        isinstance(n, ast.Constant)
        and isinstance(n.value, (int, float, complex))
        and not isinstance(n.value, bool)
        for n in ast.walk(node)
    )


def test_no_module_level_constant_holds_more_than_ten_numbers():
    """Settings (plans, budgets, presets) live in shifu/presets/*.yaml, checked by the config schema; a
    module-level assignment with more than MAX_NUMBERS numeric literals is a table of settings in code."""

    def top_level(body: list[ast.stmt]):
        for stmt in body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                yield stmt
            elif isinstance(stmt, (ast.If, ast.Try, ast.With)):  # blocks still at module level
                for block in ("body", "orelse", "finalbody"):
                    yield from top_level(getattr(stmt, block, []))
                for handler in getattr(stmt, "handlers", []):
                    yield from top_level(handler.body)

    big = {}
    for path in sorted(PKG.rglob("*.py")):
        for stmt in top_level(ast.parse(path.read_text()).body):
            if (n := numbers_in(stmt)) > MAX_NUMBERS:
                big[f"{path.relative_to(ROOT)}:{stmt.lineno}"] = n
    assert not big, (
        f"module-level constants with more than {MAX_NUMBERS} numbers (move them to shifu/presets): {big}"
    )


def test_the_number_count_sees_a_table_of_settings():
    table = ast.parse("PLANS = {'a': {'lr': 1e-3, 'steps': [1, 2, 3, 4, 5]}, 'b': (6, 7, 8, -9.5, 10, 11)}")
    assert numbers_in(table.body[0]) == 12
    assert numbers_in(ast.parse("FLAGS = (True, False, None, 'x', 3)").body[0]) == 1

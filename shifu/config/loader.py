"""The config machinery: frozen dataclasses, YAML presets, ``key.sub=value`` overrides.

The settings shifu ships (quickstart plans, study budgets, task presets) are YAML files under
``shifu/presets/`` (:func:`shipped`), each section checked by the schema of what reads it
(:func:`check_section`, :func:`read_shipped`), so a wrong key in one is reported as in a user's config.

Every field is declared with :func:`opt`, whose ``help`` is the field's documentation (shown by
``shifu CMD --help-config``). Unknown keys and wrongly typed values are rejected by name, a key that was
renamed is rejected with its new name (a config class's ``RENAMED`` table), and each command's config class
adds its own ``validate()`` for impossible combinations (with :func:`require_positive` and
:func:`require_finite`). The sections are in :mod:`shifu.config.sections`, the commands in
:mod:`shifu.config.schema`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from shifu.errors import ConfigError

T = TypeVar("T")


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    """A config field with its documentation. Mutable defaults (lists, dicts, dataclasses) are copied.
    ``choices``: the values the field's validation accepts, when its type does not say them (a ``Literal``
    type does); ``--help-config`` lists them."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if dataclasses.is_dataclass(default) or isinstance(default, (list, dict)):
        proto = default
        return dataclasses.field(default_factory=lambda: _copy(proto), metadata=meta, **kwargs)
    return dataclasses.field(default=default, metadata=meta, **kwargs)


def _copy(x: Any) -> Any:
    import copy

    return copy.deepcopy(x)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config class (cached: every config read resolves them again otherwise)."""
    return typing.get_type_hints(cls)


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Coerce ``value`` to the annotated type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _check_union(value, tp, key)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return [_check_type(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping of {tp.__name__} fields")
        return from_dict(tp, value, prefix=key + ".")
    return _check_scalar(value, tp, key)


def _check_union(value: Any, tp: Any, key: str) -> Any:
    """:func:`_check_type` for ``X | Y`` (``Optional`` included): the first member type ``value`` passes."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return _check_type(value, a, key)
        except ConfigError as e:
            errors.append(str(e))
    if len(errors) == 1:  # e.g. Literal[...] | None: name the allowed values
        raise ConfigError(f"{errors[0]} (or null)")
    raise ConfigError(f"config key '{key}': {value!r} is not a valid {tp}")


def _check_scalar(value: Any, tp: Any, key: str) -> Any:
    """:func:`_check_type` for ``bool``, ``int``, ``float`` and ``str`` (any other type: ``value`` as it is)."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected true/false, got {value!r}")
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-3" as a string
            value = float(value)
        except ValueError:
            pass
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
    return value


def require_positive(cfg, keys: tuple[str, ...], prefix: str = "") -> None:
    """ConfigError naming the first of ``keys`` whose value on ``cfg`` is below 1."""
    for key in keys:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{prefix}{key} must be >= 1 (got {getattr(cfg, key)})")


def require_finite(cfg, prefix: str = "") -> None:
    """ConfigError naming the first float field (of ``cfg`` and its sections) that is NaN or infinite."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            require_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name} must be a finite number (got {value})")


def unknown_key(key: str, valid) -> ConfigError:
    """The error for a config key no section has, naming the valid keys of the section it is in and, when one
    is close in spelling, the key that was probably meant."""
    import difflib

    head = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(head, sorted(valid), n=1, cutoff=0.75)
    prefix = key[: len(key) - len(head)]
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'.{hint} Valid keys here: {', '.join(sorted(valid))}")


def keys_named(cls: type, name: str, prefix: str = "") -> list[str]:
    """Every dotted key of dataclass ``cls`` whose last part is ``name`` (``lr`` -> ``optim.lr``, ...)."""
    found = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if f.name == name:
            found.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            found += keys_named(tp, name, f"{prefix}{f.name}.")
    return found


def with_key_hint(cls: type, e: ConfigError) -> ConfigError:
    """``e`` (an unknown key error) with the keys elsewhere in the tree that carry that name, if any: a
    key written at the top level that lives in a section (``lr`` is ``optim.lr``)."""
    msg = str(e)
    if not msg.startswith("unknown config key '") or "Did you mean" in msg:
        return e
    key = msg.split("'")[1]
    elsewhere = [k for k in keys_named(cls, key.rsplit(".", 1)[-1]) if k != key]
    if not elsewhere:
        return e
    where = " or ".join(f"'{k}'" for k in elsewhere[:4])
    return ConfigError(
        msg.replace(
            f"unknown config key '{key}'.",
            f"unknown config key '{key}'. '{key.rsplit('.', 1)[-1]}' is {where}.",
            1,
        )
    )


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a nested mapping; unknown keys are an error naming the valid ones."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise unknown_key(prefix + unknown[0], names)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        f = fields[k]
        if (
            dataclasses.is_dataclass(hints[k])
            and isinstance(v, dict)
            and f.default_factory is not dataclasses.MISSING
        ):
            # a partial section keeps the field's own defaults (e.g. critic.optim.lr), not the class's
            v = _merge(dataclasses.asdict(f.default_factory()), v)
        kwargs[k] = _check_type(v, hints[k], prefix + k)
    return cls(**kwargs)


def check_key(cls: type, dotted: str, prefix: str = "") -> None:
    """ConfigError unless ``dotted`` (``kl.init_coef``) names a field of dataclass ``cls``, section by
    section; a key below a field that is not a config section (a mapping, an optional section) is not
    looked into."""
    head, _, rest = dotted.partition(".")
    names = {f.name for f in dataclasses.fields(cls)}
    if head not in names:
        raise unknown_key(prefix + head, names)
    tp = _hints(cls)[head]
    if rest and dataclasses.is_dataclass(tp):
        check_key(tp, rest, f"{prefix}{head}.")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def with_values(cfg: T, values: dict[str, Any]) -> T:
    """``cfg`` with the dotted keys of ``values`` replaced (``{"critic.init": "sft"}``), not re-validated:
    what a run actually used where it could not do what its config said, for ``config.yaml`` to record."""
    for dotted, value in values.items():
        head, _, rest = dotted.partition(".")
        if rest:
            value = with_values(getattr(cfg, head), {rest: value})
        cfg = dataclasses.replace(cfg, **{head: value})
    return cfg


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"config override '{dotted}': '{p}' is not a section")
        node = nxt
    node[parts[-1]] = value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with safe loading; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
        raise ConfigError(f"config file '{p}'{where} is not valid YAML: {what or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 text: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of keys, not {type(data).__name__}")
    return data


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=3", "c=x"]`` -> nested dict; values parsed as YAML scalars (``3`` int, ``true`` bool)."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_path(tree, key.strip(), value)
    return tree


def lookup(tree: dict[str, Any], dotted: str, missing: Any = None) -> Any:
    """``tree["a"]["b"]`` for ``"a.b"``; ``missing`` when any part is absent."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def check_renamed(cls: type, data: dict[str, Any]) -> None:
    """ConfigError for the first key of ``data`` that ``cls.RENAMED`` lists as an old name."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if lookup(data, old, missing=KeyError) is not KeyError:
            raise ConfigError(f"config key '{old}' was renamed to '{new}': write {new}=... instead")


def load_config(
    cls: type[T],
    config_file: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> T:
    """defaults <- ``base`` (a preset mapping) <- YAML file <- overrides, then ``validate()``."""
    data: dict[str, Any] = dict(base or {})
    if config_file is not None:
        data = _merge(data, read_yaml(config_file))
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = _merge(data, ov)
    check_renamed(cls, data)
    try:
        cfg = from_dict(cls, data)
    except ConfigError as e:
        raise with_key_hint(cls, e) from None
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def allowed_values(tp: Any, field: dataclasses.Field | None = None) -> tuple[Any, ...] | None:
    """The values a field accepts when they are a fixed set (None otherwise): the field's ``choices``, or
    its ``Literal`` type's values, also inside ``X | None`` and ``list[X]`` (null is not listed)."""
    if field is not None and "choices" in field.metadata:
        return field.metadata["choices"]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return typing.get_args(tp)
    if origin in (typing.Union, types.UnionType, list, tuple):
        for arg in typing.get_args(tp):
            values = allowed_values(arg)
            if values is not None:
                return values
    return None


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every field, nested sections flattened; for ``--help-config`` and docs.
    A field with a fixed set of values ends its help with them: ``(one of 'a', 'b')``, as its error says."""
    rows = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, prefix + f.name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_ = f.metadata.get("help", "")
        values = allowed_values(tp, f)
        if values is not None:
            each = "each " if typing.get_origin(tp) in (list, tuple) else ""
            help_ += f" ({each}one of {', '.join(map(repr, values))})"
        rows.append((prefix + f.name, repr(default), help_))
    return rows


# ------------------------------------------------------------------------------------ shipped settings
SHIPPED = Path(__file__).resolve().parents[1] / "presets"


def shipped(*parts: str) -> Path:
    """A file or folder of the settings shipped inside the package: ``shifu/presets/<parts>``."""
    return SHIPPED.joinpath(*parts)


def _number_as_text(tree: Any, key: str = "") -> tuple[str, str] | None:
    """The first (key, value) whose value is text that reads as a number (YAML 1.1 reads ``1e-3`` as text)."""
    if isinstance(tree, dict):
        children = [(f"{key}.{k}" if key else str(k), v) for k, v in tree.items()]
    elif isinstance(tree, list):
        children = [(f"{key}[{i}]", v) for i, v in enumerate(tree)]
    else:
        if isinstance(tree, str):
            with contextlib.suppress(ValueError):
                float(tree)
                return key, tree
        return None
    for k, v in children:
        if found := _number_as_text(v, k):
            return found
    return None


def read_shipped(path: str | Path) -> dict[str, Any]:
    """A shipped settings file (:func:`read_yaml`) whose numbers are all numbers: ``1e-3`` (text to YAML) is
    refused, naming the file and key, so that what a plan records is what it says."""
    data = read_yaml(path)
    if (found := _number_as_text(data)) is not None:
        raise ConfigError(
            f"config file '{path}': '{found[0]}' is a number written as text ({found[1]!r}); "
            "write it with a decimal point, e.g. 1.0e-3"
        )
    return data


def read_shipped_table(path: str | Path, cls: type[T]) -> dict[str, T]:
    """A shipped file of named entries (``tiny: {...}``), each checked (:func:`check_section`) and built
    as ``cls``, in the file's order."""
    table = {}
    for name, section in read_shipped(path).items():
        check_section(cls, section, f"config file '{path}', entry '{name}'")
        table[str(name)] = from_dict(cls, section)
    return table


def check_section(cls: type, section: Any, where: str, fill: dict[str, Any] | None = None) -> None:
    """ConfigError, prefixed with ``where`` (the file and its section), unless ``section`` is a valid config
    of ``cls``, as :func:`load_config` checks a user's: no unknown key, every value of its type, and the
    class's ``validate()``. ``fill``: what a run fills in (paths), laid under the section. Nothing is kept:
    the section is used as it is written."""
    try:
        if not isinstance(section, dict):
            raise ConfigError(f"expected a mapping of {cls.__name__} keys, got {section!r}")
        load_config(cls, base=_merge(fill or {}, section))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def group_size_advice(batch_size: int, group_size: int, minibatch_size: int) -> str:
    """What to change when ``batch_size`` (responses per rollout) is not a whole number of groups of
    ``group_size``: the nearest batch sizes that are (and stay multiples of ``minibatch_size``), or a group
    size that divides it."""
    B, G, mb = batch_size, group_size, minibatch_size
    if G < 1:
        return f"group_size must be >= 1 (got {G}): the number of responses sampled per prompt"
    step = math.lcm(G, mb)
    sizes = [n for n in ((B // step) * step, (B // step + 1) * step) if n > 0]
    fits = [g for g in range(2, B + 1) if B % g == 0]
    return (
        f"batch_size ({B}) counts responses, group_size ({G}) of them per prompt, so it must be a multiple of "
        f"group_size: set batch_size={' or batch_size='.join(map(str, sizes))} (a multiple of group_size and of "
        f"minibatch_size {mb}), or a group_size that divides {B} ({', '.join(map(str, fits[:5]))}"
        f"{', ...' if len(fits) > 5 else ''})"
    )

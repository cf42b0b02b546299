"""User code named in a config: ``"package.module:Name"`` for reward functions, gold judges, environments and
agents, one loader for all of them (:func:`load_callable`), and the config keys as the user typed them
(:func:`typed_key`: ``env.factory`` in ``shifu ppo``, ``ppo.env.factory`` in a ``shifu quickstart`` plan).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from shifu.errors import ConfigError, user_code

# the prefix of every config key a message names: "" for a trainer's own config, "ppo." while a pipeline
# runs its ppo stage (the plan's keys are ppo.env.factory, ...)
_PREFIX: contextvars.ContextVar[str] = contextvars.ContextVar("shifu_key_prefix", default="")


def typed_key(key: str) -> str:
    """``key`` (a trainer config's own, e.g. ``env.factory``) as the user typed it where the message is shown."""
    return _PREFIX.get() + key


@contextlib.contextmanager
def key_prefix(prefix: str) -> Iterator[None]:
    """Messages inside name keys with ``prefix`` in front (a pipeline's stage: ``"ppo."``)."""
    token = _PREFIX.set(prefix)
    try:
        yield
    finally:
        _PREFIX.reset(token)


def import_from_cwd(mod_name: str, what: str):
    """Import ``mod_name`` as ``python -m`` would from the working directory: the directory the command runs
    in is searched after the installed packages (as uvicorn and gunicorn do for ``module:app``), so a
    ``mytask/rewards.py`` next to where ``shifu`` is started is found. ConfigError naming ``what`` if not."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"{what}: cannot import module '{mod_name}' ({e}). It is looked up in the installed packages, the "
            f"working directory ({cwd}) and PYTHONPATH: run shifu from the directory that holds "
            f"{mod_name.split('.')[0]}/ (or {mod_name.split('.')[0]}.py), or add that directory to PYTHONPATH"
        ) from None


class UserFunction:
    """A user's function loaded from ``"package.module:name"`` (a reward function, a gold judge), called as the
    function itself: an exception raised inside becomes a :class:`UserCodeError` naming ``key`` and ``spec``
    and the user's file:line (:func:`shifu.errors.describe_exception`), raised from the original."""

    def __init__(self, fn: Callable[..., Any], spec: str, key: str):
        self.fn, self.spec, self.key = fn, spec, key
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with user_code(f"{self.key} {self.spec}"):
            return self.fn(*args, **kwargs)


def load_callable(spec: Any, key: str, kind: str = "function") -> Callable[..., Any]:
    """The function or class ``"package.module:Name"`` names, for the config key ``key`` (as the user typed it,
    :func:`typed_key`); ``kind`` says what is expected (``function``, ``class or factory``). A ConfigError says
    what to write otherwise. A ``function`` comes back as a :class:`UserFunction`: its exceptions name it and
    the user's file:line."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{key} '{spec}' must look like 'package.module:Name' (a {kind})")
    mod_name, name = spec.split(":")
    module = import_from_cwd(mod_name, f"{key} '{spec}'")
    found = getattr(module, name, None)
    if not callable(found):
        raise ConfigError(f"{key} '{spec}': module '{mod_name}' has no {kind} '{name}'")
    return UserFunction(found, spec, key) if kind == "function" else found

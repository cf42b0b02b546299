"""Errors that reach the user as a clear message and exit status 2 (the traceback only with ``--verbose``), and
the wording of an exception raised in the user's own code (:class:`UserCodeError`, :func:`user_code`)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sysconfig
import traceback
from collections.abc import Iterator

# set by ``--verbose`` (any command) while the command runs; also read from the environment by its processes
VERBOSE_ENV = "SHIFU_VERBOSE"


def verbose() -> bool:
    """Whether ``--verbose`` was given (or ``SHIFU_VERBOSE`` is set): errors then come with their traceback."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class ShifuError(Exception):
    """An error the user can fix: the message says what was wrong, where, and what to do."""

    exit_code = 2


class ConfigError(ShifuError):
    """An unknown key, a wrongly typed value or an impossible combination in a config."""


class DataError(ShifuError):
    """Bad input data. Names the file, the line (1-based) or row, and the field."""

    def __init__(self, path: str, line: int | None, field: str | None, problem: str, hint: str = ""):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        where = self.path
        if line is not None:
            where += f", line {line}"
        if field is not None:
            where += f", field '{field}'"
        msg = f"{where}: {problem}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


class OutputDirError(ShifuError):
    """The output directory exists and is not empty, or cannot be written."""


class UserCodeError(ShifuError):
    """An exception raised inside the user's own code (a reward function, a gold judge, an environment, an
    agent). The message names the code as the user named it and the user's file and line
    (:func:`describe_exception`); the user's exception is the ``__cause__``, whose traceback ``--verbose``
    prints. Raise it with :func:`user_code` (or ``raise UserCodeError(describe_exception(name, e)) from e``)."""


# the directories whose frames are not the user's: shifu itself, the standard library, installed packages
_SHIFU_DIR = os.path.dirname(os.path.abspath(__file__))
_LIBRARY_DIRS = tuple(
    os.path.abspath(p) for k in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(k))
)


def _is_library(path: str) -> bool:
    path = os.path.abspath(path)
    parts = set(pathlib.PurePath(path).parts)
    return (
        path.startswith(_SHIFU_DIR + os.sep)
        or any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS)
        or bool(parts & {"site-packages", "dist-packages"})
    )


def user_location(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback that is the user's (not in shifu, the
    standard library or an installed package; else the innermost outside shifu), the file relative to the
    working directory when it lies inside it. None when no frame qualifies (the error came from shifu)."""
    frames = [(f.f_code.co_filename, line) for f, line in traceback.walk_tb(error.__traceback__)]
    frames = [(file, line) for file, line in frames if not file.startswith("<")]
    found = next((fl for fl in reversed(frames) if not _is_library(fl[0])), None)
    if found is None:  # the user's code is an installed package: its innermost frame outside shifu
        outside = [(file, line) for file, line in frames if not os.path.abspath(file).startswith(_SHIFU_DIR)]
        found = outside[-1] if outside else None
    if found is None:
        return None
    file = os.path.abspath(found[0])
    with contextlib.suppress(ValueError):  # another drive (Windows)
        rel = os.path.relpath(file)
        file = file if rel.startswith(os.pardir) else rel
    return f"{file}:{found[1]}"


def describe_exception(name: str, error: BaseException) -> str:
    """``"name (file.py:LINE): ExcType: message"`` of an exception raised in the user's code ``name`` (as the
    user named it, e.g. ``reward.function mytask.rewards:score``); the message's first line only."""
    where = user_location(error)
    lines = str(error).strip().splitlines()
    text = type(error).__name__ + (f": {lines[0]}" + (" ..." if len(lines) > 1 else "") if lines else "")
    return f"{name}{f' ({where})' if where else ''}: {text}"


@contextlib.contextmanager
def user_code(name: str) -> Iterator[None]:
    """Run the user's code ``name`` inside: an exception it raises becomes a :class:`UserCodeError` naming it and
    the user's file:line, raised from the original (a ShifuError passes unchanged: it is already worded)::

        with user_code("env.factory games:Guess, step()"):
            step = env.step(action)
    """
    try:
        yield
    except ShifuError:
        raise
    except Exception as e:
        raise UserCodeError(describe_exception(name, e)) from e


def function_name(fn: object) -> str:
    """``module:qualname`` of a function or callable object, as a config would name it."""
    target = getattr(fn, "__wrapped__", fn)
    module = getattr(target, "__module__", None) or "?"
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{name}"

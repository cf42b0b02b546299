"""Errors that reach the user as a clear message and exit status 2, never as a traceback."""

from __future__ import annotations


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

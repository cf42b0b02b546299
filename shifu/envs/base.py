"""The environment interface (public, stable) and the checked calls the episode rollout makes through it.

An environment is any class (or a factory taking keyword arguments) whose instances have::

    reset(row: dict) -> str | list[dict]   # the first input: text for plain tokenizers, chat messages
                                            # ({"role", "content"}) for chat models
    step(action: str) -> Step              # action: the text of exactly the tokens the policy sampled in
                                            # this turn (stop string included, special tokens skipped)

``row`` is the prompt file's row (extra fields such as ``answer`` reach it). One fresh instance per episode,
built as ``factory(**env.kwargs)``; ``env.factory`` names it ``"package.module:Name"``, imported like reward
functions (installed packages, then the working directory). :class:`Environment` holds the factory and makes
every call through checks, several at once on a bounded pool of threads: an exception, a return value of the
wrong type or a call over ``env.step_timeout_s`` becomes an :class:`EnvFault` whose message names the
environment, the row and the turn. How long an episode may run (turns, tokens) is the sampler's business
(:mod:`shifu.rollout.episodes`), not the environment's.

``Step.info`` is the environment's own; two keys are counted when present (numbers): ``tool_calls`` and
``tool_errors`` (the metrics ``env/tool_calls``, ``env/tool_errors``; :class:`shifu.envs.tool.ToolEnv` sets
them). An environment that never reports ``tool_calls`` has its tool use reported as not measured, not as 0.

Optionally, an instance may have::

    truncate() -> float | None    # the episode was cut by a budget (generation.max_turns, a token budget)
                                  # instead of ending with done: its final reward (None: nothing)

as gymnasium tells an environment *truncated* apart from *terminated*: a game scored at its end can still score
an episode the sampler cut. The reward lands on the last sampled token of the episode, added to its last turn's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from shifu.config.imports import load_callable, typed_key
from shifu.envs.pool import TIMED_OUT, CallPool, resolved
from shifu.errors import ConfigError, ShifuError, user_location

ON_ERROR = ("raise", "end_episode")


@dataclasses.dataclass
class Step:
    """What ``env.step(action)`` returns: the observation the policy reads next (text, chat messages, or
    None for nothing), the reward of this turn (it lands on the turn's last sampled token; an episode's
    return is the sum over its turns), whether the episode is over, and anything else in ``info``."""

    observation: str | list[dict] | None = None
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class EnvFault(ShifuError):
    """An environment misbehaved (raised, returned something else than asked, timed out, or gave an
    observation over the budget). The message names the environment, the row and the turn."""


def load_factory(spec: str) -> Callable[..., Any]:
    """The class or factory ``"package.module:Name"`` names; ConfigError saying what to write otherwise."""
    return load_callable(spec, typed_key("env.factory"), "class or function")


def check_messages(value: Any) -> bool:
    """True for a non-empty list of ``{"role": str, "content": str}`` dicts."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )


def describe_row(row: dict) -> str:
    """A row as an error names it: its prompt (or last message), shortened."""
    text = row.get("prompt")
    if not isinstance(text, str) and check_messages(row.get("messages")):
        text = row["messages"][-1]["content"]
    text = str(text)
    return repr(text if len(text) <= 60 else text[:57] + "...")


class Environment:
    """``env`` made usable: the loaded factory and its kwargs, and every call to an instance checked.

    :meth:`start` builds one instance per row and resets it, :meth:`step` steps several instances; both run
    their calls at once on a pool of ``env.concurrency`` threads (environments wait on tools, judges and
    services) with the time limit ``env.step_timeout_s`` per call, and return the outcomes in the order asked:
    the checked result, or the :class:`EnvFault` that names the environment, the row and the turn.
    :meth:`fault` applies ``env.on_error``. Building one imports the factory and makes one instance, so a bad
    ``env.factory`` or ``env.kwargs`` is refused before a run writes anything."""

    def __init__(self, cfg: Any):
        self.name = cfg.factory
        self.factory = load_factory(cfg.factory)
        self.kwargs = dict(cfg.kwargs or {})
        self.step_timeout_s, self.on_error = cfg.step_timeout_s, cfg.on_error
        key = typed_key("env")
        try:
            probe = self.factory(**self.kwargs)
        except Exception as e:  # noqa: BLE001 (whatever the user's code raises is reported, not re-raised)
            raise ConfigError(
                f"{key}.factory '{self.name}' could not be built with {key}.kwargs {self.kwargs}: "
                f"{type(e).__name__}: {e}"
            ) from None
        missing = [m for m in ("reset", "step") if not callable(getattr(probe, m, None))]
        if missing:
            raise ConfigError(
                f"{key}.factory '{self.name}' builds a {type(probe).__name__}, which has no "
                f"{' and no '.join(f'{m}()' for m in missing)} method: an environment needs reset(row) -> first "
                "input and step(action) -> shifu.Step"
            )
        self.pool = CallPool(cfg.concurrency, f"shifu-env {self.name}")

    def where(self, row: dict, turn: int | None) -> str:
        at = "reset" if turn is None else f"turn {turn + 1}"
        return f"environment {self.name}, row {describe_row(row)}, {at}"

    def start(self, rows: list[dict]) -> list[tuple[Any, str | list[dict]] | EnvFault]:
        """A fresh instance per row, reset: ``(instance, first input)`` (text or chat messages) or the fault."""

        def new(row: dict) -> tuple[Any, Any]:
            instance = self.factory(**self.kwargs)
            return instance, resolved(instance.reset(row))

        outcomes = self.pool.run([lambda r=row: new(r) for row in rows], self.step_timeout_s)
        return [self._checked(o, row, None, "reset()", self._first) for o, row in zip(outcomes, rows)]

    def truncate(self, calls: list[tuple[Any, dict, int]]) -> list[float | EnvFault]:
        """``instance.truncate()`` for each ``(instance, row, turn)`` whose instance has one (the episode was
        cut by a budget): its final reward, a finite number (0.0 for None or no such method), or the fault."""

        def call(instance: Any) -> Any:
            end = getattr(instance, "truncate", None)
            return end() if callable(end) else None

        outcomes = self.pool.run([lambda c=c: call(c[0]) for c in calls], self.step_timeout_s)
        return [
            self._checked(o, row, turn, "truncate()", self._final)
            for o, (_, row, turn) in zip(outcomes, calls)
        ]

    def _final(self, value: Any, where: str) -> float:
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EnvFault(
                f"{where}: truncate() returned {_shown(value)}; it must be a finite number or None"
            )
        return float(value)

    def step(self, calls: list[tuple[Any, str, dict, int]]) -> list[Step | EnvFault]:
        """``instance.step(action)`` for each ``(instance, action, row, turn)``: the checked :class:`Step` or
        the fault."""
        outcomes = self.pool.run([lambda c=c: c[0].step(c[1]) for c in calls], self.step_timeout_s)
        return [
            self._checked(o, row, turn, "step()", self._step) for o, (_, _, row, turn) in zip(outcomes, calls)
        ]

    def _checked(
        self, outcome: tuple[Any, BaseException | None], row: dict, turn: int | None, what: str, check
    ):
        value, error = outcome
        where = self.where(row, turn)
        if value is TIMED_OUT:
            key = typed_key("env.step_timeout_s")
            return EnvFault(f"{where}: {what} took longer than {key}={self.step_timeout_s} s")
        if error is not None:  # the user's file:line; --verbose prints the traceback (the fault's cause)
            at = user_location(error)
            fault = EnvFault(
                f"{where}: {what} raised {f'at {at} ' if at else ''}{type(error).__name__}: {error}"
            )
            fault.__cause__ = error
            return fault
        try:
            return check(value, where)
        except EnvFault as e:
            return e

    def _first(self, value: tuple[Any, Any], where: str) -> tuple[Any, str | list[dict]]:
        instance, first = value
        if (isinstance(first, str) and first) or check_messages(first):
            return instance, first
        raise EnvFault(
            f"{where}: reset() returned {_shown(first)}; it must return the first input, a non-empty string or "
            "a list of {'role': ..., 'content': ...} messages"
        )

    def _step(self, out: Any, where: str) -> Step:
        """A :class:`Step` with a finite reward, an observation of text, messages or None, a bool ``done`` and
        a dict ``info``."""
        if not isinstance(out, Step):
            raise EnvFault(
                f"{where}: step() returned {_shown(out)}, not a shifu.Step (from shifu import Step)"
            )
        if (
            isinstance(out.reward, bool)
            or not isinstance(out.reward, (int, float))
            or not math.isfinite(out.reward)
        ):
            raise EnvFault(f"{where}: step() returned the reward {out.reward!r}; it must be a finite number")
        obs = out.observation
        if not (obs is None or isinstance(obs, str) or check_messages(obs)):
            raise EnvFault(
                f"{where}: step() returned the observation {_shown(obs)}; it must be text, a list of "
                "{'role': ..., 'content': ...} messages, or None"
            )
        if not isinstance(out.done, bool) or not isinstance(out.info, dict):
            raise EnvFault(
                f"{where}: step() returned done={out.done!r}, info={_shown(out.info)}; done must be a "
                "bool and info a dict"
            )
        return out

    def fault(self, e: EnvFault) -> None:
        """``env.on_error``: ``raise`` stops the run with the fault and what to do about it; ``end_episode``
        returns (the caller ends that episode with reward 0)."""
        if self.on_error == "raise":
            raise EnvFault(
                f"{e}. Fix the environment, or set {typed_key('env.on_error')}=end_episode to end such episodes "
                "with reward 0 (counted as env/errors)"
            ) from e.__cause__


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"

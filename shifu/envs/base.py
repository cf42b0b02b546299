"""The environment interface (public, stable) and the checked calls the episode rollout makes through it.

An environment is any class (or a factory taking keyword arguments) whose instances have::

    reset(row: dict) -> str | list[dict]   # the first input: text for plain tokenizers, chat messages
                                            # ({"role", "content"}) for chat models
    step(action: str) -> Step              # action: the text of exactly the tokens the policy sampled in
                                            # this turn (stop string included, special tokens skipped)

``row`` is the prompt file's row (extra fields such as ``answer`` reach it). One fresh instance per episode,
built as ``factory(**ppo.env.kwargs)``; ``ppo.env.factory`` names it ``"package.module:Name"``, imported like
reward functions (installed packages, then the working directory). :class:`Environment` holds the factory and
the limits of ``ppo.env`` and makes every call through checks: an exception, a return value of the wrong
type, a call over ``step_timeout_s`` or an observation that can never fit the token budget becomes an
:class:`EnvFault` whose message names the environment, the row and the turn.

``Step.info`` is the environment's own; two keys are counted when present (numbers): ``tool_calls`` and
``tool_errors`` (the metrics ``env/tool_calls``, ``env/tool_errors``; :class:`shifu.envs.tool.ToolEnv` sets
them).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

from shifu.config.imports import load_callable, typed_key
from shifu.errors import ConfigError, ShifuError

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
    """``ppo.env`` made usable: the loaded factory, its kwargs and the episode limits.

    :meth:`make`, :meth:`reset` and :meth:`step` call the environment through the checks of the module
    docstring. Building one imports the factory and makes one instance, so a bad ``ppo.env.factory`` or
    ``ppo.env.kwargs`` is refused before a run writes anything."""

    model = None  # (an environment is the reward of its episodes: no reward model to place)

    def __init__(self, cfg: Any):
        self.name = cfg.factory
        self.factory = load_factory(cfg.factory)
        self.kwargs = dict(cfg.kwargs or {})
        self.max_turns, self.stop = cfg.max_turns, tuple(cfg.stop)
        self.max_tokens_per_turn, self.max_total_tokens = cfg.max_tokens_per_turn, cfg.max_total_tokens
        self.step_timeout_s, self.on_error = cfg.step_timeout_s, cfg.on_error
        try:
            probe = self.factory(**self.kwargs)
        except Exception as e:  # noqa: BLE001 (whatever the user's code raises is reported, not re-raised)
            raise ConfigError(
                f"ppo.env.factory '{self.name}' could not be built with ppo.env.kwargs {self.kwargs}: "
                f"{type(e).__name__}: {e}"
            ) from None
        missing = [m for m in ("reset", "step") if not callable(getattr(probe, m, None))]
        if missing:
            raise ConfigError(
                f"ppo.env.factory '{self.name}' builds a {type(probe).__name__}, which has no "
                f"{' and no '.join(f'{m}()' for m in missing)} method: an environment needs reset(row) -> first "
                "input and step(action) -> shifu.Step"
            )

    def where(self, row: dict, turn: int | None) -> str:
        at = "reset" if turn is None else f"turn {turn + 1}"
        return f"environment {self.name}, row {describe_row(row)}, {at}"

    def make(self, row: dict) -> Any:
        """A fresh instance for one episode."""
        return self._call(lambda: self.factory(**self.kwargs), row, None, "building it")

    def reset(self, env: Any, row: dict) -> str | list[dict]:
        """``env.reset(row)``, checked: text or chat messages."""
        first = self._call(lambda: env.reset(row), row, None, "reset()")
        if isinstance(first, str) and first:
            return first
        if check_messages(first):
            return first
        raise EnvFault(
            f"{self.where(row, None)}: reset() returned {_shown(first)}; it must return the first input, a "
            "non-empty string or a list of {'role': ..., 'content': ...} messages"
        )

    def step(self, env: Any, action: str, row: dict, turn: int) -> Step:
        """``env.step(action)``, checked: a :class:`Step` with a finite reward, an observation of text,
        messages or None, a bool ``done`` and a dict ``info``."""
        out = self._call(lambda: env.step(action), row, turn, "step()")
        where = self.where(row, turn)
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

    def _call(self, fn: Callable[[], Any], row: dict, turn: int | None, what: str) -> Any:
        """``fn()`` with the per-call timeout (a thread; one that never returns is left behind, daemonic)."""
        where = self.where(row, turn)
        if self.step_timeout_s is None:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001
                raise EnvFault(f"{where}: {what} raised {type(e).__name__}: {e}") from e
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread below)
                box["error"] = e

        worker = threading.Thread(target=run, name=f"shifu-env {self.name}", daemon=True)
        worker.start()
        worker.join(self.step_timeout_s)
        if worker.is_alive():
            raise EnvFault(f"{where}: {what} took longer than ppo.env.step_timeout_s={self.step_timeout_s} s")
        if "error" in box:
            e = box["error"]
            raise EnvFault(f"{where}: {what} raised {type(e).__name__}: {e}") from e
        return box["value"]

    def fault(self, e: EnvFault) -> EnvFault:
        """The error a run stops with (``on_error=raise``): the fault and what to do about it."""
        return EnvFault(
            f"{e}. Fix the environment, or set ppo.env.on_error=end_episode to end such episodes "
            "with reward 0 (counted as env/errors)"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"

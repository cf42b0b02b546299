"""OpenEnv environments (the ``openenv`` package, https://github.com/meta-pytorch/OpenEnv) as shifu environments.

An OpenEnv environment is a server (a FastAPI app built with ``openenv.core.env_server.create_app``) that keeps one
environment per WebSocket connection and answers ``reset``, ``step`` and, for the environments built on its
``MCPEnvironment``, the MCP tool actions ``list_tools`` and ``call_tool``. :class:`OpenEnvEnvironment` is an
ordinary shifu environment (``reset(row)``, ``step(action)``, :mod:`shifu.envs.base`) over that protocol, so an
OpenEnv environment trains, validates and evaluates as every other environment does: through ``env.factory``, the
episode source :class:`shifu.rollout.episodes.Episodes` and its description, with no path of its own. One setting
names it::

    env.factory=shifu.envs.openenv:echo_env

``shifu.envs.openenv:ID`` is :class:`OpenEnvEnvironment` for the installed OpenEnv environment ``ID`` (its Python
package, ``echo_env``, or OpenEnv's short name, ``echo``); the run's source then describes itself as "environment
shifu.envs.openenv:echo_env". ``env.kwargs`` are :class:`OpenEnvEnvironment`'s keyword arguments
(``env.kwargs={action_field: message}``); ``env.factory=shifu.envs.openenv:OpenEnvEnvironment`` with
``env.kwargs={app: my_env.server.app:app}`` names a server app that is not an installed package (a module of the
working directory), ``env.kwargs={base_url: http://HOST:PORT}`` a server already running.

Why a factory rather than settings of its own (``openenv.env=ID``): an OpenEnv environment is an environment, so
naming it where environments are named keeps one rollout interface. Validation, the held-out and final
evaluations, ``shifu eval --env``, quickstart plans, ``torchrun``, ``env.concurrency``, ``env.step_timeout_s``,
``env.on_error`` and the source's description apply unchanged, and nothing that builds sources needs a branch.

The server runs as a local process (``python -m uvicorn APP``, with this process's interpreter and import path),
started once per run and stopped when the run ends; an environment that is only published as a container image
must be started by its user and named by ``base_url``. Its connections: the environments whose app reads
``MAX_CONCURRENT_ENVS`` (OpenEnv's template does) allow ``connections`` at once; a batch holds one connection per
episode.

What the policy reads and writes:

- a text environment (its action has a string field, ``action_field``, found from the server's ``/schema`` when it
  has exactly one): the policy's turn is that field of the action; the observation's string field
  (``observation_field``, or the only one) is what it reads next, else the observation's fields as JSON;
- a tool environment (its action is an MCP ``call_tool``): its tools (``list_tools`` after the reset) are offered
  to the policy in the model's own tool format (:mod:`shifu.rollout.turns`); each ``<tool_call>`` of a turn is a
  ``call_tool`` step, its result (or error) a ``{"role": "tool"}`` message; a turn without a call is the answer:
  ``answer_tool`` (a tool of one string argument) is called with it, else the episode ends there.

The reward is the environment's: the sum of a turn's step rewards lands on that turn; ``done`` ends the episode. A
prompt row resets a task: its ``seed`` (and its ``reset`` object, OpenEnv's reset keywords such as ``{"split":
"test", "index": 12}``) are the reset's arguments; the first input is the reset observation's text (the row's
``prompt`` where it has none).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from shifu.envs.base import Step

EXTRA = "pip install 'shifu-rlhf[openenv]'"
_TEXT = {"done", "reward", "metadata"}  # an observation's fields that are not what the policy reads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (a local server this module started)
        return json.loads(r.read().decode("utf-8"))


class Server:
    """An OpenEnv server app run as a local process: ``python -m uvicorn APP`` on a free port of 127.0.0.1, with
    this process's import path (what imports here imports there) and ``MAX_CONCURRENT_ENVS=connections``; ready when
    ``/health`` answers. Its output goes to a log file, whose end a failed start quotes."""

    def __init__(self, app: str, connections: int, start_timeout_s: float):
        self.app, port = app, _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="shifu-openenv-", suffix=".log", delete=False)
        env = dict(os.environ, MAX_CONCURRENT_ENVS=str(connections), ENABLE_WEB_INTERFACE="false")
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *[p for p in sys.path if p]])
        command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                self.fail(f"exited with code {self.process.returncode}")
            try:
                _get_json(f"{self.url}/health", timeout=2.0)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.fail(
                        f"did not answer {self.url}/health within {start_timeout_s} s (env.kwargs.start_timeout_s)"
                    )
                time.sleep(0.2)

    def fail(self, what: str) -> None:
        """Stop the server and raise what went wrong, with the end of its output."""
        tail = self.tail()
        self.stop()
        raise RuntimeError(f"the OpenEnv server {self.app} {what}: {tail}")

    def tail(self, n: int = 1500) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            text = f.read()
        return text[-n:].strip() or "(no output)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


_SERVERS: dict[tuple[str, int], Server] = {}
_STARTING = threading.Lock()  # instances are built on the episode pool's threads: one server per app


def server(app: str, connections: int = 256, start_timeout_s: float = 60.0) -> Server:
    """The running server of ``app`` (started on first use, stopped when this process exits)."""
    with _STARTING:
        key = (app, connections)
        if key in _SERVERS and _SERVERS[key].process.poll() is not None:  # it died: start it again
            _SERVERS.pop(key).stop()
        if key not in _SERVERS:
            _SERVERS[key] = Server(app, connections, start_timeout_s)
        return _SERVERS[key]


@atexit.register
def stop_servers() -> None:
    """Stop every server this process started."""
    with _STARTING:
        for s in _SERVERS.values():
            s.stop()
        _SERVERS.clear()


def installed_app(env: str) -> str:
    """The server app of the installed OpenEnv environment ``env`` (its package ``echo_env``, or OpenEnv's short
    name ``echo``): the ``app`` its ``openenv.yaml`` names (default ``server.app:app``), inside the package."""
    if "/" in env:
        raise ValueError(
            f"OpenEnv environment {env!r} is a hub id: install the environment's package first (pip install it, "
            "or `openenv fork`/clone it), then name its package"
        )
    base = env.replace("-", "_")
    names = [base] if base.endswith("_env") else [base, f"{base}_env"]
    for module in names:
        spec = importlib.util.find_spec(module)
        for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
            manifest = os.path.join(folder, "openenv.yaml")
            if os.path.isfile(manifest):
                import yaml

                with open(manifest, encoding="utf-8") as f:
                    app = (yaml.safe_load(f) or {}).get("app") or "server.app:app"
                return f"{module}.{app}"
            if os.path.isfile(os.path.join(folder, "server", "app.py")):
                return f"{module}.server.app:app"
    raise ValueError(
        f"no installed OpenEnv environment {env!r} (looked for a package {' or '.join(names)} with an openenv.yaml "
        "or a server/app.py): install it, or name its server app with env.kwargs.app (package.module:app) or a "
        "running server with env.kwargs.base_url"
    )


@functools.cache
def schema(url: str) -> dict:
    """The server's ``/schema``: the JSON schemas of its action and observation."""
    return _get_json(f"{url}/schema")


def _string_fields(model_schema: dict) -> list[str]:
    props = model_schema.get("properties") or {}
    return [k for k, v in props.items() if k not in _TEXT and v.get("type") == "string"]


class OpenEnvEnvironment:
    """An OpenEnv environment, one WebSocket connection per episode (the module docstring).

    ``env``: an installed OpenEnv environment (its package or short name); ``app``: a server app
    ``package.module:app`` instead; ``base_url``: a server already running instead of either (no process started).
    ``action_field`` / ``observation_field``: the action's string field the policy's turn fills and the
    observation's field the policy reads (default: the only string field of each); ``tools``: offer the server's
    MCP tools (default: when its action is ``call_tool``); ``answer_tool``: the tool a turn without tool calls is
    given to (a tool environment). ``connections``: the server's connections at once (``MAX_CONCURRENT_ENVS``);
    ``start_timeout_s``: how long its start may take; ``timeout_s``: one message's answer."""

    def __init__(
        self,
        env: str | None = None,
        *,
        app: str | None = None,
        base_url: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        tools: bool | None = None,
        answer_tool: str | None = None,
        connections: int = 256,
        start_timeout_s: float = 60.0,
        timeout_s: float = 60.0,
    ):
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError:
            raise ImportError(f"OpenEnv environments need the openenv package: {EXTRA}") from None
        if sum(x is not None for x in (env, app, base_url)) != 1:
            raise ValueError("name exactly one of env (an installed OpenEnv environment), app or base_url")
        self.client_class, self.timeout_s = GenericEnvClient, timeout_s
        if base_url is None:
            base_url = server(app or installed_app(env), connections, start_timeout_s).url
        self.url = base_url.rstrip("/")
        action = schema(self.url).get("action") or {}
        self.calls_tools = "tool_name" in (action.get("properties") or {}) if tools is None else tools
        self.action_field = action_field or (None if self.calls_tools else self._only(_string_fields(action)))
        if observation_field is None and not self.calls_tools:
            strings = _string_fields(schema(self.url).get("observation") or {})
            observation_field = strings[0] if len(strings) == 1 else None
        self.observation_field, self.answer_tool = observation_field, answer_tool
        self.tools: list[dict] | None = None
        self.client: Any = None

    def _only(self, fields: list[str]) -> str:
        if len(fields) != 1:
            raise ValueError(
                f"the OpenEnv action of {self.url} has the string fields {fields}: name the one the policy's turn "
                "fills with env.kwargs.action_field"
            )
        return fields[0]

    def reset(self, row: dict) -> str | list[dict]:
        self.close()
        self.client = self.client_class(base_url=self.url, message_timeout_s=self.timeout_s).sync()
        kwargs = dict(row.get("reset") or {})
        if "seed" in row:
            kwargs.setdefault("seed", int(row["seed"]))
        first = self._text(self._send("reset", **kwargs).observation) or row.get("prompt") or ""
        if self.calls_tools:
            listed = self._send("step", {"type": "list_tools"}).observation.get("tools") or []
            self.tools = [
                {
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t.get("description") or "",
                        "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object"},
                    },
                }
                for t in listed
            ]
            return [{"role": "user", "content": first}]
        return first

    def step(self, action: str) -> Step:
        if not self.calls_tools:
            out = self._send("step", {self.action_field: action})
            return self._ended(Step(self._text(out.observation), float(out.reward or 0.0), bool(out.done)))
        from shifu.models.tool_calls import parse_tool_calls

        _, calls = parse_tool_calls(action, "hermes")
        if not calls:  # (Llama 3's JSON calls, as ToolEnv reads them)
            _, calls = parse_tool_calls(action, "llama3_json")
        if not calls:  # the answer
            if self.answer_tool is None:
                return self._ended(Step(reward=0.0, done=True, info={"tool_calls": 0, "tool_errors": 0}))
            calls = [{"function": {"name": self.answer_tool, "arguments": json.dumps(self._answer(action))}}]
        reward, done, errors, results = 0.0, False, 0, []
        for call in calls:
            text, failed, out = self._call(call["function"]["name"], call["function"]["arguments"])
            errors += failed
            results.append({"role": "tool", "content": text})
            if out is not None:
                reward, done = reward + float(out.reward or 0.0), done or bool(out.done)
            if done:
                break
        info = {"tool_calls": len(calls), "tool_errors": errors}
        return self._ended(Step(None if done else results, reward, done, info))

    def truncate(self) -> None:
        """A budget cut the episode: its connection ends (no final reward: the environment scores its steps)."""
        self.close()

    def close(self) -> None:
        """End the episode's connection on the server."""
        if self.client is not None:
            client, self.client = self.client, None
            client.close()

    def _ended(self, step: Step) -> Step:
        if step.done:
            self.close()
        return step

    def _send(self, what: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, what)(*args, **kwargs)
        except RuntimeError as e:
            if "CAPACITY_REACHED" in str(e):
                raise RuntimeError(
                    f"{e}: the OpenEnv server at {self.url} allows fewer connections than the episodes a batch runs "
                    "at once; raise env.kwargs.connections (for an app that reads MAX_CONCURRENT_ENVS), the app's "
                    "max_concurrent_envs, or lower the batch (batch_size, eval.num_prompts)"
                ) from None
            raise

    def _answer(self, text: str) -> dict:
        tool = next((t for t in self.tools or () if t["function"]["name"] == self.answer_tool), None)
        names = list(((tool or {}).get("function", {}).get("parameters") or {}).get("properties") or {})
        if len(names) != 1:
            raise ValueError(f"answer_tool {self.answer_tool!r} must be a tool of one argument (has {names})")
        return {names[0]: text}

    def _call(self, name: str, arguments: str) -> tuple[str, bool, Any]:
        """``(result text, failed, the step's result or None)`` of one tool call."""
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return "error: the arguments must be a JSON object", True, None
        out = self._send("step", {"type": "call_tool", "tool_name": name, "arguments": args})
        obs = out.observation
        if obs.get("error"):
            return f"error: {obs['error'].get('message', obs['error'])}", True, out
        result = obs.get("result")
        if isinstance(result, dict):
            if result.get("data") is not None:
                result = result["data"]
            else:
                texts = [c.get("text", "") for c in result.get("content") or () if isinstance(c, dict)]
                result = "".join(texts)
        return (result if isinstance(result, str) else json.dumps(result)), False, out

    def _text(self, observation: dict) -> str | None:
        """What the policy reads of an observation: its ``observation_field`` (a text environment's default: the
        only string field of its schema), else its only non-empty string, else its non-empty fields as JSON; None
        for nothing."""
        if self.observation_field is not None:
            return str(observation.get(self.observation_field) or "") or None
        fields = {k: v for k, v in observation.items() if k not in _TEXT and v not in (None, "")}
        strings = [v for v in fields.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
        return json.dumps(fields) if fields else None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (a connection the server reaps anyway)
            pass


def __getattr__(name: str) -> Any:
    """``shifu.envs.openenv:ID``: :class:`OpenEnvEnvironment` for the installed OpenEnv environment ``ID``."""
    if name.startswith("_"):
        raise AttributeError(name)

    def factory(**kwargs: Any) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(name, **kwargs)

    factory.__name__ = factory.__qualname__ = name
    return factory

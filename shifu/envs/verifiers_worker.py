"""The verifiers worker: a local process, run with a Python that has ``verifiers`` 0.4 installed, that loads one
taskset (and its harness) and plays episodes of it against the base URL each request names.

It imports nothing of shifu (its Python may have only verifiers: verifiers pins an ``openai`` of its own), and is
started by :class:`shifu.envs.verifiers.Worker` as ``PYTHON verifiers_worker.py SETTINGS_JSON``. It speaks JSON
lines: on start it writes ``{"ready": true, "tasks": {SPLIT: [{"idx", "prompt", "name"}, ...]}}`` (or ``{"ready":
false, "error": ...}``), then answers each request ``{"id", "split", "idx", "base_url", "key", "model"}`` with
``{"id", "reward", "rewards", "error", "turns", "stop"}``, several episodes at once; ``{"cancel": ID}`` stops
playing one. Logs go to stderr.

Everything runs locally: the harness's program as a subprocess (verifiers' ``subprocess`` runtime, never
its default remote sandbox), verifiers' interception server on 127.0.0.1 between the program and the base URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from typing import Any


def refusal(env: Any) -> str | None:
    """Why ``env`` cannot run on local processes alone (None: it can)."""
    task_cls = type(env.taskset).task_type()
    if getattr(task_cls, "NEEDS_CONTAINER", False):
        return f"the tasks of {env.config.taskset.id} need a container (Task.NEEDS_CONTAINER)"
    for harness in env._harnesses.values():
        if harness.NEEDS_CONTAINER:
            return f"the harness {harness.config.id} needs a container (Harness.NEEDS_CONTAINER)"
    if env._requires_tunnel({}):
        return f"the tool servers of {env.config.taskset.id} need a public tunnel"
    return None


def load(settings: dict, kwargs: dict) -> Any:
    """The verifiers environment of the taskset with config ``kwargs``, its harness's program on the local
    ``subprocess`` runtime."""
    import verifiers.v1 as vf

    taskset = settings["taskset"]
    # no harness named: the taskset's own, else the plain chat harness (verifiers' own default is its coding
    # agent, `bash`)
    harness = settings["harness"] or (taskset if vf.default_harness_id(taskset) == taskset else "null")
    config = {
        "taskset": {**kwargs, "id": taskset},
        "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": harness}},
    }
    env = vf.load_environment(vf.resolve_env_config(config))
    why = refusal(env)
    if why:
        raise RuntimeError(f"{why}; shifu runs verifiers environments on local processes only")
    return env


def described(task: Any) -> dict:
    """A task as a prompt row names it: its position, its prompt's text, its name."""
    return {
        "idx": task.data.idx,
        "prompt": task.data.prompt_text or f"task {task.data.idx}",
        "name": task.data.name,
    }


class Worker:
    """The loaded environments (one per split) and the episodes in flight."""

    def __init__(self, settings: dict):
        self.settings = settings
        self.envs = {split: load(settings, kw) for split, kw in settings["splits"].items()}
        self.tasks = {split: list(env.taskset) for split, env in self.envs.items()}
        self.out = threading.Lock()
        self.keys = 0

    def send(self, message: dict) -> None:
        with self.out:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    async def episode(self, request: dict) -> dict:
        """One episode of task ``idx`` of ``split`` against ``base_url`` with the API key ``key``."""
        import verifiers.v1 as vf

        env, tasks = self.envs[request["split"]], self.tasks[request["split"]]
        # verifiers reads a client's API key from an environment variable: one per episode (the key is the
        # episode's own key on the gateway), so concurrent episodes' clients differ
        self.keys += 1
        var = f"SHIFU_VERIFIERS_KEY_{self.keys}"
        os.environ[var] = request["key"]
        client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var=var)
        ctx = vf.ModelContext(client=client, model=request["model"], sampling=vf.SamplingConfig())
        try:
            async with self.serving.held():
                episode = await env.run_episode(tasks[request["idx"]], ctx)
        finally:
            os.environ.pop(var, None)
        errors = [str(getattr(e, "message", e)) for t in episode.traces for e in t.errors] + [
            str(getattr(e, "message", e)) for e in episode.errors
        ]
        rewards: dict[str, float] = {}
        for trace in episode.traces:
            for name, r in trace.rewards.items():
                if r is not None:
                    rewards[name] = rewards.get(name, 0.0) + r.value
        return {
            "reward": sum(t.reward for t in episode.traces),
            "rewards": rewards,
            "error": "; ".join(errors) or None,
            "turns": sum(len(t.calls) for t in episode.traces),
            "stop": next((t.stop_condition for t in episode.traces if t.stop_condition), None),
        }

    async def answer(self, request: dict) -> None:
        try:
            result = await self.episode(request)
        except Exception as e:  # noqa: BLE001 (reported to shifu, which applies its on_error)
            result = {
                "reward": None,
                "rewards": {},
                "error": f"{type(e).__name__}: {e}",
                "turns": 0,
                "stop": None,
            }
        self.send({"id": request["id"], **result})

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.serving = Serving(list(self.envs.values()))
        self.send({"ready": True, "tasks": {s: [described(t) for t in ts] for s, ts in self.tasks.items()}})
        running: dict[int, asyncio.Task] = {}
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            request = json.loads(line)
            if "cancel" in request:  # no longer awaited (shifu's verifiers.timeout_s): stop playing it
                if (task := running.get(request["cancel"])) is not None:
                    task.cancel()
                continue
            task = asyncio.create_task(self.answer(request))
            running[request["id"]] = task
            task.add_done_callback(lambda _, n=request["id"]: running.pop(n, None))
        for task in list(running.values()):
            task.cancel()


class Serving:
    """The environments' serving resources (verifiers' interception server with its model clients, shared tool
    servers), up while episodes are in flight and released when none is. verifiers keeps one model client per
    distinct client config and every episode's differs (its key), so releasing them when a batch of episodes
    ends keeps them to a batch's. One task (:meth:`_own`) enters and leaves them."""

    def __init__(self, envs: list):
        self.envs, self.active, self.error = envs, 0, None
        self.wanted, self.up, self.idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.owner: asyncio.Task | None = None

    async def _own(self) -> None:
        while True:
            await self.wanted.wait()
            self.wanted.clear()
            try:
                async with contextlib.AsyncExitStack() as stack:
                    for env in self.envs:
                        await stack.enter_async_context(env.serving())
                    self.up.set()
                    while self.active:  # (an episode may arrive between the last one's end and this check)
                        await self.idle.wait()
                        self.idle.clear()
                    self.up.clear()
            except Exception as e:  # noqa: BLE001 (every waiting episode reports it)
                self.error = f"verifiers could not serve the environment: {type(e).__name__}: {e}"
                self.up.set()
                return

    @contextlib.asynccontextmanager
    async def held(self):
        if self.owner is None:
            self.owner = asyncio.create_task(self._own())
        self.active += 1
        if self.active == 1:
            self.wanted.set()
        try:
            await self.up.wait()
            if self.error:
                raise RuntimeError(self.error)
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self.idle.set()


def main() -> None:
    # run by path, this file's folder is first on the import path, and its neighbour shifu/envs/verifiers.py
    # would shadow the verifiers package
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    settings = json.loads(sys.argv[1])
    try:
        worker = Worker(settings)
    except Exception as e:  # noqa: BLE001 (the taskset or harness could not be loaded: said to shifu)
        sys.stdout.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        sys.stdout.flush()
        raise SystemExit(1) from None
    asyncio.run(worker.serve())


if __name__ == "__main__":
    main()

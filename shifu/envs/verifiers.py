"""verifiers environments (the ``verifiers`` package, 0.4: a taskset of tasks with their rewards, and a harness, the
program that plays a task through an OpenAI base URL) as a rollout source, named by one setting::

    shifu ppo ... verifiers.taskset=ID

``ID`` is what verifiers itself accepts (an installed taskset package, or a hub id ``owner/name@version`` already
installed); ``verifiers.harness`` names the harness (empty: the taskset's own, else verifiers' plain chat harness
``null``), ``verifiers.kwargs`` the taskset's config (what ``--env.taskset.*`` sets for ``vf-eval``), and
``verifiers.eval_kwargs`` the config of its held-out split (empty: ``data.eval_fraction`` of its tasks).

verifiers pins an ``openai`` older than the one the ``agents`` extra needs, so verifiers runs in a process of its
own, :class:`Worker`: ``verifiers.python`` (empty: this interpreter) runs :mod:`shifu.envs.verifiers_worker`,
which loads the taskset once, lists its tasks (the run's prompts) and plays each episode it is sent against the
run's policy gateway (:mod:`shifu.rollout.verifiers`). Everything stays local: the harness's program is
a local subprocess (verifiers' ``subprocess`` runtime; a taskset or harness that needs a container or a public
tunnel is refused), its model calls go through verifiers' interception server on 127.0.0.1 to the gateway. The
plain chat harness is a ``uv`` script: its first run installs its packages from the package index into uv's
cache, later runs reuse them.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError

EXTRA = "pip install 'shifu-rlhf[verifiers]'"
WORKER = Path(__file__).with_name("verifiers_worker.py")
SPLITS = ("train", "eval")


class VerifiersError(ShifuError):
    """The verifiers worker could not start (a taskset or harness that does not load, verifiers not installed at
    ``verifiers.python``) or stopped; the message quotes what it said."""


class NotInstalled(VerifiersError):
    """The Python that should run verifiers cannot import verifiers 0.4."""


def python_of(spec: str) -> str:
    """The interpreter ``verifiers.python`` names (empty: this one; ``~`` expanded)."""
    return os.path.expanduser(spec) if spec else sys.executable


def installed(python: str) -> bool:
    """Whether ``python`` can import verifiers 0.4."""
    if python == sys.executable:
        import importlib.util

        return importlib.util.find_spec("verifiers") is not None
    if not Path(python).exists():
        return False
    probe = (
        "import verifiers.v1, sys; v = __import__('verifiers').__version__; sys.exit(not v.startswith('0.4'))"
    )
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0


def installed_here(spec: str) -> bool:
    """Whether ``verifiers.python`` (``spec``; empty: this interpreter) looks able to run verifiers, checked
    without starting it: verifiers importable here, or that interpreter exists (:func:`installed` asks it)."""
    if not spec:
        import importlib.util

        return importlib.util.find_spec("verifiers") is not None
    return Path(spec).expanduser().exists()


class Worker:
    """The verifiers worker process (module docstring): ``tasks[split]`` the listed tasks (``{"idx", "prompt",
    "name"}``), :meth:`submit` one episode (a future of its result). Started with ``python``, with the working
    directory first on its import path (a user's own taskset module), and ``python``'s folder first on ``PATH``
    (where ``uv`` is installed beside it)."""

    def __init__(self, python: str, taskset: str, harness: str, splits: dict[str, dict]):
        self.python, self.taskset = python, taskset
        settings = {"taskset": taskset, "harness": harness, "splits": splits}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
        env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
        self.log = tempfile.NamedTemporaryFile(prefix="shifu-verifiers-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [python, str(WORKER), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            bufsize=1,
        )
        first = self.process.stdout.readline()
        hello = json.loads(first) if first.strip().startswith("{") else {"ready": False, "error": first}
        if not hello.get("ready"):
            self.stop()
            raise VerifiersError(
                f"verifiers taskset {taskset} could not be loaded by {python}: {hello.get('error') or self.tail()}"
            )
        self.tasks: dict[str, list[dict]] = hello["tasks"]
        self.ids = itertools.count()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="shifu-verifiers-reader", daemon=True)
        self.reader.start()

    def submit(self, split: str, idx: int, base_url: str, key: str, model: str) -> concurrent.futures.Future:
        """One episode of task ``idx`` of ``split`` against ``base_url`` with the API key ``key``: a future of
        ``{"reward", "rewards", "error", "turns", "stop"}``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            n = next(self.ids)
            self.pending[n] = future
            request = {"id": n, "split": split, "idx": idx, "base_url": base_url, "key": key, "model": model}
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
            except OSError:
                self.pending.pop(n)
                raise VerifiersError(
                    f"the verifiers worker of {self.taskset} stopped: {self.tail()}"
                ) from None
        future.add_done_callback(lambda f: self._cancel(n) if f.cancelled() else None)
        return future

    def _cancel(self, n: int) -> None:
        """Episode ``n`` is no longer awaited (cancelled: ``verifiers.timeout_s``): the worker stops playing it."""
        with self.lock:
            self.pending.pop(n, None)
            try:
                self.process.stdin.write(json.dumps({"cancel": n}) + "\n")
                self.process.stdin.flush()
            except (OSError, ValueError):  # (a stopped worker plays nothing)
                pass

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self.lock:
                future = self.pending.pop(message.pop("id"), None)
            if future is not None and not future.done():
                try:
                    future.set_result(message)
                except concurrent.futures.InvalidStateError:  # (cancelled in the meantime)
                    pass
        with self.lock:  # the worker stopped: whatever waits gets the reason
            waiting, self.pending = list(self.pending.values()), {}
        for future in waiting:
            future.set_exception(
                VerifiersError(f"the verifiers worker of {self.taskset} stopped: {self.tail()}")
            )

    def tail(self, n: int = 2000) -> str:
        text = Path(self.log.name).read_text(encoding="utf-8", errors="replace")
        return text[-n:].strip() or "(no output)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.terminate()


_WORKERS: dict[str, Worker] = {}
_LOCK = threading.Lock()


def worker(python: str, taskset: str, harness: str, kwargs: dict, eval_kwargs: dict) -> Worker:
    """The worker of these settings, started once per process (the prompts are listed and the episodes played
    by the same one) and stopped when the process exits."""
    splits = {"train": dict(kwargs)} | ({"eval": dict(kwargs) | dict(eval_kwargs)} if eval_kwargs else {})
    key = json.dumps([python, taskset, harness, splits], sort_keys=True, default=str)
    with _LOCK:
        if key not in _WORKERS:
            if not installed(python):
                raise NotInstalled(python)
            _WORKERS[key] = Worker(python, taskset, harness, splits)
            atexit.register(_WORKERS[key].stop)
        return _WORKERS[key]


def task_rows(w: Worker, split: str) -> list[dict[str, Any]]:
    """The prompt rows of a split's tasks: the task's prompt text (what records and length checks read; the
    harness renders the real first input), and which task it is (``verifiers_split``, ``verifiers_task``)."""
    return [
        {"prompt": t["prompt"], "verifiers_split": split, "verifiers_task": t["idx"]}
        | ({"name": t["name"]} if t.get("name") else {})
        for t in w.tasks[split]
    ]

"""The policy gateway as a Python object: what ``shifu serve --policy`` serves, and what a trainer runs in
process to record an agent's episodes.

:class:`Gateway` holds the policy (its model, tokenizer and version), how it samples, the open sessions and
the app (:func:`shifu.gateway.app.create_app`). :meth:`Gateway.start` serves it on 127.0.0.1 from a
background thread (real HTTP, uvicorn): an agent reaches it with ``openai.AsyncOpenAI(base_url=gw.base_url,
api_key=session_key)``. In recording mode (``recording=True``) every completion must carry a session key as
its API key and is recorded (:mod:`shifu.gateway.sessions`); the sampling settings are the trainer's
(:meth:`Gateway.set_sampling`): a request's own ``temperature``, ``top_p`` and ``seed`` are ignored (the
answer's ``shifu`` field says what was used), so the recorded log-probs are the ones the trainer recomputes.

**Reproducible recording.** A recorded completion's identity is its session's ``row_id`` (``("session", n)`` for
the ``n``-th session started without one) and its index among the session's calls; its choices are sampled from generators seeded by
the gateway's ``seed`` and that identity (:mod:`shifu.gateway.engine`), not from the order calls arrive in. A
row's log-probs still depend in their last bits on which rows share its sampler call (the padded width and the
number of rows change the CPU kernels' order of summation), so a trainer also fixes the calls themselves
(:meth:`Gateway.plan_sessions`): ``rows`` sessions started in row order, at most ``concurrency`` open; a sampler
call starts once every open session has a completion pending or has ended and no session is due to start, and
takes the completions in (row, call) order. The calls are then a function of what was sampled, never of timing:
the same seed gives the same episodes, bit for bit.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import replace

from shifu.errors import ConfigError
from shifu.gateway.completions import Sampling
from shifu.gateway.engine import Engine, Job
from shifu.gateway.sessions import CompletionMemory, RecordedSession, SessionStore
from shifu.models.tool_calls import tool_format

RECORDING_KEEP_ALIVE_S = 3600  # (Gateway.start)


class Gateway:
    """An OpenAI-compatible endpoint on ``model`` (see the module docstring).

    ``name``: the model id clients send (``GET /v1/models``). ``token``: the bearer token of the server
    (``/v1/*`` without recording; ``/rl/start_session`` when recording); None: no check (loopback only).
    ``sampling``: temperature / top-k / top-p and the token cap of a completion. ``max_batch_rows`` /
    ``max_batch_tokens``: the most rows, and rows x (prompt + budget) tokens, merged into one sampler call.
    ``chat_template``: a Jinja template for a tokenizer without one (the gateway never sends a prompt without
    a chat template). ``prefix_cache_mb``: the budget of the keys and values kept between calls (prefix reuse,
    :mod:`shifu.gateway.engine`); 0: off. ``kv_budget_mb``: the budget of the keys and values of the requests
    decoding at once (the admitting loop's block pool, :mod:`shifu.gateway.engine`): a request that does not fit
    waits, one bigger than the whole budget is refused (400 ``kv_budget_exceeded``)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        name: str = "policy",
        recording: bool = False,
        token: str | None = None,
        version: int = 0,
        sampling: Sampling | None = None,
        max_batch_rows: int = 64,
        max_batch_tokens: int = 65536,
        max_body_bytes: int = 16 * 2**20,
        body_timeout_s: float = 30.0,
        seed: int = 0,
        chat_template: str | None = None,
        prefix_cache_mb: float = 512,
        kv_budget_mb: float = 1024,
    ):
        if prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be >= 0 (0: no prefix reuse), got {prefix_cache_mb}")
        if not kv_budget_mb > 0:
            raise ConfigError(f"kv_budget_mb must be > 0, got {kv_budget_mb}")
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the policy's tokenizer has no chat template, and the gateway never sends a prompt without one: "
                "give a Jinja chat template (shifu serve --policy ... --chat-template FILE)"
            )
        self.tok, self.name, self.recording, self.token = tokenizer, name, recording, token
        self.sampling = sampling or Sampling()
        self.limits = {"max_body_bytes": max_body_bytes, "body_timeout_s": body_timeout_s}
        self.engine = Engine(
            model,
            tokenizer,
            version,
            max_batch_rows,
            max_batch_tokens,
            seed,
            int(prefix_cache_mb * 2**20),
            int(kv_budget_mb * 2**20),
        )
        # a recording gateway never admits into a running decode (the queue below): nor is it bound by its pool
        self.engine.admit = not recording
        self.format = tool_format(tokenizer)
        self.sessions = SessionStore()
        self.memory = CompletionMemory()  # without recording; a recording session keeps its own
        self.on_end: list = []  # what a dialect keeps per session, dropped when it ends: f(key) each
        self.memories: dict[str, CompletionMemory] = {}
        self.ended: queue.SimpleQueue[RecordedSession] = queue.SimpleQueue()
        self.server = None
        self.max_wait_s = 1.0  # recording: the longest a sampler call waits for more completions (batch_wait)
        self._identity: dict[
            str, list
        ] = {}  # open session's key -> [row (its row_id, else its number), calls]
        self._plan: tuple[int, int] | None = None  # (rows, concurrency): plan_sessions
        self._started = 0  # sessions started since plan_sessions
        self._unnamed = 0  # sessions started without a row id (their identity: ("session", n))
        self._queue = None  # the app's batching queue, once it serves
        # held through each sampler call: whoever holds it between two calls may change the policy's weights
        # in place (an asynchronous run's sampler, shifu.rollout.agent_stream)
        self.calling = threading.Lock()

    # ---------------------------------------------------------------------------------------- serving
    def app(self):
        """The Starlette app (:func:`shifu.gateway.app.create_app`)."""
        from shifu.gateway.app import create_app

        return create_app(self)

    def batch_queue(self, executor):
        """The app's queue of completions (on its event loop): merged into sampler calls on ``executor`` as the
        engine allows, waiting as :meth:`batch_wait` says, in (row, call) order once :meth:`plan_sessions`."""
        from shifu.http.batching import BatchQueue

        wait = self.batch_wait if self.recording else None
        # a recording run's calls are formed in (row, call) order, so that a seeded run repeats bit for bit:
        # requests joining a running decode as they arrive would leave that to timing (shifu.gateway.engine)
        # (an engine of another kind, a teacher's, runs static calls)
        admitting = getattr(self.engine, "admit", False) and not self.recording
        run = self.engine.run_admitting if admitting else self.engine.run

        def call(*args):
            with self.calling:
                return run(*args)

        self._queue = BatchQueue(call, executor, self.engine.joins, wait, self._order, admitting=admitting)
        return self._queue

    def start(self, host: str = "127.0.0.1", port: int = 0) -> Gateway:
        """Serve on ``host:port`` (port 0: a free one) from a background thread; returns self."""
        from shifu.http.runner import BackgroundServer

        if self.server is None:
            # a recording gateway's clients are its sessions' agents, which pause between calls (their tools)
            # and close their connections as their episodes end: an idle connection is kept an hour
            kept = {"keep_alive_s": RECORDING_KEEP_ALIVE_S} if self.recording else {}
            self.server = BackgroundServer(self.app(), host, port, **kept)
        return self

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` once started."""
        if self.server is None:
            raise RuntimeError("the gateway is not started: call start() first")
        return self.server.url

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``: ``http://127.0.0.1:PORT/v1``."""
        return self.url + "/v1"

    def close(self) -> None:
        """Stop the server (open sessions are dropped)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------- training
    def set_policy(self, model, version: int) -> None:
        """Sample with ``model`` from the next sampler call on, recording ``version`` (the trainer bumps it
        after each update; pass the same model object after an in-place update)."""
        self.engine.set_policy(model, version)

    def set_sampling(
        self,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """The sampling of every completion from now on (recording: requests cannot change it); None keeps a
        setting. ``temperature`` 0 is greedy (its log-probs are then under T = 1)."""
        new = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "max_tokens": max_tokens}
        sampling = replace(self.sampling, **{k: v for k, v in new.items() if v is not None})
        if (
            sampling.temperature < 0
            or sampling.top_k < 0
            or not 0 < sampling.top_p <= 1
            or sampling.max_tokens < 1
        ):
            raise ConfigError(f"gateway sampling out of range: {sampling}")
        self.sampling = sampling

    def plan_sessions(self, rows: int, concurrency: int) -> None:
        """Fix the sampler calls (module docstring): the next ``rows`` sessions are started with row ids 0, 1,
        ... in order, at most ``concurrency`` open at once (a trainer's episodes)."""
        self._plan, self._started = (int(rows), int(concurrency)), 0

    def start_session(self, row_id: object = None) -> str:
        """Open a recording session; its key is the API key the agent uses."""
        if not self.recording:
            raise RuntimeError("sessions need a recording gateway: Gateway(..., recording=True)")
        key = self.sessions.start(row_id)
        self.memories[key] = CompletionMemory(256)
        if row_id is None:  # numbered in the order they start, never by their random key
            row_id, self._unnamed = ("session", self._unnamed), self._unnamed + 1
        self._identity[key] = [row_id, 0]
        self._started += 1
        return key

    def identify(self, job: Job, key: str | None) -> Job:
        """``job`` with its identity (module docstring) when ``key`` is a recording session's: its row and
        the call's index in the session (the session's calls counted as they reach the server)."""
        known = self._identity.get(key) if key is not None else None
        if known is None:
            return job
        known[1] += 1
        return replace(job, identity=(known[0], known[1] - 1))

    def set_reward(self, key: str, reward: float, call: str | None = None) -> int:
        """The session's reward, or with ``call`` (a completion id, or ``"last"``) that call's."""
        return self.sessions.set_reward(key, float(reward), call)

    def end_session(self, key: str) -> RecordedSession:
        """Close a session and return what it recorded (:class:`shifu.gateway.sessions.RecordedSession`)."""
        self.memories.pop(key, None)
        self._identity.pop(key, None)
        for drop in self.on_end:
            drop(key)
        try:
            return self.sessions.end(key)
        finally:
            if self._queue is not None:  # a sampler call may wait for this session (batch_wait)
                self._queue.wake()

    def ended_sessions(self) -> list[RecordedSession]:
        """The sessions ended over HTTP (``POST /rl/end_session``) since the last call, oldest first."""
        out = []
        while not self.ended.empty():
            out.append(self.ended.get())
        return out

    def batch_wait(self, pending: list[Job]) -> float:
        """Recording: how long a sampler call may wait for more completions to join it (the queue's ``wait``,
        :class:`shifu.http.batching.BatchQueue`). After :meth:`plan_sessions`: until every open session has a
        completion pending and no session is due to start (``math.inf`` until then; an ended session wakes the
        queue). Otherwise, while fewer completions are pending than sessions are open, the episodes just
        started or answered are about to call: the first sampler call waits for them up to ``max_wait_s``, a
        later one up to half as long as the last sampler call took (so waiting costs at most a third of the
        sampler's time) and at most ``max_wait_s``; then, as a trainer's own sampler does, one call serves
        every episode's next turn."""
        open_keys = self.sessions.open_keys()
        if self._plan is not None:
            rows, concurrency = self._plan
            due = self._started < rows and len(open_keys) < concurrency
            waiting = {j.identity[0] for j in pending if j.identity is not None}
            ready = not due and all(self._identity.get(k, [None])[0] in waiting for k in open_keys)
            return 0.0 if ready else math.inf
        if len(pending) >= len(open_keys):
            return 0.0
        if self.engine.calls == 0:
            return self.max_wait_s
        return min(self.max_wait_s, 0.5 * self.engine.last_seconds)

    def _order(self, job: Job) -> tuple:
        """Where ``job`` goes in a sampler call: by (row, call) after :meth:`plan_sessions`, else as it came
        (rows of different types, ints and keys, never compared)."""
        if self._plan is None or job.identity is None:
            return ()
        row, call = job.identity
        return (type(row).__name__, row, call)

    def prefix_metrics(self, episodes: int) -> dict[str, float]:
        """A rollout's ``agent/prefix_hit_rate`` and ``agent/prefill_tokens`` (per episode) from the engine's
        prefix cache; ``{}`` when it is off."""
        counters = self.engine.prefix_counters()
        if not counters:
            return {}
        per_episode = counters["prefill_tokens"] / max(1, episodes)
        return {"agent/prefix_hit_rate": counters["hit_rate"], "agent/prefill_tokens": per_episode}

    def memory_of(self, key: str | None) -> CompletionMemory:
        return self.memories.get(key, self.memory) if self.recording else self.memory

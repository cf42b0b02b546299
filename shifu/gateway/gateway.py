"""The policy gateway as a Python object: what ``shifu serve --policy`` serves, and what a trainer runs in
process to record an agent's episodes.

:class:`Gateway` holds the policy (its model, tokenizer and version), how it samples, the open sessions and
the app (:func:`shifu.gateway.app.create_app`). :meth:`Gateway.start` serves it on 127.0.0.1 from a
background thread (real HTTP, uvicorn): an agent reaches it with ``openai.AsyncOpenAI(base_url=gw.base_url,
api_key=session_key)``. In recording mode (``recording=True``) every completion must carry a session key as
its API key and is recorded (:mod:`shifu.gateway.sessions`); the sampling settings are the trainer's
(:meth:`Gateway.set_sampling`): a request's own ``temperature``, ``top_p`` and ``seed`` are ignored (the
answer's ``shifu`` field says what was used), so the recorded log-probs are the ones the trainer recomputes.
"""

from __future__ import annotations

import queue
from dataclasses import replace

from shifu.errors import ConfigError
from shifu.gateway.completions import Sampling
from shifu.gateway.engine import Engine
from shifu.gateway.sessions import CompletionMemory, RecordedSession, SessionStore
from shifu.models.tool_calls import tool_format


class Gateway:
    """An OpenAI-compatible endpoint on ``model`` (see the module docstring).

    ``name``: the model id clients send (``GET /v1/models``). ``token``: the bearer token of the server
    (``/v1/*`` without recording; ``/rl/start_session`` when recording); None: no check (loopback only).
    ``sampling``: temperature / top-k / top-p and the token cap of a completion. ``max_batch_rows`` /
    ``max_batch_tokens``: the most rows, and rows x (prompt + budget) tokens, merged into one sampler call.
    ``chat_template``: a Jinja template for a tokenizer without one (the gateway never sends a prompt without
    a chat template)."""

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
    ):
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
        self.engine = Engine(model, tokenizer, version, max_batch_rows, max_batch_tokens, seed)
        self.format = tool_format(tokenizer)
        self.sessions = SessionStore()
        self.memory = CompletionMemory()  # without recording; a recording session keeps its own
        self.memories: dict[str, CompletionMemory] = {}
        self.ended: queue.SimpleQueue[RecordedSession] = queue.SimpleQueue()
        self.server = None
        self.max_wait_s = 1.0  # recording: the longest a sampler call waits for more completions (batch_wait)

    # ---------------------------------------------------------------------------------------- serving
    def app(self):
        """The Starlette app (:func:`shifu.gateway.app.create_app`)."""
        from shifu.gateway.app import create_app

        return create_app(self)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> Gateway:
        """Serve on ``host:port`` (port 0: a free one) from a background thread; returns self."""
        from shifu.http.runner import BackgroundServer

        if self.server is None:
            self.server = BackgroundServer(self.app(), host, port)
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

    def start_session(self, row_id: object = None) -> str:
        """Open a recording session; its key is the API key the agent uses."""
        if not self.recording:
            raise RuntimeError("sessions need a recording gateway: Gateway(..., recording=True)")
        key = self.sessions.start(row_id)
        self.memories[key] = CompletionMemory(256)
        return key

    def set_reward(self, key: str, reward: float, call: str | None = None) -> int:
        """The session's reward, or with ``call`` (a completion id, or ``"last"``) that call's."""
        return self.sessions.set_reward(key, float(reward), call)

    def end_session(self, key: str) -> RecordedSession:
        """Close a session and return what it recorded (:class:`shifu.gateway.sessions.RecordedSession`)."""
        self.memories.pop(key, None)
        return self.sessions.end(key)

    def ended_sessions(self) -> list[RecordedSession]:
        """The sessions ended over HTTP (``POST /rl/end_session``) since the last call, oldest first."""
        out = []
        while not self.ended.empty():
            out.append(self.ended.get())
        return out

    def batch_wait(self, pending: int) -> float:
        """Recording: how long a sampler call may wait for more completions to join it (the queue's ``wait``,
        :class:`shifu.http.batching.BatchQueue`). While fewer completions are pending than sessions are open,
        the episodes just started or answered are about to call: the first sampler call waits for them up to
        ``max_wait_s``, a later one up to half as long as the last sampler call took (so waiting costs at most
        a third of the sampler's time) and at most ``max_wait_s``; then, as a trainer's own sampler does, one
        call serves every episode's next turn."""
        if pending >= len(self.sessions.open_keys()):
            return 0.0
        if self.engine.calls == 0:
            return self.max_wait_s
        return min(self.max_wait_s, 0.5 * self.engine.last_seconds)

    def memory_of(self, key: str | None) -> CompletionMemory:
        return self.memories.get(key, self.memory) if self.recording else self.memory

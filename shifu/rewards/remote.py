"""The client of ``shifu serve``: :class:`RemoteReward`, scored by a reward service over HTTP.

``RemoteReward`` has the call interface of :class:`shifu.rewards.sources.RewardSource` —
``reward(prompts, responses, rows, input_ids=None, attention_mask=None) -> (B,) float32 on CPU`` — so a
trainer can hold either. It needs only the standard library (``http.client``): the server's extra
(``pip install 'shifu-rlhf[serve]'``) is not needed on the trainer's side.

What it sends (docs/how-to/reward-service.md has the schemas):

- **token ids** when the server's reward model is causal and its tokenizer is the policy's (same
  vocabulary and EOS id, checked once against ``GET /v1/metadata`` by :func:`can_send_token_ids`, the
  test :func:`shifu.rewards.sources.same_tokenizer` makes in process); the rollout's ``(B, T)`` ids and mask
  are sent as they are, ``batch_size`` rows a request;
- **text** otherwise (prompts and decoded responses; the rows too when the server runs a reward
  function), ``batch_size`` rows a request, which the server pads as one block.

With ``batch_size`` equal to the trainer's ``micro_batch_size`` and a server started with ``--exact``, the
scores equal in-process ``RewardSource`` scores bit for bit (tests/test_serve.py): each request is one
in-process micro-batch, scored as one forward. A merging server (the default) agrees within 1e-5 relative.

Failures: connection errors, timeouts and HTTP 408/429/502/503/504 are retried ``retries`` times after
:func:`backoff_delays` seconds; then :class:`RewardServiceUnavailable` (the service is down: a trainer
writes a checkpoint and stops, and ``--resume`` continues once the service is back). An answer that is
not the service's JSON, a rejected token or a refused request raise :class:`RewardServiceError` at once.
Every message names the URL.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch

from shifu.errors import ConfigError, ShifuError

API_PREFIX = "/v1"
TOKEN_ENV = "SHIFU_SERVE_TOKEN"
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})


class RewardServiceError(ShifuError):
    """The reward service answered, but not with scores: garbage, a rejected token, a refused request."""


class RewardServiceUnavailable(RewardServiceError):
    """No answer after the bounded retries: the service is down, unreachable or overloaded."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (hex) of a tokenizer's vocabulary (token -> id) and EOS id.

    Equal fingerprints mean what :func:`shifu.rewards.sources.same_tokenizer` checks in process (same vocabulary,
    same EOS id): token ids of one are token ids of the other.
    """
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps([vocab, tokenizer.eos_token_id], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def can_send_token_ids(metadata: dict, policy_tokenizer) -> bool:
    """True when the served reward model can score the policy's token ids directly (causal trunk, same
    tokenizer); the in-process rule of ``RewardSource``. ``metadata`` is the server's ``/v1/metadata``."""
    if policy_tokenizer is None or not metadata.get("is_causal"):
        return False
    served = (metadata.get("tokenizer") or {}).get("fingerprint")
    return served is not None and served == tokenizer_fingerprint(policy_tokenizer)


def backoff_delays(retries: int, base_s: float, max_s: float) -> list[float]:
    """Seconds slept before retry 1..``retries``: ``base_s * 2**i`` capped at ``max_s``.

    No jitter, so a rerun waits the same; the total wait is bounded by ``retries * max_s``.
    """
    return [min(base_s * 2**i, max_s) for i in range(retries)]


def split_url(url: str) -> tuple[str, str, int, str]:
    """``http(s)://host[:port][/prefix]`` -> (scheme, host, port, prefix without a trailing slash)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"reward service url '{url}' must look like http://127.0.0.1:8000 "
            "(scheme http or https and a host)"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ConfigError(f"reward service url '{url}': {e}") from None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def _to_json(value):
    """json.dumps fallback for numpy scalars/arrays in data rows (anything with ``item``/``tolist``)."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    raise TypeError(f"a {type(value).__name__} cannot be sent as JSON")


class RemoteReward:
    """Scores finished responses with a ``shifu serve`` reward service (see the module docstring).

    Args:
        url: the service, e.g. ``http://127.0.0.1:8000``.
        policy_tokenizer: the policy's tokenizer; token ids are sent when the served model shares it.
        token: bearer token; default the ``SHIFU_SERVE_TOKEN`` environment variable, else none.
        batch_size: rows per request (the trainer's ``micro_batch_size`` for in-process-equal scores).
        max_in_flight: requests of one call sent at once (the server merges them into one forward).
        timeout_s: socket timeout of one request (connect, send, wait for the answer), seconds.
        retries: further attempts after a connection error, timeout or 408/429/502/503/504.
        backoff_s, max_backoff_s: the retry schedule, :func:`backoff_delays`.

    The constructor reads ``/v1/metadata`` (so a wrong URL or token fails at once) into ``metadata``.
    """

    model = None  # no in-process module: nothing for a trainer to move to a device or offload

    def __init__(
        self,
        url: str,
        policy_tokenizer=None,
        token: str | None = None,
        batch_size: int = 32,
        max_in_flight: int = 4,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ):
        self.scheme, self.host, self.port, self.prefix = split_url(url)
        self.url = url.rstrip("/")
        for name, value, low in (("batch_size", batch_size, 1), ("max_in_flight", max_in_flight, 1)):
            if int(value) < low:
                raise ConfigError(f"RemoteReward {name} must be >= {low}, got {value}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ConfigError(
                "RemoteReward needs timeout_s > 0 and retries, backoff_s, max_backoff_s >= 0; got "
                f"timeout_s={timeout_s}, retries={retries}, backoff_s={backoff_s}, "
                f"max_backoff_s={max_backoff_s}"
            )
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.batch_size, self.max_in_flight = int(batch_size), int(max_in_flight)
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        self.delays = backoff_delays(self.retries, backoff_s, max_backoff_s)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="shifu-remote")
        self.metadata = self.request("GET", "/metadata")
        self.kind = self.metadata.get("kind")
        self.token_path = can_send_token_ids(self.metadata, policy_tokenizer)

    # ------------------------------------------------------------------------------------------ calls
    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        rows: list[dict],
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B,) float32 scores on CPU, one per response (a process reward's: the sum of its steps, as in
        process); non-finite scores come back as NaN."""
        from shifu.rewards.sources import step_totals

        return step_totals(*self.score_with_steps(prompts, responses, rows, input_ids, attention_mask))

    def score_with_steps(self, prompts, responses, rows, input_ids=None, attention_mask=None):
        """``(scores, steps)`` as :meth:`shifu.rewards.sources.RewardSource.score_with_steps` returns them: ``steps``
        None unless the service sent process-reward steps (``[[end, reward], ...]`` per response, checked as
        in process) for some response; then ``scores`` holds 0 for a stepped response."""
        from shifu.rewards.sources import check_steps

        scores, steps = [], []
        for start, answer in self._score(prompts, responses, rows, input_ids, attention_mask):
            n = min(self.batch_size, len(prompts) - start)
            self._refuse_token_scores(answer)
            scores.append(self._floats(answer, "scores", n, start))
            got = answer.get("steps", [[]] * n)
            if not isinstance(got, list) or len(got) != n:
                raise RewardServiceError(
                    f"reward service {self.url} answered 'steps' for rows {start}.."
                    f"{start + n - 1} that is not a list of {n}"
                )
            for i, row in enumerate(got):
                try:  # a non-finite reward (null) travels as NaN: the trainer drops that response
                    row = [(e, math.nan if r is None else r) for e, r in row]
                    steps.append(check_steps(row, start + i, len(responses[start + i])))
                except (TypeError, ValueError, ShifuError) as e:
                    raise RewardServiceError(f"reward service {self.url}: {e}") from None
        out = torch.cat(scores) if scores else torch.zeros(0)
        return out, (steps if any(steps) else None)

    def _refuse_token_scores(self, answer: dict) -> None:
        if "scores" not in answer and "token_scores" in answer:
            raise RewardServiceError(
                f"reward service {self.url} serves per-token (process) rewards; use "
                "RemoteReward.token_scores, or serve a reward that returns one score per response"
            )

    def token_scores(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[torch.Tensor]:
        """Per-token (process) rewards: one float32 tensor per response, as long as the function made it."""
        out: list[torch.Tensor] = []
        for start, answer in self._score(prompts, responses, rows, None, None):
            per_row = answer.get("token_scores")
            n = min(self.batch_size, len(prompts) - start)
            if not isinstance(per_row, list) or len(per_row) != n:
                raise RewardServiceError(
                    f"reward service {self.url} answered without 'token_scores' for {n} responses "
                    f"(keys: {sorted(answer)}); it serves one score per response: call the RemoteReward "
                    "itself"
                )
            out.extend(
                self._floats({"s": r}, "s", len(r) if isinstance(r, list) else -1, start) for r in per_row
            )
        return out

    def health(self) -> dict:
        """``GET /health``: status and counters of the service."""
        return self.request("GET", "/health", prefix=False)

    def close(self) -> None:
        """Close this thread's connection and stop the request threads (theirs close with them)."""
        self._drop()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RemoteReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- internals
    def _score(self, prompts, responses, rows, input_ids, attention_mask) -> list[tuple[int, dict]]:
        """Split into requests of ``batch_size`` rows, send up to ``max_in_flight`` at once, in order."""
        n = len(prompts)
        if len(responses) != n:
            raise ShifuError(f"RemoteReward got {n} prompts and {len(responses)} responses")
        tokens = self.token_path and input_ids is not None
        if tokens:
            ids, mask = input_ids.detach().cpu().tolist(), attention_mask.detach().cpu().tolist()
        starts = list(range(0, n, self.batch_size))
        bodies = []
        for s in starts:
            stop = s + self.batch_size
            if tokens:
                payload = {"input_ids": ids[s:stop], "attention_mask": mask[s:stop]}
            else:
                payload = {"prompts": list(prompts[s:stop]), "responses": list(responses[s:stop])}
                if self.kind == "function":
                    payload["rows"] = list(rows[s:stop])
            try:
                bodies.append(json.dumps(payload, default=_to_json, allow_nan=False).encode("utf-8"))
            except (TypeError, ValueError) as e:
                raise ShifuError(
                    f"cannot send rows {s}..{min(stop, n) - 1} to reward service {self.url} as JSON ({e}); "
                    "reward functions served over HTTP get rows of JSON values "
                    "(str, number, bool, list, dict)"
                ) from None
        if len(bodies) == 1 or self.max_in_flight == 1:
            answers = [self.request("POST", "/score", b) for b in bodies]
        else:
            answers = list(self._pool.map(lambda b: self.request("POST", "/score", b), bodies))
        return list(zip(starts, answers))

    def _floats(self, answer: dict, key: str, n: int, start: int) -> torch.Tensor:
        """``answer[key]``, a list of n numbers (null = NaN), as float32; garbage names the URL."""
        values = answer.get(key)
        ok = isinstance(values, list) and len(values) == n
        ok = ok and all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values
        )
        if not ok:
            got = f"{len(values)} items" if isinstance(values, list) else type(values).__name__
            raise RewardServiceError(
                f"reward service {self.url} answered '{key}' with {got} for rows {start}..{start + n - 1}, "
                f"expected a list of {n} numbers; is reward.url the address of `shifu serve`?"
            )
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)

    def request(self, method: str, path: str, body: bytes | None = None, prefix: bool = True) -> dict:
        """One JSON request with bounded retries; returns the decoded answer or raises with the URL."""
        full = (self.prefix + API_PREFIX + path) if prefix else (self.prefix + path)
        url = f"{self.scheme}://{self.host}:{self.port}{full}"
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        t0, last = time.monotonic(), ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.delays[attempt - 1])
            try:
                status, data = self._send(method, full, body, headers)
            except (OSError, http.client.HTTPException) as e:  # OSError: refused, reset, timed out
                self._drop()
                if isinstance(e, http.client.HTTPException) and not isinstance(e, ConnectionError):
                    raise RewardServiceError(
                        f"reward service {url} did not answer in HTTP ({type(e).__name__}: {e}); "
                        "is reward.url the address of `shifu serve`?"
                    ) from None
                last = f"{type(e).__name__}: {e}"
                continue
            if status in RETRY_STATUSES:
                last = f"HTTP {status} {_error_message(data)}"
                continue
            return _decode(url, status, data)
        raise RewardServiceUnavailable(
            f"reward service {url} did not answer after {self.retries + 1} attempts in "
            f"{time.monotonic() - t0:.1f} s (last: {last}). "
            f"Start it (`shifu serve RM_DIR --port {self.port}`) "
            "or fix the URL; a PPO run stops with a checkpoint that --resume continues"
        )

    def _send(self, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, bytes]:
        """One HTTP exchange on this thread's keep-alive connection. A connection the server closed while
        idle fails on reuse: that is retried once on a fresh connection, not counted as an attempt."""
        for fresh in (False, True):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
                conn = self._local.conn = cls(self.host, self.port, timeout=self.timeout_s)
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                self._drop()
                if reused and not fresh:
                    continue
                raise
            if resp.will_close:
                self._drop()
            return resp.status, data
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _error_message(data: bytes) -> str:
    """The ``error.message`` of a service's JSON error body, else the first bytes of the body."""
    try:
        return str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return repr(data[:120])


def _decode(url: str, status: int, data: bytes) -> dict:
    """The JSON object of an answer; a 4xx/5xx raises with the service's message, garbage with the URL."""
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise RewardServiceError(
            f"reward service {url} answered HTTP {status} with something that is not a JSON object "
            f"({data[:120]!r}); is the URL the address of `shifu serve`?"
        )
    if status in (401, 403):
        raise RewardServiceError(
            f"reward service {url} rejected the token (HTTP {status}: {_error_message(data)}); give the "
            f"token the server was started with (RemoteReward token= or {TOKEN_ENV})"
        )
    if status >= 400:
        err = obj.get("error") if isinstance(obj.get("error"), dict) else {}
        field = f", field '{err['field']}'" if err.get("field") else ""
        raise RewardServiceError(
            f"reward service {url} refused the request (HTTP {status}{field}): {err.get('message', obj)}"
        )
    if status != 200:
        raise RewardServiceError(f"reward service {url} answered HTTP {status}, expected 200")
    return obj

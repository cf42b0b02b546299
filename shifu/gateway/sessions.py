"""Recorded sessions: what the gateway sampled for one episode of an agent, joined into trajectories on the
server, token for token.

A session is opened by the trainer (:meth:`shifu.gateway.Gateway.start_session`) or an outside harness
(``POST /rl/start_session``), and named by its key, which the agent sends as its API key. Every completion
call of the session records the prompt ids exactly as the server rendered them and, per choice, the sampled
ids (EOS included when the policy sampled it), their log-probs and the policy version.

**Joining.** A call whose prompt ids start with a previous call's prompt ids followed by one of its choices'
completion ids (compared as ids, never re-tokenised) continues that choice's trajectory: its segment reads
the ids in between (tool results, the template's headers, an end-of-turn the policy did not sample) and then
samples. A call that extends no earlier call starts a new trajectory of the same session and is counted in
``forks`` (the first call is not a fork). With ``n > 1`` a call branches: each choice ends its own trajectory,
and the trajectories share the segments before the branch (the same :class:`Segment` objects).

**Side calls.** A harness also makes calls that are not the agent's turn (a title, a summary, a classifier),
sent with another system prompt. The *agent's* system prompt is the one the most calls of the session were sent
with (a tie: the one of the earliest recorded of them; no system message counts as one more prompt, "none"); a
trajectory whose first call was sent with another is a *side* trajectory (:attr:`Trajectory.side`), and its calls
are counted in ``side_calls``. A side trajectory always starts with a fork: a prompt that opens with another
system message extends no earlier call of the agent's.

**Retries** (:mod:`shifu.gateway.retries`). A request that the session answers is kept with the call it recorded
(:meth:`SessionStore.keep`) until a later call goes on from that call (extends one of its choices): until then
the same request again is its retry (:meth:`SessionStore.retry_of`), answered by the first answer, not recorded
again. A request that recorded no call (a refusal) is not kept once answered (:meth:`SessionStore.settle`).

**The context limit.** A request of the session refused because its prompt leaves no room in the model's
positions (``context_length_exceeded``) is noted (:meth:`SessionStore.refused`); a call recorded after it clears
the note. A session that ends with the note ended on the context limit (``context_exceeded``).

**Output contract** (:meth:`SessionStore.end`): :class:`RecordedSession` ``(key, row_id, trajectories,
forks, reward, calls, side_calls, context_exceeded)``; a :class:`Trajectory` is its :class:`Segment` list in order; a trajectory's ids are
``read_ids[0] + sampled_ids[0] + read_ids[1] + sampled_ids[1] + ...``, and only ``sampled_ids`` were
sampled (and carry ``log_probs``). Trajectories are the leaves (the calls no later call extended), in the
order their last call was recorded.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Segment:
    """One completion of a trajectory.

    ``read_ids``: the first segment's is the whole first prompt; a later segment's is what came between the
    previous segment's sampled ids and this prompt's end (tool results, template headers, an end-of-turn the
    policy did not sample). ``sampled_ids``: the ids the policy sampled, EOS included when sampled.
    ``log_probs``: float32 log-probabilities of ``sampled_ids`` under ``logits / T`` at the sampling
    temperature T (the values a trainer recomputes). ``reward``: set by ``/rl/set_reward`` for this call
    (None: none given); it belongs on the last sampled token. ``finish_reason``: ``"stop"`` (EOS, an
    end-of-turn id or a stop string), ``"length"`` (the token budget) or ``"tool_calls"``. ``version``: the
    policy version that sampled it (:meth:`shifu.gateway.Gateway.set_policy`). ``entropy``: per sampled id the
    entropy of the distribution it was drawn from (``logits / T``; what a trainer's forward would compute)."""

    read_ids: list[int]
    sampled_ids: list[int]
    log_probs: list[float]
    reward: float | None
    finish_reason: str
    version: int
    entropy: list[float] | None = None


@dataclass
class Trajectory:
    """The segments of one trajectory, in order (see :class:`Segment`); ``side``: a side trajectory, its first
    call sent with another system prompt than the agent's (module docstring)."""

    segments: list[Segment]
    side: bool = False

    @property
    def ids(self) -> list[int]:
        """Every id of the trajectory: each segment's read ids, then its sampled ids."""
        return [t for s in self.segments for t in (*s.read_ids, *s.sampled_ids)]


@dataclass
class RecordedSession:
    """A finished session: its ``trajectories`` (leaves of the call tree, module docstring), ``forks`` (calls
    that extended no earlier call, the first call not counted), the session ``reward`` from
    ``/rl/set_reward`` without a call (None: not given), and the number of completion ``calls``."""

    key: str
    row_id: object
    trajectories: list[Trajectory]
    forks: int
    reward: float | None
    calls: int
    side_calls: int = 0
    context_exceeded: bool = False


def system_digest(messages: list[dict]) -> str | None:
    """A digest of the system prompt of a request's (normalised) chat ``messages``: its first message's content
    when that is a system message (``developer`` is normalised to ``system``); None: no system message."""
    if not messages or messages[0]["role"] != "system":
        return None
    return hashlib.sha256(str(messages[0]["content"]).encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Call:
    """One recorded completion call: its prompt ids and a segment per choice (what :meth:`SessionStore.record`
    takes); ``system``: the :func:`system_digest` of its request; ``request``: the fingerprint of the request it
    answered (:mod:`shifu.gateway.retries`; None: not kept for retries)."""

    completion_id: str
    prompt_ids: list[int]
    segments: list[Segment]
    system: str | None = None
    request: str | None = None


@dataclass
class _End:
    """An open end of the call tree: the ids of a prompt + one choice's completion, its segment path, the call
    that made it and the first call of its path."""

    ids: list[int]
    path: list[Segment]
    call: str
    first: str
    extended: bool = False


@dataclass
class _Kept:
    """A request answered in the session, kept for its retries: the gateway's ``answer`` and the completion id
    of the ``call`` it recorded (None: not recorded yet)."""

    answer: object
    call: str | None = None


@dataclass
class _Live:
    key: str
    row_id: object
    ends: list[_End] = field(default_factory=list)
    calls: dict[str, list[Segment]] = field(default_factory=dict)  # completion id -> segments, in order
    systems: dict[str, str | None] = field(default_factory=dict)  # completion id -> its system_digest
    requests: dict[str, _Kept] = field(default_factory=dict)  # request fingerprint -> its kept answer
    forks: int = 0
    reward: float | None = None
    refused: bool = False  # the latest request was refused for the context limit (no call recorded since)


class UnknownSession(KeyError):
    """A key that names no open session."""


class SessionStore:
    """The open sessions of a recording gateway (thread-safe: the server's event loop records, the trainer
    starts and ends). See the module docstring."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}

    def start(self, row_id: object = None) -> str:
        key = "shifu-session-" + secrets.token_urlsafe(18)
        with self._lock:
            self._live[key] = _Live(key, row_id)
        return key

    def is_open(self, key: str | None) -> bool:
        with self._lock:
            return key in self._live

    def record(self, key: str, call: Call) -> None:
        """Join ``call`` onto the session's call tree (module docstring)."""
        with self._lock:
            live = self._get(key)
            prompt = call.prompt_ids
            parent = None
            for end in reversed(live.ends):  # the latest match: the branch the agent went on with
                if len(end.ids) <= len(prompt) and prompt[: len(end.ids)] == end.ids:
                    parent = end
                    break
            if parent is None:
                live.forks += bool(live.calls)
                base, path, first = [], [], call.completion_id
            else:
                parent.extended = True
                base, path, first = parent.ids, parent.path, parent.first
                # the agent went on from the parent's call: a request it answered is no longer retried
                live.requests = {f: k for f, k in live.requests.items() if k.call != parent.call}
            for seg in call.segments:
                seg.read_ids = prompt[len(base) :]
                live.ends.append(_End(prompt + seg.sampled_ids, [*path, seg], call.completion_id, first))
            live.calls[call.completion_id] = call.segments
            live.systems[call.completion_id] = call.system
            live.refused = False
            if call.request is not None and call.request in live.requests:
                live.requests[call.request].call = call.completion_id

    def refused(self, key: str) -> None:
        """Note that a request of the session was refused for the model's context (module docstring)."""
        with self._lock:
            self._get(key).refused = True

    # ---------------------------------------------------------------------------------------- retries
    def retry_of(self, key: str, request: str) -> object | None:
        """The kept answer of the session's request with the fingerprint ``request`` when one arriving now is
        its retry: that request is still being answered, or it recorded a call that no later call went on from
        (module docstring). None: a new request."""
        with self._lock:
            live = self._get(key)
            kept = live.requests.get(request)
            if kept is None:
                return None
            if kept.call is not None and any(e.extended for e in live.ends if e.call == kept.call):
                del live.requests[request]
                return None
            return kept.answer

    def keep(self, key: str, request: str, answer: object) -> None:
        """Keep ``answer``, the gateway's answer of the request ``request`` (its fingerprint), for retries."""
        with self._lock:
            self._get(key).requests[request] = _Kept(answer)

    def settle(self, key: str, request: str, answer: object) -> None:
        """``answer`` is complete: forget it unless its request recorded a call (a refusal is asked again)."""
        with self._lock:
            live = self._live.get(key)
            kept = live.requests.get(request) if live is not None else None
            if kept is not None and kept.answer is answer and kept.call is None:
                del live.requests[request]

    def set_reward(self, key: str, reward: float, completion_id: str | None = None) -> int:
        """The session's reward, or with ``completion_id`` (``"last"``: the latest call) that call's reward,
        set on each of its segments. Returns how many segments got it (0 for the session's)."""
        with self._lock:
            live = self._get(key)
            if completion_id is None:
                live.reward = reward
                return 0
            if completion_id == "last":
                if not live.calls:
                    raise KeyError("the session has no call yet")
                completion_id = next(reversed(live.calls))
            if completion_id not in live.calls:
                raise KeyError(f"no call {completion_id!r} in this session")
            for seg in live.calls[completion_id]:
                seg.reward = reward
            return len(live.calls[completion_id])

    def end(self, key: str) -> RecordedSession:
        with self._lock:
            live = self._live.pop(key, None)
        if live is None:
            raise UnknownSession(key)
        agent = _agent_system(live)
        leaves = [Trajectory(e.path, live.systems[e.first] != agent) for e in live.ends if not e.extended]
        side = sum(system != agent for system in live.systems.values())
        return RecordedSession(
            live.key, live.row_id, leaves, live.forks, live.reward, len(live.calls), side, live.refused
        )

    def open_keys(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def _get(self, key: str) -> _Live:
        live = self._live.get(key)
        if live is None:
            raise UnknownSession(key)
        return live


def _agent_system(live: _Live) -> str | None:
    """The agent's system prompt (digest): the one the most calls were sent with, a tie to the earliest."""
    counts: dict[str | None, int] = {}
    for system in live.systems.values():  # (in recording order: max keeps the first of equal counts)
        counts[system] = counts.get(system, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


class CompletionMemory:
    """What the policy sampled for each recent completion, so that a history that sends it back is rendered
    as sampled: an assistant message whose ``tool_calls`` ids this gateway issued, or whose content equals a
    completion's returned content, stands for that completion's raw text (the stop string the answer left
    out, calls as the policy wrote them) and its sampled ids (:func:`shifu.gateway.completions.prompt_ids`
    splices them in instead of tokenising the text again). Bounded (the oldest go first)."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._lock = threading.Lock()
        self._by_call: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        self._by_content: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def remember(self, content: str | None, tool_calls: list[dict], raw: str, ids: list[int]) -> None:
        """A completion's returned ``content`` / ``tool_calls``, its ``raw`` text and the ``ids`` of that text
        (the sampled ids without the ending EOS)."""
        with self._lock:
            for c in tool_calls:
                self._put(self._by_call, c["id"], (raw, ids))
            if not tool_calls and content is not None:
                self._put(self._by_content, content, (raw, ids))

    def _put(self, table: OrderedDict, key: str, value: tuple[str, list[int]]) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.size:
            table.popitem(last=False)

    def lookup(self, message: dict) -> tuple[str, list[int]] | None:
        """``(raw text, ids)`` of an assistant message this gateway produced, else None."""
        if message["role"] != "assistant":
            return None
        with self._lock:
            calls = message.get("tool_calls") or []
            if calls:
                found = {self._by_call.get(c["id"], (None, None))[0] for c in calls}
                if len(found) == 1 and None not in found:
                    return self._by_call[calls[0]["id"]]
                return None
            if message.get("content") is not None:
                return self._by_content.get(message["content"])
            return None

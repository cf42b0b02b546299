"""Where a PPO iteration's batch comes from under ``async_schedule=bounded`` (``max_staleness=S > 0``):
``async_samplers`` threads sample the ledger's prompts at once, ``1 / async_samplers`` of a batch per call, on the last weights
the trainer published, and each iteration trains the first trajectories finished that are at most ``S`` versions
behind. A straggler holds its own call only: the other samplers go on, and the batch does not wait for it. Over
episodes with an environment or an agent (a source with ``stream``: :class:`shifu.rollout.episode_stream.EpisodeStream`,
:class:`shifu.rollout.agent_stream.AgentStream`) a sampler's episodes run on their own instead, each prompt's
trajectories out as its episodes end, so a straggler holds its own episode only and one sampler is enough. A run
is not bit-reproducible, and is exactly-once by construction (:mod:`shifu.trainers.ppo_bounded`). The trainer
sees the interface of :class:`shifu.trainers.ppo_async.Producer`: :meth:`BoundedProducer.batch_for`,
:meth:`BoundedProducer.join`.

Numbering: batch ``step = it - 1`` (iteration ``it``) is trained after ``step`` updates; a trajectory sampled by
version ``v`` (the policy after ``v`` updates) may train in it when ``step - v <= S``. Older ones go back to the
ledger's queue (counted: ``rollout/requeued``) and are sampled again. The samplers sample only what their
versions can still train (the batches up to ``version + S``), then wait for the next update.

Weights: each sampler holds one copy of the policy's weights (``async_samplers`` copies in all), its own shallow copy
of the rollout source (a source keeps per-call state) and its own copy of the tokenizer (an agent's gateway
tokenizes in a thread of its own, and a fast tokenizer is not to be called from two threads at once). What the
copies still share is safe to share: an agent's sampler (a verifiers taskset's sampler call) starts its own
gateway (its own port, sessions, event loop and seed), and a verifiers worker takes episodes from any thread
(each with its own id, base URL and API key). A sampler takes the actor's weights between two of its
calls, never during one, and only while the trainer is not scoring or updating (the trainer holds
:attr:`BoundedProducer.updating` from taking a batch to publishing its update). It waits for the trainer only when
its copy is so old that nothing it samples could train (``version < published - S``); otherwise it samples on
with the copy it has. An evaluation pauses every sampler between two calls (:meth:`BoundedProducer.paused`).

Checkpoints keep the ledger's state (``data.ledger``: the trained prompts of each unfinished epoch), nothing
sampled: on resume, what was in flight or in the buffer is sampled again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from torch import nn

from shifu.trainers.ppo_async import Producer, Sampled, row_prompt_ids, weights_copy
from shifu.trainers.ppo_bounded import Buffer, Finished, Ledger, concat
from shifu.trainers.ppo_rollout import prompt_batch, sample_batch, sampler_policy

POLL_S = 0.005  # how often a waiting sampler looks again (paused, or nothing to sample)


@dataclasses.dataclass
class Sampler:
    """One producer thread's own: its copy of the weights (``model``) and their ``version``, its rollout source
    (a shallow copy of the run's: a source keeps per-call state) and tokenizer (a copy of the run's), the lock it
    holds during a sampler call."""

    source: Any
    tokenizer: Any
    model: nn.Module | None = None
    version: int = 0
    calling: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    stream: Any = None  # its source's stream, when it runs one (_stream_loop)


class BoundedProducer:
    """The batches of a bounded run's iterations (see the module docstring). ``run``: the
    :class:`shifu.trainers.ppo_run.Run`; ``ids`` / ``rows``: the training prompts and their data rows;
    ``ledger``: a checkpoint's ledger state (:meth:`state`), or None for a new run."""

    def __init__(
        self, run: Any, ids: list[list[int]], rows: list[dict], params: Any, ledger: dict | None = None
    ) -> None:
        cfg = run.cfg
        self.run, self.ids, self.rows, self.params = run, ids, rows, params
        self.S, self.G = cfg.max_staleness, cfg.group_size
        self.per_batch = cfg.batch_size // cfg.group_size  # prompts a batch trains
        self.unit = max(1, self.per_batch // cfg.async_samplers)  # prompts per sampler call
        total = cfg.iterations * self.per_batch  # the synchronous run's prompts, as a multiset
        self.ledger = (
            Ledger.from_state(len(ids), cfg.seed, ledger, total)
            if ledger
            else Ledger(len(ids), cfg.seed, total=total)
        )
        self.buffer = Buffer(self.ledger)
        self.samplers = [
            Sampler(copy.copy(run.models.source), copy.deepcopy(run.models.tokenizer))
            for _ in range(cfg.async_samplers)
        ]
        self.published = 0  # the updates the trainer has made (and published)
        self.updating = threading.Lock()  # held by the trainer while it scores and updates
        self.pausing, self.stopping = threading.Event(), threading.Event()
        self.started = False
        self.taken: list[Finished] = []  # the batch in training: committed by join()

    # ------------------------------------------------------------------------------------ the trainer's side
    def batch_for(self, it: int) -> Sampled:
        """Iteration ``it``'s batch: the first ``batch_size / G`` prompts' trajectories finished within the bound
        (waits for them); the threads are started on the first call. Holds :attr:`updating` until :meth:`join`."""
        step = it - 1
        if not self.started:
            self._start(step)
        t0 = time.perf_counter()
        try:
            got, requeued = self.buffer.take(step, self.per_batch, self.S)
        except BaseException as e:
            e.add_note("raised in a sampler thread of async_schedule=bounded, which stopped them all")
            raise
        waited = time.perf_counter() - t0
        self.updating.acquire()  # the weights are the trainer's until join() publishes the update
        self.taken = got
        made = concat([d.item for d in got], self.run.models.tokenizer.pad_token_id)
        versions = [d.version for d in got for _ in range(len(d.item))]
        staleness = {  # logged with the source's metrics
            "rollout/staleness": sum(step - v for v in versions) / len(versions),
            "rollout/requeued": requeued,
        }
        made = dataclasses.replace(made, metrics=made.metrics | staleness)
        ids = [d.prompt_id for d in got for _ in range(len(d.item))]
        return Sampled(step, min(versions), ids, made, waited, versions)

    def join(self) -> None:
        """After the update of the batch :meth:`batch_for` gave: its prompts trained (final in the ledger), the
        update published (the samplers' next copies are of these weights)."""
        self.ledger.commit([(d.epoch, d.prompt_id) for d in self.taken])
        self.taken = []
        self.published = self.run.loop["iteration"]
        self.updating.release()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every sampler stopped between two of its calls while the trainer uses the rollout source itself."""
        self.pausing.set()
        try:
            with contextlib.ExitStack() as held:
                for w in self.samplers:
                    held.enter_context(w.calling)
                    if w.stream is not None:  # (an agent's episodes wait for their gateway's next call)
                        held.enter_context(w.stream.paused())
                yield
        finally:
            self.pausing.clear()

    def close(self) -> None:
        """The threads stopped after their current sampler calls (at the end of a run, on any error);
        idempotent."""
        self.stopping.set()
        for w in self.samplers:
            if w.thread is not None:
                w.thread.join()
                w.thread = None
        if self.updating.locked() and self.taken:  # an error between batch_for and join
            self.taken = []
            self.updating.release()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (``data.ledger``): only trained prompts are final."""
        return {"ledger": self.ledger.state()}

    # ----------------------------------------------------------------------------------- the threads' side
    def _start(self, step: int) -> None:
        self.published = step  # updates made before this batch
        for i, w in enumerate(self.samplers):
            self._refresh(w)
            w.thread = threading.Thread(
                target=self._loop, args=(w,), name=f"shifu-ppo-sampler-{i}", daemon=True
            )
            w.thread.start()
        self.started = True

    def _refresh(self, w: Sampler) -> None:
        """``w``'s copy set to the actor's current weights (version :attr:`published`)."""
        w.model = weights_copy(w.model, self.run.models.decoder())
        w.version = self.published

    def _catch_up(self, w: Sampler) -> bool:
        """Between two of ``w``'s calls: the published weights, if the trainer is not updating; waited for when
        the copy is too old for anything it samples to train. Returns whether ``w`` took new weights."""
        if self.published <= w.version:
            return False
        must = w.version < self.published - self.S
        got = self.updating.acquire(blocking=False)
        while must and not got and not self.stopping.is_set():
            got = self.updating.acquire(timeout=POLL_S * 10)
        if got:
            try:
                self._refresh(w)
            finally:
                self.updating.release()
        return got

    def _loop(self, w: Sampler) -> None:
        if callable(getattr(w.source, "stream", None)):
            self._stream_loop(w)
            return
        try:
            while not self.stopping.is_set():
                if self.pausing.is_set():
                    self.stopping.wait(POLL_S)
                    continue
                with w.calling:
                    self._catch_up(w)
                    unit = self._hand_out() if self._room(w) else []
                    if unit:
                        self._sample(w, unit)
                if not unit:  # what this version can train is sampled or sampling, or every prompt handed out
                    self.stopping.wait(POLL_S)
        except BaseException as e:  # noqa: BLE001 (raised in the trainer's thread by Buffer.take)
            self.stopping.set()  # the other samplers stop too
            self.buffer.fail(e)

    def _stream_loop(self, w: Sampler) -> None:
        """A sampler over a source whose episodes run on their own (its ``stream``): between two rounds it takes
        new weights (while the stream is paused: an agent's gateway between two sampler calls), hands out prompts
        while its version can still train them, and puts each prompt's trajectories in the buffer as its
        episodes end; a straggler holds its own episode only."""
        m, cfg = self.run.models, self.run.cfg
        own = dataclasses.replace(m, source=w.source, tokenizer=w.tokenizer)
        stream = None
        try:
            policy = sampler_policy(own, cfg, w.model)
            stream = w.stream = w.source.stream(policy, self.params, self.run.state.sample_gen)
            while not self.stopping.is_set():
                if self.pausing.is_set():
                    self.stopping.wait(POLL_S)
                    continue
                with w.calling:
                    if self.published > w.version:
                        with stream.paused():  # (an agent's gateway between two sampler calls)
                            took = self._catch_up(w)
                        if took:
                            stream.new_weights(w.version)
                    while self._room(w) and (unit := self._hand_out()):
                        for e, p in unit:
                            stream.add((e, p), [self.rows[p]] * self.G, w.version)
                    done = stream.advance(w.version, POLL_S * 10) if len(stream) else []
                if self.stopping.is_set():
                    return
                for (e, p), version, made in done:
                    self.buffer.put(Finished(e, p, version, made))
                if not len(stream):  # every prompt this version can train is handed out and done
                    self.stopping.wait(POLL_S)
        except BaseException as e:  # noqa: BLE001 (raised in the trainer's thread by Buffer.take)
            self.stopping.set()
            self.buffer.fail(e)
        finally:
            w.stream = None
            if stream is not None:
                stream.close()

    def _room(self, w: Sampler) -> bool:
        """Whether more trajectories of ``w``'s version could train: it serves the steps from the trainer's
        next (:attr:`published`) to ``version + S``, a batch each; sampling beyond what the buffer holds and the
        calls sample would only go stale (sampled again: the sampler waits for newer weights instead)."""
        usable = (w.version + self.S - self.published + 1) * self.per_batch
        return len(self.ledger.in_flight) - len(self.taken) < usable

    def _hand_out(self) -> list[tuple[int, int]]:
        """The next sampler call's prompts ``(epoch, prompt id)``: up to :attr:`unit`, no prompt twice (one met
        again, from the next epoch, goes back to the queue uncounted: :meth:`Ledger.give_back`)."""
        unit: list[tuple[int, int]] = []
        while len(unit) < self.unit:
            handed = self.ledger.next_prompt()
            if handed is None:
                break
            if handed[1] in {p for _, p in unit}:
                self.ledger.give_back(*handed)
                break
            unit.append(handed)
        return unit

    def _sample(self, w: Sampler, unit: list[tuple[int, int]]) -> None:
        """One call of ``w`` over ``unit``'s prompts (``G`` rows each), each prompt's rows put in the buffer."""
        m, cfg, version = self.run.models, self.run.cfg, w.version
        mine = [p for _, p in unit]
        batch = prompt_batch(mine, m.strategy, self.G, self.ids, self.rows, m.tokenizer.pad_token_id)
        own = dataclasses.replace(m, source=w.source, tokenizer=w.tokenizer)
        made, _ = sample_batch(own, cfg, batch, self.params, self.run.state.sample_gen, w.model)
        owner = row_prompt_ids(made, batch.rows, mine, self.G)
        if self.stopping.is_set():
            return
        for e, p in unit:
            part = made.select([i for i, q in enumerate(owner) if q == p])
            self.buffer.put(Finished(e, p, version, part))


def producer_for(
    run: Any, ids: list[list[int]], rows: list[dict], params: Any, data: dict[str, Any]
) -> Producer | BoundedProducer:
    """The producer of ``run``'s batches: synchronous (``max_staleness=0``), ``fixed`` or ``bounded``; ``data``:
    a resumed checkpoint's data state (its pending batches or its ledger), empty for a new run."""
    if run.cfg.async_schedule == "bounded" and run.cfg.max_staleness > 0:
        return BoundedProducer(run, ids, rows, params, data.get("ledger"))
    return Producer(run, ids, rows, params, data.get("pending", []))

"""The bookkeeping of the bounded asynchronous schedule (``async_schedule=bounded``): which prompts of an epoch
are still to be sampled, which are trained (final), the buffer of finished trajectories a batch is taken
from, and :func:`concat`, which lays trajectories sampled apart out as one batch. The producer thread that
uses them is :mod:`shifu.trainers.ppo_bounded_producer`.

Numbering: as in ``trained.jsonl``, batch ``step`` (from 0: iteration ``step + 1``) is trained after ``step``
updates, and a trajectory sampled by version ``v`` (the policy after ``v`` updates) trained in batch ``step`` is
``step - v`` versions stale (``rollout/staleness``); the bound is ``step - v <= S``.

Exactly once by construction:

- :class:`Ledger` hands each prompt of an epoch out once at a time (:meth:`Ledger.next_prompt`); a prompt is
  final only when :meth:`Ledger.commit` records it trained. A trajectory too stale for its step goes back to
  the front of the queue (:meth:`Ledger.requeue`, counted), so it is sampled again, never trained past its bound
  and never lost.
- The checkpoint holds :meth:`Ledger.state`: each unfinished epoch's trained prompts, nothing in flight. A
  resumed ledger (:meth:`Ledger.from_state`) queues every prompt of the epoch not yet trained, in the epoch's
  order, so what was sampling or waiting in the buffer at a kill is sampled again and only trained prompts are
  final (``trained.jsonl``, trimmed to the checkpoint's step, says the same).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from shifu.data.batches import PromptStream
from shifu.rollout.batch import Trajectories


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s order of the ``n`` prompts: the permutation the synchronous run's prompt stream draws."""
    return PromptStream(n, n, seed, epoch=epoch).next()


class Ledger:
    """The prompts of a run by epoch: those queued, those handed out (in flight) and those trained. ``n``
    prompts, epochs ordered by ``seed``; ``epoch``: the first epoch not wholly trained, ``trained``: its (and
    later epochs') trained prompts, ``{epoch: [prompt ids]}``; ``total``: how many prompts the run trains over
    all its epochs (None: no end), the first ``total`` of the epochs' orders laid end to end, as the synchronous
    run's prompt stream draws them: so a bounded run trains the synchronous run's multiset of prompts, and its
    last batches hold only the stragglers."""

    def __init__(
        self,
        n: int,
        seed: int,
        epoch: int = 0,
        trained: dict[int, list[int]] | None = None,
        total: int | None = None,
    ) -> None:
        if n <= 0:
            raise ValueError(f"a ledger needs at least one prompt (got n={n})")
        self.n, self.seed, self.total = n, seed, total
        self.trained: dict[int, set[int]] = {int(e): set(p) for e, p in (trained or {}).items()}
        self.epoch = epoch  # the first epoch with prompts not trained
        self.in_flight: set[tuple[int, int]] = set()
        self.queue: collections.deque[tuple[int, int]] = collections.deque()
        self.queued_to = epoch - 1  # the last epoch whose prompts were put in the queue
        self.requeued = 0  # trajectories sent back as too stale (a metric)
        self.lock = threading.Lock()

    # ------------------------------------------------------------------------------------------- sampling
    def _queue_epoch(self) -> None:
        e = self.queued_to + 1
        done = self.trained.get(e, set())
        order = epoch_order(self.n, self.seed, e)
        if self.total is not None:  # the run's last epoch: its first prompts only
            order = order[: self.total - e * self.n]
        self.queue.extend((e, p) for p in order if p not in done)
        self.queued_to = e

    def next_prompt(self) -> tuple[int, int] | None:
        """The next prompt to sample, ``(epoch, prompt id)``: the queue's first, the next epoch's prompts queued
        when it is empty; None when the run's last epoch is all handed out (a re-queued prompt may come back:
        ask again). The prompt is in flight until :meth:`commit` or :meth:`requeue`."""
        with self.lock:
            while not self.queue:
                if self.total is not None and (self.queued_to + 1) * self.n >= self.total:
                    return None
                self._queue_epoch()
            item = self.queue.popleft()
            self.in_flight.add(item)
            return item

    def requeue(self, epoch: int, prompt_id: int) -> None:
        """A trajectory too stale to train: its prompt goes back to the front of the queue (counted)."""
        with self.lock:
            self.in_flight.remove((epoch, prompt_id))
            self.queue.appendleft((epoch, prompt_id))
            self.requeued += 1

    def give_back(self, epoch: int, prompt_id: int) -> None:
        """A prompt handed out and not sampled: back to the front of the queue, uncounted."""
        with self.lock:
            self.in_flight.remove((epoch, prompt_id))
            self.queue.appendleft((epoch, prompt_id))

    def commit(self, items: list[tuple[int, int]]) -> None:
        """``(epoch, prompt id)`` pairs trained by an update: final. An epoch wholly trained is forgotten."""
        with self.lock:
            for e, p in items:
                if (e, p) not in self.in_flight or p in self.trained.get(e, set()):
                    raise RuntimeError(f"prompt {p} of epoch {e} committed twice or never handed out")
                self.in_flight.remove((e, p))
                self.trained.setdefault(e, set()).add(p)
            while len(self.trained.get(self.epoch, ())) == self.n:
                del self.trained[self.epoch]
                self.epoch += 1

    # ----------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the first unfinished epoch and each unfinished epoch's trained prompts."""
        with self.lock:
            return {
                "epoch": self.epoch,
                "trained": {str(e): sorted(p) for e, p in sorted(self.trained.items())},
            }

    @classmethod
    def from_state(cls, n: int, seed: int, state: dict[str, Any], total: int | None = None) -> Ledger:
        """A ledger resumed from :meth:`state`: nothing in flight, every untrained prompt queued again."""
        trained = {int(e): list(p) for e, p in state["trained"].items()}
        return cls(n, seed, state["epoch"], trained, total)


@dataclasses.dataclass
class Finished:
    """A finished trajectory: its prompt (``epoch``, ``prompt_id``), the ``version`` that sampled it and the
    trajectory itself (``item``: one row of :class:`shifu.rollout.batch.Trajectories`)."""

    epoch: int
    prompt_id: int
    version: int
    item: Any


class Buffer:
    """Finished trajectories in the order they finished: a producer :meth:`put` s them, the trainer
    :meth:`take` s the first ``n`` fresh enough for its step."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.items: list[Finished] = []
        self.cond = threading.Condition()
        self.error: BaseException | None = None

    def put(self, done: Finished) -> None:
        with self.cond:
            self.items.append(done)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer stopped on ``error``: raised in the trainer's :meth:`take`."""
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def _drop_stale(self, oldest: int) -> int:
        keep, stale = [], 0
        for d in self.items:
            if d.version < oldest:
                self.ledger.requeue(d.epoch, d.prompt_id)
                stale += 1
            else:
                keep.append(d)
        self.items = keep
        return stale

    def take(self, step: int, n: int, S: int, timeout: float | None = None) -> tuple[list[Finished], int]:
        """The first ``n`` finished trajectories sampled by a version at least ``step - S`` -> (them, how
        many too stale were sent back to the queue meanwhile). Waits until ``n`` are there (``timeout``
        seconds at most: TimeoutError)."""
        oldest = step - S
        stale = 0
        with self.cond:
            while True:
                stale += self._drop_stale(oldest)
                if len(self.items) >= n:
                    out, self.items = self.items[:n], self.items[n:]
                    return out, stale
                if self.error is not None:
                    raise self.error
                if not self.cond.wait(timeout):
                    raise TimeoutError(f"{len(self.items)} of {n} trajectories finished in {timeout} s")


PROMPT_SIDE = ("prompt_ids", "prompt_mask")  # (B, P), left-padded; every other (B, T) tensor is (B, R)


def concat(parts: list[Trajectories], pad_token_id: int) -> Trajectories:
    """Trajectories sampled apart as one batch, in order: first inputs left-padded to the longest, the rest
    right-padded (pad ids in ``prompt_ids`` and ``ids``, zeros and False elsewhere), as one call of the source
    would have laid them out. ``counts`` keyed as the first part's; ``metrics`` each part's weighted by its rows."""
    first = parts[0]
    P = max(t.prompt_ids.shape[1] for t in parts)
    R = max(t.ids.shape[1] for t in parts)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        v = getattr(first, f.name)
        if isinstance(v, Tensor):
            fields[f.name] = torch.cat([_pad(getattr(t, f.name), f.name, P, R, pad_token_id) for t in parts])
        elif v is None:
            fields[f.name] = None
    keys = {k for t in parts for k in t.metrics}
    fields["metrics"] = {
        k: sum(t.metrics[k] * len(t) for t in parts if k in t.metrics)
        / sum(len(t) for t in parts if k in t.metrics)
        for k in sorted(keys)
    }
    fields["rows"] = [r for t in parts for r in t.rows]
    fields["transcripts"] = [x for t in parts for x in t.transcripts]
    fields["counts"] = {k: [c for t in parts for c in t.counts[k]] for k in first.counts}
    return Trajectories(**fields)


def _pad(v: Tensor, name: str, P: int, R: int, pad_token_id: int) -> Tensor:
    """One part's (B,), (B, P) or (B, R) tensor padded to the batch's P or R."""
    if v.dim() == 1:
        return v
    fill = pad_token_id if name in ("prompt_ids", "ids") else 0
    if name in PROMPT_SIDE:
        return F.pad(v, (P - v.shape[1], 0), value=fill)
    return F.pad(v, (0, R - v.shape[1]), value=fill)

"""The parts of ``async_schedule=bounded`` (:mod:`shifu.trainers.ppo_bounded`), alone: a producer thread samples
prompts one at a time from the ledger's queue into the buffer, the trainer takes the first ``batch_size`` done
that are fresh enough, and commits them. A straggler does not hold its batch; no trajectory is taken past its
bound (``step - version <= S``); one too stale is counted and sampled again; and a loop "killed" at random
points (its ledger, buffer and producer abandoned, resumed from the last checkpointed ledger state) trains every
prompt of each epoch exactly once, as an uninterrupted loop does. The trainer's use of them is
``test_async_bounded_run.py``'s."""

from __future__ import annotations

import collections
import random
import threading

import pytest
import torch

from shifu.rollout.batch import Part, Trajectory, stack
from shifu.trainers.ppo_bounded import Buffer, Finished, Ledger, concat, epoch_order

pytestmark = pytest.mark.unit


class Producer:
    """A real thread sampling one prompt per call of ``sample(prompt_id)`` with the version published at the
    start of the call, until stopped; its trajectories go to ``buffer``."""

    def __init__(self, ledger: Ledger, buffer: Buffer, sample) -> None:
        self.ledger, self.buffer, self.sample = ledger, buffer, sample
        self.version = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            handed = self.ledger.next_prompt()
            if handed is None:  # all handed out: wait for a re-queued one or the end
                self.stop.wait(0.001)
                continue
            e, p = handed
            v = self.version
            item = self.sample(p)
            if self.stop.is_set():
                return
            self.buffer.put(Finished(e, p, v, item))


def train(n, seed, S, batch, epochs, sample, kills=()):
    """The iterations of ``epochs`` epochs (``batch`` divides ``epochs * n``); ``kills``: the steps after whose
    checkpoint the loop is abandoned and resumed from that checkpoint. -> (trained log as (epoch, prompt, step,
    version), stale count)."""
    log, stale_total, step, steps = [], 0, 0, epochs * n // batch
    ledger = Ledger(n, seed, total=epochs * n)
    buffer = Buffer(ledger)
    producer = Producer(ledger, buffer, sample)
    while step < steps:
        got, stale = buffer.take(step, batch, S, timeout=30)
        stale_total += stale
        ledger.commit([(d.epoch, d.prompt_id) for d in got])
        log += [(d.epoch, d.prompt_id, step, d.version) for d in got]
        producer.version = step + 1  # the update: version `step + 1` published between sampler calls
        checkpoint = ledger.state()
        if step in kills:  # SIGKILL after the checkpoint: everything in flight or buffered is lost
            producer.stop.set()
            ledger = Ledger.from_state(n, seed, checkpoint, epochs * n)
            buffer = Buffer(ledger)
            producer = Producer(ledger, buffer, sample)
            producer.version = step + 1
        step += 1
    producer.stop.set()
    return log, stale_total


def per_epoch(log):
    out = collections.defaultdict(list)
    for e, p, _, _ in log:
        out[e].append(p)
    return {e: sorted(p) for e, p in out.items()}


def test_epoch_order_is_the_prompt_streams():
    from shifu.data.batches import PromptStream

    stream = PromptStream(10, 10, seed=3)
    assert epoch_order(10, 3, 0) == stream.next()
    assert epoch_order(10, 3, 1) == stream.next()


@pytest.mark.parametrize("S", [0, 1, 2])
def test_straggled_run_trains_each_prompt_once_within_bound(S):
    """Prompt 0, 5 and 9 are slow (they sleep): batches still fill with the others."""
    n, batch = 12, 4

    def sample(p):
        if p in (0, 5, 9):
            threading.Event().wait(0.02)
        return f"response to {p}"

    log, _ = train(n, seed=0, S=S, batch=batch, epochs=3, sample=sample)
    assert all(step - v <= S for _, _, step, v in log)
    assert per_epoch(log) == {e: list(range(n)) for e in range(3)}


def test_a_straggler_does_not_hold_its_batch():
    """Prompt ids in the epoch's order: the first is held until released; the first batch is taken without it."""
    n = 8
    first = epoch_order(n, 0, 0)[0]
    release = threading.Event()
    ledger = Ledger(n, 0)
    buffer = Buffer(ledger)
    producers = [Producer(ledger, buffer, lambda p: release.wait() if p == first else p) for _ in range(2)]
    got, _ = buffer.take(0, 4, 0, timeout=30)
    assert first not in [d.prompt_id for d in got]
    ledger.commit([(d.epoch, d.prompt_id) for d in got])
    release.set()
    for pr in producers:
        pr.stop.set()
    assert first in {p for _, p in ledger.in_flight} | {d.prompt_id for d in buffer.items}


def test_too_stale_is_requeued_counted_and_not_lost():
    ledger = Ledger(4, 0)
    buffer = Buffer(ledger)
    handed = [ledger.next_prompt() for _ in range(4)]
    for (e, p), v in zip(handed, [0, 3, 1, 3]):
        buffer.put(Finished(e, p, v, None))
    got, stale = buffer.take(step=4, n=2, S=1)  # oldest allowed: version 3
    assert [d.version for d in got] == [3, 3] and stale == 2 and ledger.requeued == 2
    assert {ledger.next_prompt(), ledger.next_prompt()} == {handed[0], handed[2]}  # back at the queue's front


def test_commit_twice_is_refused():
    ledger = Ledger(3, 0)
    e, p = ledger.next_prompt()
    ledger.commit([(e, p)])
    with pytest.raises(RuntimeError, match="committed twice"):
        ledger.commit([(e, p)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_and_resumed_trains_the_same_multiset(seed):
    n, batch, S = 10, 3, 1
    rnd = random.Random(seed)

    def sample(p):
        if rnd.random() < 0.2:
            threading.Event().wait(0.01)
        return p

    whole, _ = train(n, 0, S, batch, 3, sample)
    killed, _ = train(n, 0, S, batch, 3, sample, kills=set(rnd.sample(range(0, 9), 3)))
    assert per_epoch(killed) == per_epoch(whole) == {e: list(range(n)) for e in range(3)}
    assert all(step - v <= S for _, _, step, v in killed)


def trajectory(i: int) -> Trajectory:
    """Trajectory ``i``: a first input of 2 + i % 3 ids and i % 4 + 1 turns of 1 + i % 2 sampled ids and one read."""
    parts = []
    for turn in range(i % 4 + 1):
        n = 1 + i % 2
        stats = [(-0.1 * (i + k), 0.5, 0.01 * k) for k in range(n)]
        parts += [Part([3 + k for k in range(n)], True, stats, reward=i + turn), Part([7], False)]
    return Trajectory(
        {"i": i}, list(range(5, 7 + i % 3)), parts, truncated=i % 5 == 0, counts={"turns": i % 4}
    )


@pytest.mark.parametrize("cuts", [[1], [3, 4], [1, 2, 5]])
def test_concat_lays_out_the_batch_as_one_call(cuts):
    """Trajectories made apart and put together equal those made at once, tensor for tensor."""
    trajs = [trajectory(i) for i in range(7)]
    whole = stack(trajs, pad_token_id=0, log_probs=True, values=True)
    bounds = [0, *cuts, len(trajs)]
    parts = [stack(trajs[a:b], 0, True, True) for a, b in zip(bounds, bounds[1:])]
    for part, (a, b) in zip(parts, zip(bounds, bounds[1:])):
        object.__setattr__(
            part, "metrics", {"env/turns": float(sum(i % 4 + 1 for i in range(a, b))) / (b - a)}
        )
    joined = concat(parts, pad_token_id=0)
    for f in ("prompt_ids", "prompt_mask", "ids", "trainable", "attention", "rewards", "truncated", "failed"):
        assert torch.equal(getattr(joined, f), getattr(whole, f)), f
    for f in ("log_probs", "entropy", "values", "turn_ends"):
        assert torch.equal(getattr(joined, f), getattr(whole, f)), f
    assert joined.rows == whole.rows and joined.transcripts == whole.transcripts
    assert joined.counts == whole.counts
    assert joined.metrics["env/turns"] == pytest.approx(sum(i % 4 + 1 for i in range(7)) / 7)


def test_a_prompt_given_back_is_next_and_uncounted():
    """A sampler that meets a prompt twice in one call's hand-out (two epochs) gives the second back."""
    ledger = Ledger(3, 0)
    first = [ledger.next_prompt() for _ in range(3)]
    again = ledger.next_prompt()  # epoch 1's first prompt
    ledger.give_back(*again)
    assert ledger.requeued == 0 and again not in ledger.in_flight
    assert ledger.next_prompt() == again and len(ledger.in_flight) == 4 and again[0] == 1 != first[0][0]

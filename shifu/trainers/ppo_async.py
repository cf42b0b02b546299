"""Where a PPO iteration's batch comes from, synchronous or asynchronous (``max_staleness=S``,
``async_schedule=fixed``): the one seam between sampling and training. The trainer asks
:meth:`Producer.batch_for` for the batch of iteration ``k`` and publishes nothing else; staleness, the pending
batches and the sampler's copy of the weights live here (``async_schedule=bounded``'s producer, with the same
interface, in :mod:`shifu.trainers.ppo_bounded_producer`).

``S = 0`` is the synchronous run: iteration ``k``'s batch is sampled when it is asked for, by the actor itself
(version ``k - 1``: the policy after ``k - 1`` updates). ``S > 0``, ``fixed``: iteration ``k`` trains a batch
sampled by version ``max(0, k - 1 - S)``, whatever the timing. While iteration ``k`` scores and trains its batch,
a background thread samples the batch of iteration ``k + S`` from a copy of version ``k - 1``'s weights (the only
extra copy of the policy's weights: refreshed between two sampler calls, never during one); the first ``S``
batches are sampled by version 0 before the first update. The prompts and the sampling generator are consumed in
batch order, so a fixed run repeats bit for bit.

Exactly once across kills: a checkpoint after iteration ``k`` holds the ``S`` batches sampled and not yet
trained (``k + 1 .. k + S``, as JSON: :func:`pack`), with the prompt stream's and the sampling generator's
positions after them; a resumed run trains them, then samples on from there, and ends bit-identical to the
uninterrupted run. A batch the checkpoint lacks (a run extended by a larger ``iterations``, or one whose
sampling a reward service interrupted) is sampled when it is needed, by the weights of that moment.

Each trajectory carries the version that sampled it; :func:`record_trained` writes ``trained.jsonl``, where batch
``k`` (iteration ``k + 1``) is ``step`` ``k``, sampled by version ``max(0, k - S)``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from shifu.data.batches import PromptStream
from shifu.rewards.remote import RewardServiceUnavailable
from shifu.rollout.batch import Trajectories, Transcript
from shifu.runs import rng
from shifu.trainers.ppo_rollout import prompt_batch, sample_batch

TRAINED = "trained.jsonl"  # one line per trained trajectory: prompt_id, step, version


@dataclasses.dataclass
class Sampled:
    """A sampled batch waiting for its iteration: ``step`` (the iteration that trains it), ``version`` (the
    policy version that sampled it: the number of updates before it), ``prompt_ids`` (each row's prompt: its
    index among the run's training prompts), the trajectories and the seconds their sampling took."""

    step: int
    version: int
    prompt_ids: list[int]
    made: Trajectories
    t_gen: float
    versions: list[int] | None = None  # each row's version, when they differ (async_schedule=bounded)

    def rows_trained(self, kept: list[int]) -> tuple[list[int] | int, list[int]]:
        """``(the versions, the prompt ids)`` of the rows ``kept`` (positions in :attr:`made`: the rows left after
        the non-finite scores were dropped): :func:`record_trained`'s."""
        versions = [self.versions[i] for i in kept] if self.versions is not None else self.version
        return versions, [self.prompt_ids[i] for i in kept]


class Producer:
    """The batches of a run's iterations (see the module docstring). ``run`` is the
    :class:`shifu.trainers.ppo_run.Run` (its models, state, config, prompt stream and loop counters); ``ids``
    / ``rows`` the training prompts and their data rows; ``pending``: a checkpoint's batches (:meth:`state`)."""

    def __init__(
        self, run: Any, ids: list[list[int]], rows: list[dict], params: Any, pending: list[dict] | None = None
    ) -> None:
        self.run, self.ids, self.rows, self.params = run, ids, rows, params
        self.S = run.cfg.max_staleness
        self.pending: list[Sampled] = []
        self.load_state(pending or [])
        self.sampler: nn.Module | None = None  # the copy of the weights the background thread samples from
        self.thread: threading.Thread | None = None
        self.outcome: dict[str, Any] = {}

    # -------------------------------------------------------------------------------------------- sampling
    def _position(self) -> tuple[Any, ...]:
        """Where sampling stands: the prompt stream's position, the sampling generator's state, and (in the
        trainer's thread) the global generators'."""
        run = self.run
        here = threading.current_thread() is threading.main_thread()
        return run.stream.state(), run.state.sample_gen.get_state(), rng.rng_state() if here else None

    def _rewind(self, before: tuple[Any, ...]) -> None:
        """Sampling back to ``before`` (:meth:`_position`): a batch whose sampling failed is sampled again."""
        run, cfg = self.run, self.run.cfg
        run.stream = PromptStream(len(self.ids), cfg.batch_size // cfg.group_size, cfg.seed, **before[0])
        run.state.sample_gen.set_state(before[1])
        if before[2] is not None:
            rng.set_rng_state(before[2])

    def _sample(self, step: int, sampler: nn.Module | None) -> Sampled:
        """The batch of iteration ``step``: the stream's next prompts, sampled by ``sampler`` (None: the
        actor). A failure (the reward service gone) rewinds sampling to where it was, on every rank."""
        run = self.run
        m, cfg = run.models, run.cfg
        before = self._position()
        try:
            indices = run.stream.next()
            batch = prompt_batch(
                indices, m.strategy, cfg.group_size, self.ids, self.rows, m.tokenizer.pad_token_id
            )
            made, t_gen = sample_batch(m, cfg, batch, self.params, run.state.sample_gen, sampler)
        except RewardServiceUnavailable:
            self._rewind(before)
            raise
        mine, _ = m.strategy.share(indices)
        ids = row_prompt_ids(made, batch.rows, mine, cfg.group_size)
        return Sampled(step, run.loop["iteration"], ids, made, t_gen)

    def _refresh(self) -> nn.Module:
        """The sampler's copy, set to the actor's current weights (between two sampler calls)."""
        self.sampler = weights_copy(self.sampler, self.run.models.decoder())
        return self.sampler

    def batch_for(self, step: int) -> Sampled:
        """The batch iteration ``step`` trains. ``S > 0``: the batches up to ``step + S - 1`` sampled first if
        missing (by the current weights), then the background sampling of batch ``step + S`` started (call
        :meth:`join` after the update)."""
        if self.S == 0:
            return self._sample(step, None)
        last = min(step + self.S - 1, self.run.cfg.iterations)
        produced = self.pending[-1].step if self.pending else step - 1
        while produced < last:
            produced += 1
            self.pending.append(self._sample(produced, self._refresh()))
        batch = self.pending.pop(0)
        assert batch.step == step, (batch.step, step)
        staleness = {"rollout/staleness": step - 1 - batch.version}  # logged with the source's metrics
        batch = dataclasses.replace(
            batch, made=dataclasses.replace(batch.made, metrics=batch.made.metrics | staleness)
        )
        if step + self.S <= self.run.cfg.iterations:
            sampler = self._refresh()
            self.outcome = {}
            self.thread = threading.Thread(
                target=self._background, args=(step + self.S, sampler), name="shifu-ppo-sampler", daemon=True
            )
            self.thread.start()
        return batch

    def _background(self, step: int, sampler: nn.Module) -> None:
        try:
            self.outcome["batch"] = self._sample(step, sampler)
        except BaseException as e:  # noqa: BLE001 (raised in the trainer's thread by join)
            self.outcome["error"] = e

    def join(self) -> None:
        """Wait for the background sampling; its batch joins the pending ones, or its error is raised here."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        if "error" in self.outcome:
            raise self.outcome["error"]
        self.pending.append(self.outcome["batch"])

    # ----------------------------------------------------------------------------------------- checkpoints
    def paused(self) -> contextlib.AbstractContextManager:
        """Nothing samples in the background while an evaluation runs (between :meth:`join` and the next
        :meth:`batch_for`): :class:`shifu.trainers.ppo_bounded_producer.BoundedProducer`'s interface."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """A background sampling still running (an error between :meth:`batch_for` and :meth:`join`) waited
        for, its outcome dropped."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint's data keeps: ``pending``, the batches sampled and not yet trained (``S > 0``)."""
        return {"pending": self.pending_state()} if self.S > 0 else {}

    def pending_state(self) -> list[dict[str, Any]]:
        """The pending batches as JSON."""
        return [
            {
                "step": b.step,
                "version": b.version,
                "prompt_ids": b.prompt_ids,
                "t_gen": b.t_gen,
                "made": pack(b.made),
            }
            for b in self.pending
        ]

    def load_state(self, pending: list[dict[str, Any]]) -> None:
        """The pending batches of a checkpoint (:meth:`state`)."""
        self.pending = [
            Sampled(b["step"], b["version"], b["prompt_ids"], unpack(b["made"]), b["t_gen"]) for b in pending
        ]


def weights_copy(held: nn.Module | None, live: nn.Module) -> nn.Module:
    """A sampler's frozen copy of ``live`` with its current weights: ``held`` overwritten in place, or a new copy
    when there is none yet."""
    if held is None:
        held = copy.deepcopy(live).eval()
        held.requires_grad_(False)
        return held
    with torch.no_grad():
        for dst, src in zip(held.state_dict().values(), live.state_dict().values()):
            dst.copy_(src)
    return held


def row_prompt_ids(made: Trajectories, batch_rows: list[dict], mine: list[int], G: int) -> list[int]:
    """Each trajectory's prompt (its index among the training prompts): the batch's rows are prompts ``mine``,
    each ``G`` times; a source that makes more rows than prompts (an agent's forks) keeps each row's data row."""
    per_row = [i for i in mine for _ in range(G)]
    by_identity = {id(r): p for r, p in zip(batch_rows, per_row)}
    out = []
    for r in made.rows:
        if id(r) in by_identity:
            out.append(by_identity[id(r)])
        else:  # a copy of its data row
            out.append(next(p for b, p in zip(batch_rows, per_row) if b == r))
    return out


def record_trained(
    out: Path, step: int, version: int | list[int], prompt_ids: list[int], strategy: Any
) -> None:
    """``trained.jsonl``: a line per trajectory of batch ``step`` (``prompt_id``, ``step``, ``version``), every
    rank's in rank order, written by rank 0 (call on every rank). ``step`` counts the updates made before it
    (iteration ``step + 1`` of ``metrics.jsonl`` trains it), so a synchronous run's lines have
    ``version == step``, a fixed one's ``version == max(0, step - S)`` and a bounded one's
    ``step - version <= S`` (``version``: one per trajectory there)."""
    versions = version if isinstance(version, list) else [version] * len(prompt_ids)
    pairs = [x for share in strategy.gather(list(zip(prompt_ids, versions))) for x in share]
    if not strategy.is_main:
        return
    with open(out / TRAINED, "a", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt_id": p, "step": step, "version": v}) + "\n" for p, v in pairs)


# ---------------------------------------------------------------------------------------------- JSON packing
def pack(made: Trajectories) -> dict[str, Any]:
    """Trajectories as JSON, exactly: a tensor as its dtype, shape and values (a float32 or bfloat16 value
    written as a Python float reads back to the same bits), transcripts as their spans."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(made):
        v = getattr(made, f.name)
        if isinstance(v, Tensor):
            v = {
                "dtype": str(v.dtype).removeprefix("torch."),
                "shape": list(v.shape),
                "values": v.flatten().tolist(),
            }
        elif f.name == "transcripts":
            v = [{"spans": [list(s) for s in t.spans], "response": t.response} for t in v]
        out[f.name] = v
    return out


def unpack(d: dict[str, Any]) -> Trajectories:
    """:func:`pack`'s inverse."""
    kw: dict[str, Any] = {}
    for name, v in d.items():
        if isinstance(v, dict) and set(v) == {"dtype", "shape", "values"}:
            v = torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
        elif name == "transcripts":
            v = [Transcript(tuple(tuple(s) for s in t["spans"]), t["response"]) for t in v]
        kw[name] = v
    return Trajectories(**kw)

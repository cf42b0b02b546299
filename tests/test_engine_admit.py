"""Requests admitted into a running decode (``Engine.run_admitting``, shifu.generation.continuous) on real tiny
GPT-2 and Llama models: a row's ids are the same whether its request ran alone, in a static batch or joined a
decode already under way (its prompt longer or shorter than the columns before it, the loop emptied and refilled),
with per-row generators (recorded completions) and greedy; its log-probs agree with the static path's and the
trainer's recomputation within 1e-5; each request is delivered as its last row ends. Through the gateway's
queue (shifu.http.batching, admitting): a request that arrives while a call decodes joins it, and a short one comes
back before the long one it joined ends; a request of another setting waits for the call."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_prefix_cache import policy, words

from shifu.gateway.engine import Engine, Job
from shifu.generation.rollout import policy_forward
from shifu.http.batching import BatchQueue

pytestmark = pytest.mark.integration

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    from conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


def jobs(tok, greedy: bool) -> list[Job]:
    """Five requests: prompts of 40, 60, 22, 80 and 30 tokens sharing a 20-token head (a whole block of the prefix
    cache), mixed budgets, one with two choices."""
    head = words(tok, 20, seed=3)
    spec = [(20, 24, 1), (40, 6, 1), (2, 15, 2), (60, 10, 1), (10, 9, 1)]
    out = []
    for i, (extra, budget, n) in enumerate(spec):
        prompt = head + words(tok, extra, seed=20 + i)
        identity = None if greedy else (i, 0)
        out.append(
            Job(prompt, n=n, budget=budget, stops=[], temperature=0.9, greedy=greedy, identity=identity)
        )
    return out


class Feed:
    """A feed handing the engine's loop ``plan[step]`` jobs after its step ``step``, and ``last`` once every job
    before has been delivered (each through ``accept``)."""

    def __init__(self, plan: dict[int, list[Job]], last: list[Job] = (), first: int = 1):
        self.plan, self.last, self.step, self.delivered = plan, list(last), 0, []
        self.given = first + sum(len(j) for j in plan.values())

    def more(self, accept) -> list:
        self.step += 1
        due = self.plan.pop(self.step, [])
        if self.last and not self.plan and len(self.delivered) == self.given:
            due, self.last = self.last, []
        assert all(accept(j) for j in due)
        return due

    def deliver(self, index: int, choices) -> None:
        self.delivered.append((index, self.step))


def engine_for(tok, arch: str) -> Engine:
    return Engine(policy(tok, arch), tok, max_batch_rows=16, max_batch_tokens=1 << 20, seed=5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("greedy", [False, True])
def test_a_row_samples_the_same_alone_in_a_static_batch_and_admitted_mid_decode(tok, arch, greedy):
    engine = engine_for(tok, arch)
    a, b, c, d, e = jobs(tok, greedy)
    alone = [engine.run([j])[0] for j in (a, b, c, d, e)]
    engine.prefix.clear()
    static = [g for g in engine.run([a, b, c, d])] + engine.run([e])
    engine.prefix.clear()
    engine.prefix.reused_tokens = 0
    # b after step 2; c (shorter than the columns before it) and d (longer: the cache is laid out again) after
    # step 5; e once every other row has ended (the loop emptied and refilled)
    feed = Feed({2: [b], 5: [c, d]}, last=[e])
    admitted = engine.run_admitting([a], feed)
    # the head's block, kept as a was admitted, copied for b, d and e (c is prefilled whole beside d, whose
    # uncached part is longer than c's prompt)
    assert engine.prefix.reused_tokens == 16 * 3
    assert not feed.plan and not feed.last
    ends = {i: step for i, step in feed.delivered}
    assert sorted(ends) == [0, 1, 2, 3, 4]
    assert ends[1] < ends[0] and ends[4] == max(ends.values())  # delivered as each ended, not at the end
    model = engine.model
    order = [a, b, c, d, e]
    for job, one, batch, joined in zip(order, alone, static, admitted):
        for x, y, z in zip(one, batch, joined):
            assert x.ids == y.ids == z.ids and x.ended == y.ended == z.ended
            torch.testing.assert_close(
                torch.tensor(z.log_probs), torch.tensor(y.log_probs), rtol=0, atol=1e-5
            )
            torch.testing.assert_close(torch.tensor(z.entropy), torch.tensor(y.entropy), rtol=0, atol=1e-5)
            full = torch.tensor([job.prompt_ids + z.ids])
            want = policy_forward(
                model, full, torch.ones_like(full), len(job.prompt_ids), 1.0 if greedy else 0.9
            )
            torch.testing.assert_close(torch.tensor([z.log_probs]), want[0], rtol=0, atol=1e-5)
    lengths = [len(ch.ids) for g in admitted for ch in g]
    assert len(set(lengths)) > 2  # rows ended at different steps


def test_a_seeded_request_repeats_and_runs_as_a_call_of_its_own(tok):
    engine = engine_for(tok, "gpt2")
    job = jobs(tok, False)[2]
    job.identity, job.seed = None, 11
    assert not engine.admits(job)
    first = engine.run_admitting([job], Feed({}))
    again = engine.run_admitting([job], Feed({}))
    static = engine.run([job])
    assert [c.ids for c in first[0]] == [c.ids for c in again[0]] == [c.ids for c in static[0]]


def test_the_queue_admits_a_request_into_the_running_call_and_delivers_it_first(tok):
    engine = engine_for(tok, "gpt2")
    long, short, _, _, other = jobs(tok, False)
    long.budget = 40
    other.temperature = 0.5  # another setting: may not join
    started, queued = threading.Event(), threading.Event()

    def on_text(choice: int, token: int, text: str) -> None:  # the long call's first token: hold it there
        if not started.is_set():
            started.set()
            assert queued.wait(30)

    long.on_text = on_text

    async def main():
        executor = ThreadPoolExecutor(1)
        queue = BatchQueue(engine.run_admitting, executor, engine.joins, admitting=True)
        calls = engine.calls
        first = asyncio.ensure_future(queue.submit(long))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        second = asyncio.ensure_future(queue.submit(short))
        third = asyncio.ensure_future(queue.submit(other))
        await asyncio.sleep(0)  # both pending
        queued.set()
        got = await second
        assert not first.done()  # the short request came back while the long one decodes
        await asyncio.gather(first, third)
        await queue.close()
        executor.shutdown(wait=True)
        assert engine.calls == calls + 2  # long and short in one call; the other setting in a call after it
        return first.result(), got, third.result()

    long_choices, short_choices, _ = asyncio.run(main())
    long.on_text = None
    assert long_choices[0].ids == engine.run([long])[0][0].ids
    assert short_choices[0].ids == engine.run([short])[0][0].ids
    assert len(long_choices[0].ids) > len(short_choices[0].ids)

"""Paged keys and values of the admitting decode loop (shifu.generation.paged, shifu.generation.continuous) on
real tiny GPT-2 and Llama models: the block pool's accounting (reservations, blocks allocated lowest first and
zeroed, returned as rows end, never above the budget); requests decoded through a pool so small that they must
wait for each other come back with the same ids as with an unlimited budget and as static calls, log-probs within
1e-5 of the static path's and the trainer's recomputation, their rows crossing block boundaries as they decode,
the pool's own peak within its budget; a request bigger than the whole budget is refused with a message saying
what to do, by the engine and over HTTP (400 kv_budget_exceeded), and never hangs."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_engine_admit import jobs
from test_prefix_cache import policy

from shifu.gateway.engine import Engine, Job
from shifu.generation.continuous import Row, Running
from shifu.generation.decode import kv_shape
from shifu.generation.kv_cache import BLOCK
from shifu.generation.paged import BlockPool, block_bytes
from shifu.generation.rollout import SamplingParams, policy_forward
from shifu.http.batching import BatchQueue

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    from conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.mark.unit
def test_the_pool_reserves_allocates_lowest_first_zeroed_and_takes_blocks_back():
    shape, like = (2, 3, 4), torch.zeros(1)
    size = block_bytes(shape, torch.float32)
    assert size == 2 * 2 * 3 * BLOCK * 4 * 4
    pool = BlockPool(5 * size + size // 2, shape, like)  # room for 5 whole blocks
    assert pool.capacity == 5 and pool.budget_bytes == 5 * size
    assert pool.reserve(3) and pool.reserve(2) and not pool.reserve(1)  # full: refused, nothing promised
    assert pool.reserved == 5
    with pytest.raises(ValueError, match="more than the whole budget"):
        pool.reserve(6)
    a = pool.allocate(2)
    b = pool.allocate(1)
    assert a == [0, 1] and b == [2]
    pool.k[:, :, 1] = float("nan")
    pool.release([1], 0)  # (as a row ends: its blocks back)
    assert pool.used == 2 and pool.reserved == 5
    c = pool.allocate(1)
    assert c == [1] and torch.equal(pool.k[:, :, 1], torch.zeros_like(pool.k[:, :, 1]))  # reused, zeroed
    with pytest.raises(RuntimeError, match="than reserved"):
        pool.allocate(3)
    k = torch.randn(2, 3, 20, 4)
    v = torch.randn(2, 3, 20, 4)
    more = pool.allocate(2)
    pool.write(more, k, v)
    got_k, got_v = pool.read(more, 20)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert pool.peak == 5 and pool.counters()["peak_bytes"] == 5 * size <= pool.budget_bytes
    pool.release([0, 2], 3)
    pool.release([1, *more], 2)
    assert pool.reserved == pool.used == 0 and pool.k is None  # the storage goes with the last reservation
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool(size - 1, shape, like)


def served(engine: Engine, batch: list[Job]) -> list:
    """Every job of ``batch`` submitted at once to an admitting queue on ``engine``: their choices."""

    async def main():
        executor = ThreadPoolExecutor(1)
        queue = BatchQueue(engine.run_admitting, executor, engine.joins, admitting=True)
        out = await asyncio.wait_for(asyncio.gather(*(queue.submit(j) for j in batch)), 120)
        await queue.close()
        executor.shutdown(wait=True)
        return out

    return asyncio.run(main())


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("greedy", [False, True])
def test_requests_wait_for_a_small_pool_and_sample_what_an_unlimited_one_does(tok, arch, greedy):
    model = policy(tok, arch)
    batch = jobs(tok, greedy)
    size = block_bytes(kv_shape(model), torch.float32)
    unlimited = Engine(model, tok, max_batch_rows=16, max_batch_tokens=1 << 20, seed=5)
    # room for the largest request (6 blocks) and little more: most requests wait for others to end
    small = Engine(model, tok, max_batch_rows=16, max_batch_tokens=1 << 20, seed=5, kv_budget_bytes=8 * size)
    assert max(small.kv_need(j) for j in batch) == 6 and sum(small.kv_need(j) for j in batch) == 3 * 8
    assert small.kv_blocks() == 8
    static = [unlimited.run([j])[0] for j in batch]
    free = served(unlimited, batch)
    tight = served(small, batch)
    counters = small.kv_counters()
    assert counters["waits"] > 0 and unlimited.kv_counters()["waits"] == 0  # requests waited for room
    assert 0 < counters["peak_bytes"] <= counters["budget_bytes"] == 8 * size  # the pool's own accounting
    assert unlimited.kv_counters()["peak_bytes"] > counters["peak_bytes"]
    crossed = 0
    for job, one, a, b in zip(batch, static, free, tight):
        for x, y, z in zip(one, a, b):
            assert x.ids == y.ids == z.ids and x.ended == y.ended == z.ended
            torch.testing.assert_close(
                torch.tensor(z.log_probs), torch.tensor(x.log_probs), rtol=0, atol=1e-5
            )
            torch.testing.assert_close(
                torch.tensor(z.log_probs), torch.tensor(y.log_probs), rtol=0, atol=1e-5
            )
            full = torch.tensor([job.prompt_ids + z.ids])
            want = policy_forward(
                model, full, torch.ones_like(full), len(job.prompt_ids), 1.0 if greedy else 0.9
            )
            torch.testing.assert_close(torch.tensor([z.log_probs]), want[0], rtol=0, atol=1e-5)
            held = len(job.prompt_ids) + len(z.ids) - 1  # tokens fed to the decoder
            crossed += (held - 1) // BLOCK > (len(job.prompt_ids) - 1) // BLOCK
    assert crossed >= 2  # rows grew into blocks past their prompt's while decoding


@pytest.mark.integration
def test_a_request_bigger_than_the_whole_budget_is_refused_with_what_to_do(tok):
    model = policy(tok, "gpt2")
    size = block_bytes(kv_shape(model), torch.float32)
    engine = Engine(model, tok, kv_budget_bytes=4 * size)
    fits = Job(list(range(3, 40)), n=1, budget=20, stops=[], temperature=1.0)
    big = Job(list(range(3, 40)), n=1, budget=40, stops=[], temperature=1.0)
    assert engine.kv_need(fits) == 4 and engine.too_big(fits) is None
    why = engine.too_big(big)
    assert "KV budget" in why and "--kv-budget-mb" in why and "max_tokens" in why
    big.seed = 3  # a seeded request runs as a static call of its own, outside the pool
    assert engine.too_big(big) is None
    params = SamplingParams(max_new_tokens=40)
    loop = Running(model, params, tok.eos_token_id, tok.pad_token_id, print, kv_budget_bytes=4 * size)
    assert loop.room(4 * BLOCK) and not loop.room(4 * BLOCK + 1)
    with pytest.raises(ValueError, match="whole budget"):
        loop.admit([Row(list(range(3, 40)), 40)])
    assert loop.pool.reserved == 0 and not loop.rows


@pytest.mark.integration
def test_the_gateway_answers_400_for_a_request_the_budget_can_never_hold():
    openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
    pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
    from test_gateway import QUESTION, TOKEN, chat_tokenizer, error_of, tiny_policy

    from shifu.gateway import Gateway, Sampling

    tok = chat_tokenizer()
    model = tiny_policy(tok)
    mb = 6 * block_bytes(kv_shape(model), torch.float32) / 2**20  # 96 tokens
    gw = Gateway(model, tok, token=TOKEN, sampling=Sampling(max_tokens=200), kv_budget_mb=mb).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
        ok = client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=8)
        assert ok.choices[0].message is not None
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=150)
        error = error_of(e.value)
        assert error["code"] == "kv_budget_exceeded" and error["param"] == "max_tokens"
        assert "--kv-budget-mb" in e.value.message
    finally:
        gw.close()


@pytest.mark.integration
def test_rows_admitted_together_prefill_in_runs_and_sample_the_same(tok, monkeypatch):
    import shifu.generation.continuous as continuous

    model = policy(tok, "llama")
    batch = jobs(tok, False)
    whole = served(Engine(model, tok, max_batch_rows=16, max_batch_tokens=1 << 20, seed=5), batch)
    monkeypatch.setattr(continuous, "PREFILL_TOKENS", 150)  # one or two rows a prefill
    chunks = continuous._chunks([Row(j.prompt_ids, j.budget) for j in batch], 150)
    assert [len(c) for c in chunks] == [2, 1, 1, 1]
    engine = Engine(model, tok, max_batch_rows=16, max_batch_tokens=1 << 20, seed=5)
    runs = served(engine, batch)
    assert engine.prefix.reused_tokens >= 16 * 3  # later runs reuse the head block the first one kept
    for a, b in zip(whole, runs):
        for x, y in zip(a, b):
            assert x.ids == y.ids
            torch.testing.assert_close(
                torch.tensor(y.log_probs), torch.tensor(x.log_probs), rtol=0, atol=1e-5
            )


@pytest.mark.unit
@torch.no_grad()
def test_rows_sharing_a_head_prefill_it_once_and_sample_the_same(tok):
    from test_prefix_cache import words

    from shifu.generation.kv_cache import PrefixCache

    model = policy(tok, "gpt2")
    head = words(tok, 3 * BLOCK + 5, seed=11)  # a system prompt and tools block every row starts with
    prompts = [head + words(tok, 4 + k, seed=k) for k in range(6)]

    def admitted(prefix):
        ended = []
        loop = Running(
            model,
            SamplingParams(8, greedy=True),
            tok.eos_token_id,
            tok.pad_token_id,
            ended.append,
            None,
            prefix,
            6,
        )
        loop.admit([Row(p, 8, tag=k) for k, p in enumerate(prompts)])
        while loop.rows:
            loop.step()
        return sorted(ended, key=lambda r: r.tag)

    cache = PrefixCache(1 << 24)
    shared, alone = admitted(cache), admitted(None)
    # the first row's head is prefilled once; the five others, prefilled together over the columns of their
    # longest part not cached, copy the rest from its 3 whole blocks
    width = max(len(p) - 3 * BLOCK for p in prompts[1:])
    assert cache.reused_tokens == sum(len(p) - width for p in prompts[1:]) > 5 * 2 * BLOCK
    assert cache.prefill_tokens == sum(map(len, prompts)) - cache.reused_tokens
    for a, b in zip(shared, alone):
        assert a.ids == b.ids
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), rtol=0, atol=1e-5)

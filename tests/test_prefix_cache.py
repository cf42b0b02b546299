"""Prefix reuse (shifu.generation.kv_cache) in the gateway's engine on real tiny GPT-2 and Llama models: agent
episodes of three turns, each turn's prompt the last prompt and completion plus an observation, sampled with the
recorded completions' per-row generators. With the cache on, the sampled ids are those sampled with it off and
the log-probs agree within 1e-5 (and with the trainer's recomputation), while most prompt tokens are copied
from the cache instead of prefilled; a rewritten history reuses only the blocks it shares; a budget too small
for the episodes evicts blocks and changes nothing sampled; new weights empty the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from shifu.gateway.engine import Engine, Job
from shifu.generation.kv_cache import PrefixCache
from shifu.generation.rollout import policy_forward
from shifu.models.loading import build_tiny_gpt2

pytestmark = pytest.mark.integration

torch.set_num_threads(1)
BLOCK = 16


def tiny_llama(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def policy(tok, arch: str):
    if arch == "llama":
        return tiny_llama(tok)
    return build_tiny_gpt2(tok, n_layer=2, n_embd=64, n_head=2, n_positions=512, seed=0).eval()


def words(tok, n: int, seed: int) -> list[int]:
    """``n`` ids of ordinary tokens (no EOS or pad), fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, len(tok), (n,), generator=g)).tolist()


def episodes(engine: Engine, tok, turns: int = 3) -> list[list[tuple[list[int], list[int], list[float]]]]:
    """Four episodes sharing a 40-token tools block, each turn one sampler call of all four (recorded
    completions: per-row generators); per turn and episode (prompt, ids, log-probs)."""
    tools = words(tok, 40, seed=7)
    prompts = [tools + words(tok, n, seed=10 + s) for s, n in enumerate((5, 23, 11, 37))]
    budgets = (6, 14, 3, 20)
    out = []
    for turn in range(turns):
        jobs = [
            Job(p, n=1, budget=b, stops=[], temperature=1.0, identity=(s, turn))
            for s, (p, b) in enumerate(zip(prompts, budgets))
        ]
        assert all(engine.joins(jobs[:i], jobs[i]) for i in range(1, len(jobs)))
        choices = [c[0] for c in engine.run(jobs)]
        out.append([(p, c.ids, c.log_probs) for p, c in zip(prompts, choices)])
        observations = [words(tok, 9 + 4 * s, seed=100 * turn + s) for s in range(len(prompts))]
        prompts = [p + c.ids + o for p, c, o in zip(prompts, choices, observations)]
    return out


def assert_same(a, b) -> None:
    for turn_a, turn_b in zip(a, b, strict=True):
        for (pa, ia, la), (pb, ib, lb) in zip(turn_a, turn_b, strict=True):
            assert pa == pb and ia == ib  # the same prompts and sampled ids, exactly
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_prefixes_sample_what_a_full_prefill_samples(tok, arch):
    model = policy(tok, arch)
    off = Engine(model, tok, seed=3, prefix_cache_bytes=0)
    on = Engine(model, tok, seed=3)
    without, with_cache = episodes(off, tok), episodes(on, tok)
    assert_same(without, with_cache)
    assert off.prefix_counters() == {}
    # the trainer's recomputation of the last turn (full forwards) agrees with what the cached calls recorded
    for prompt, ids, log_probs in with_cache[-1]:
        full = torch.tensor([prompt + ids])
        want = policy_forward(model, full, torch.ones_like(full), len(prompt))[0][0]
        torch.testing.assert_close(torch.tensor(log_probs), want, rtol=0, atol=1e-5)
    counters = on.prefix_counters()
    total = sum(len(p) for turn in with_cache for p, _, _ in turn)
    assert counters["rows"] == 12 and counters["prefill_tokens"] + counters["reused_tokens"] == total
    # the first call finds nothing; every later row reuses its episode's last prompt and completion
    assert counters["hits"] == 8 and counters["hit_rate"] == pytest.approx(8 / 12)
    first = sum(len(p) for p, _, _ in with_cache[0])
    later = total - first
    assert counters["reused_tokens"] > later / 2  # most of turns 2 and 3 came from the cache
    assert 0 < counters["bytes"] <= counters["budget_bytes"]


def test_a_rewritten_history_reuses_the_blocks_it_shares(tok):
    model = policy(tok, "gpt2")
    on, off = Engine(model, tok, seed=5), Engine(model, tok, seed=5, prefix_cache_bytes=0)
    prompt = words(tok, 70, seed=1)
    first = on.run([Job(prompt, n=1, budget=8, stops=[], temperature=1.0, identity=("a", 0))])[0][0]
    history = prompt + first.ids + words(tok, 12, seed=2)
    history[37] = 3 if prompt[37] != 3 else 4  # an edited earlier turn
    assert history[37] != prompt[37]
    before = on.prefix_counters()["reused_tokens"]
    job = Job(history, n=1, budget=8, stops=[], temperature=1.0, identity=("a", 1))
    got = on.run([job])[0][0]
    assert (
        on.prefix_counters()["reused_tokens"] - before == (37 // BLOCK) * BLOCK
    )  # the blocks before the edit
    want = off.run([job])[0][0]
    assert got.ids == want.ids
    torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs), rtol=0, atol=1e-5)
    # a retry of the same prompt reuses all of it but its last token (whose logits start the answer)
    before = on.prefix_counters()["reused_tokens"]
    again = on.run([job])[0][0]
    reused = min(len(history) // BLOCK * BLOCK, len(history) - 1)
    assert on.prefix_counters()["reused_tokens"] - before == reused
    assert again.ids == got.ids


def test_a_small_budget_evicts_the_least_recently_used_blocks_and_changes_nothing(tok):
    model = policy(tok, "llama")
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # K and V, 2 layers, 2 KV heads, 16 tokens, head dim 16, fp32
    small = Engine(model, tok, seed=3, prefix_cache_bytes=6 * block_bytes)
    off = Engine(model, tok, seed=3, prefix_cache_bytes=0)
    assert_same(episodes(off, tok), episodes(small, tok))
    counters = small.prefix_counters()
    assert counters["evicted_blocks"] > 0 and counters["bytes"] <= 6 * block_bytes
    small.set_policy(model, 1)  # new weights: nothing kept is valid
    assert small.prefix_counters()["bytes"] == 0 and not small.prefix.blocks


def test_the_cache_keeps_parents_longer_than_their_children():
    cache = PrefixCache(budget_bytes=3 * 2 * 4 * BLOCK, block=BLOCK)  # three blocks of (1, 1, 16, 1) fp32
    kv = torch.arange(4 * BLOCK, dtype=torch.float32).view(1, 1, -1, 1)
    a, b = list(range(4 * BLOCK)), list(range(2 * BLOCK)) + [7] * (2 * BLOCK)
    cache.keep(a, kv, kv, cache.generation)  # room for three of a's four blocks
    assert [len(cache.match(a))] == [3] and cache.bytes == 3 * 2 * 4 * BLOCK
    cache.keep(b, kv, kv, cache.generation)  # b shares a's first two blocks: a's third goes, b's third comes
    assert len(cache.match(b)) == 3 and len(cache.match(a)) == 2 and cache.evicted == 1
    chain = cache.match(b)
    assert torch.equal(chain[2].k.flatten(), kv[0, 0, 2 * BLOCK : 3 * BLOCK, 0])
    cache.keep(a, kv, kv, cache.generation - 1)  # a call that began before a clear() keeps nothing
    assert len(cache.match(a)) == 2


def test_a_served_conversation_reuses_its_prefix_and_answers_as_without_the_cache():
    """Over HTTP (uvicorn, the openai client): the same seeded conversation on a gateway with the cache and on
    one without gets the same answers and log-probs; the health endpoint counts the reuse."""
    openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
    from shifu.gateway import Gateway, Sampling

    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|endoftext|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    model = policy(tok, "gpt2")
    system = {"role": "system", "content": "you answer questions about the movie and the acting. " * 4}

    def conversation(gw) -> list:
        client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        messages, out = [system, {"role": "user", "content": "what is two plus three?"}], []
        for turn in range(3):
            answer = client.chat.completions.create(
                model="policy", messages=messages, seed=11 + turn, logprobs=True, max_tokens=10
            )
            content = answer.choices[0].message.content
            out.append([(t.token, t.logprob) for t in answer.choices[0].logprobs.content])
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "and a cat?"}]
        return out

    with Gateway(model, tok, sampling=Sampling(max_tokens=10), prefix_cache_mb=0) as gw:
        without = conversation(gw)
        assert httpx.get(gw.url + "/health").json()["prefix_cache"] == {}
    with Gateway(model, tok, sampling=Sampling(max_tokens=10)) as gw:
        with_cache = conversation(gw)
        counters = httpx.get(gw.url + "/health").json()["prefix_cache"]
    for a, b in zip(without, with_cache, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        torch.testing.assert_close(
            torch.tensor([x for _, x in a]), torch.tensor([x for _, x in b]), atol=1e-5, rtol=0
        )
    assert counters["rows"] == 3 and counters["hits"] == 2 and counters["reused_tokens"] >= 2 * 32


def test_in_process_episodes_reuse_each_turns_context_and_record_what_they_record_without(tmp_path):
    """The episode source (shifu.rollout.episodes) keeps each episode's keys and values between its turns: the
    same trajectories, log-probs within 1e-5, and the later turns copy their context from the cache."""
    from ppo_task import build_char_model

    from shifu.config.loader import from_dict
    from shifu.config.sources import EnvConfig
    from shifu.envs.base import Environment
    from shifu.generation.rollout import SamplingParams, sample
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.rollout.batch import PromptBatch
    from shifu.rollout.episodes import EpisodeLimits, Episodes
    from shifu.rollout.sources import Policy

    path = build_char_model(tmp_path, n_positions=256)
    model, tok = load_causal_lm(path, dropout=False).eval(), load_tokenizer(path)
    kwargs = {"intro": "abcdefghijkl" * 4, "observation": "kkjjkkjjkkjjkkjj", "rewards": [1.0, 2.0, 3.0]}
    env = Environment(from_dict(EnvConfig, {"factory": "scripted_envs:Scripted", "kwargs": kwargs}))

    def limits(cache_mb):
        return EpisodeLimits(max_turns=3, max_new_tokens=10, max_total_tokens=120, prefix_cache_mb=cache_mb)

    rows = [{"prompt": "abcdefghijkl"[i : i + 2 + i % 3]} for i in range(6)]
    calls = []

    def counting(*args, **kw):
        calls.append(kw.get("prefix"))
        return sample(*args, **kw)

    def collect(cache_mb):
        source = Episodes(env, limits(cache_mb), chat=False)
        policy = Policy(model, tok, with_log_probs=True, sampler=counting)
        batch = PromptBatch(torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1, dtype=torch.long), rows)
        params = SamplingParams(1, temperature=1.0)
        return source.collect(policy, batch, params, torch.Generator().manual_seed(4))

    without, with_cache = collect(0), collect(256)
    assert calls[0] is None and calls[-1] is not None
    assert torch.equal(without.input_ids, with_cache.input_ids) and torch.equal(
        without.trainable, with_cache.trainable
    )
    mask = with_cache.trainable
    assert mask.sum() > 0
    torch.testing.assert_close(with_cache.log_probs[mask], without.log_probs[mask], atol=1e-5, rtol=0)
    counters = calls[-1].cache.counters()
    assert (
        max(with_cache.counts["turns"]) == 3 and counters["hits"] >= 6 and counters["reused_tokens"] >= 6 * 48
    )

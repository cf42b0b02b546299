"""Episodes on the admitting loop (shifu.rollout.episodes, ``generation.kv_budget_mb`` > 0) against the same
episodes in lockstep (``kv_budget_mb=0``, a sampler call per turn), on a real tiny model and the scripted
environment: greedy episodes identical, sampled ones reproducible with the trainer's log-probs, turns joining a
running decode, a pool smaller than the batch, a pool too small for one turn."""

from __future__ import annotations

import pytest
import torch
from ppo_task import build_char_model

from shifu.config.loader import from_dict
from shifu.config.sources import EnvConfig, GenerationConfig
from shifu.envs.base import Environment
from shifu.errors import ConfigError, ShifuError
from shifu.generation import continuous
from shifu.generation.rollout import SamplingParams, policy_forward
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.rollout.batch import PromptBatch
from shifu.rollout.episodes import STEP_LAG, EpisodeLimits, Episodes
from shifu.rollout.sources import Policy

pytestmark = pytest.mark.unit

STOPS = tuple("abcdefghijkl")  # every letter ends a turn: turns of 1 to 6 tokens, ends spread out


@pytest.fixture(scope="module")
def char(tmp_path_factory):
    path = build_char_model(tmp_path_factory.mktemp("char"))
    return load_causal_lm(path, dropout=False).eval(), load_tokenizer(path)


def rows(n: int = 12) -> list[dict]:
    return [{"prompt": "".join("abcdefghijkl"[(i * 7 + j) % 12] for j in range(3 + i % 3))} for i in range(n)]


def collect(
    char, kv_mb: float, seed: int = 0, greedy: bool = False, stops=STOPS, turns: int = 3, lag=STEP_LAG
):
    model, tok = char
    env = Environment(
        from_dict(EnvConfig, {"factory": "scripted_envs:Scripted", "kwargs": {"rewards": [1.0]}})
    )
    limits = EpisodeLimits(turns, 6, 30, stops, prefix_cache_mb=256, kv_budget_mb=kv_mb)
    source = Episodes(env, limits, chat=False, max_prompt_len=16)
    source.step_lag = lag
    batch = PromptBatch(torch.zeros(12, 1, dtype=torch.long), torch.ones(12, 1, dtype=torch.long), rows())
    params = SamplingParams(1, temperature=1.0, greedy=greedy)
    return source.collect(Policy(model, tok, True), batch, params, torch.Generator().manual_seed(seed))


def episodes(t) -> list[list[int]]:
    """Each episode's real ids after its first input (sampled and observation tokens)."""
    return [t.ids[i][t.attention[i]].tolist() for i in range(len(t))]


@pytest.fixture
def steps(monkeypatch):
    """The admitting loop's steps, counted (each is the real step)."""
    counted = {"steps": 0, "rows": []}
    real = continuous.Running.step

    def step(self):
        counted["steps"] += 1
        counted["rows"].append(len(self.rows))
        real(self)

    monkeypatch.setattr(continuous.Running, "step", step)
    return counted


@pytest.mark.parametrize("lag", [0, STEP_LAG])
def test_greedy_episodes_are_those_of_the_lockstep_turns(char, steps, lag):
    admitted, lockstep = collect(char, 1024, greedy=True, lag=lag), collect(char, 0, greedy=True)
    assert steps["steps"] > 0  # (the admitting loop ran the first; the second never starts one)
    assert episodes(admitted) == episodes(lockstep)
    assert admitted.counts == lockstep.counts and torch.equal(admitted.returns, lockstep.returns)
    mask = admitted.trainable
    torch.testing.assert_close(admitted.log_probs[mask], lockstep.log_probs[mask], atol=1e-5, rtol=0)
    assert max(admitted.counts["turns"]) >= 2


def test_sampled_episodes_repeat_and_carry_the_trainers_log_probs(char):
    model, _ = char
    one, two = collect(char, 1024, seed=3), collect(char, 1024, seed=3)
    assert episodes(one) == episodes(two) and torch.equal(one.log_probs, two.log_probs)
    assert episodes(collect(char, 1024, seed=4)) != episodes(one)  # the seed is what draws them
    P = one.prompt_ids.shape[1]
    lp, ent, _ = policy_forward(model, one.input_ids, one.attention_mask, P, 1.0, with_entropy=True)
    mask = one.trainable
    assert mask.sum() > 30 and sum(one.counts["observation_tokens"]) > 0
    torch.testing.assert_close(lp[mask], one.log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[mask], one.entropy[mask], atol=1e-5, rtol=0)


def turn_lengths(t) -> list[list[int]]:
    """Per episode, the tokens each of its turns sampled."""
    out = []
    for i in range(len(t)):
        sampled = t.trainable[i].nonzero().flatten().tolist()
        ends = t.turn_ends[i].nonzero().flatten().tolist()
        out.append([sum(1 for p in sampled if a < p <= b) for a, b in zip([-1, *ends], ends)])
    return out


def test_a_turn_joins_the_running_decode_as_its_episode_is_stepped(char, steps):
    t = collect(char, 1024, seed=1, stops=("a", "b", "c"))  # turns of 1 to 6 tokens
    lengths = turn_lengths(t)
    assert len({n for ep in lengths for n in ep}) >= 3 and max(map(len, lengths)) >= 2
    # in lockstep a turn decodes as long as its longest row: the sum over turns of the longest
    lockstep = sum(max(ep[k] for ep in lengths if len(ep) > k) for k in range(max(map(len, lengths))))
    # each episode's turns back to back, the next joining STEP_LAG steps after its environment was called
    assert steps["steps"] <= max(sum(ep) + STEP_LAG * (len(ep) - 1) for ep in lengths) < lockstep
    assert max(steps["rows"]) == 12


def test_a_pool_smaller_than_the_batch_admits_turns_as_rows_end(char, steps):
    full = collect(char, 1024, greedy=True)
    steps["rows"].clear()
    # blocks of 16 tokens (8 KB for this model); a turn reserves its context and budget, one or two blocks:
    # six blocks hold a few of the 12 episodes' turns at once
    small = collect(char, 6 * 8192 / 2**20, greedy=True)
    assert 1 < max(steps["rows"]) < 12
    assert episodes(small) == episodes(full) and small.counts == full.counts


def test_a_pool_too_small_for_one_turn_is_refused_by_name(char):
    with pytest.raises(
        ShifuError,
        match=r"row '\w+', turn \d: a turn of \d+ context tokens and a budget of 6 does not fit in generation.kv_budget_mb=0.0078125: raise it",
    ):
        collect(char, 8192 / 2**20, greedy=True)  # one block: 16 tokens
    with pytest.raises(
        ShifuError, match=r"generation.kv_budget_mb=1e-06: a KV budget of 1 bytes holds no block"
    ):
        collect(char, 1e-6, greedy=True)
    with pytest.raises(ConfigError, match="generation.kv_budget_mb must be >= 0"):
        from_dict(GenerationConfig, {"kv_budget_mb": -1}).validate()

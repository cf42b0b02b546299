"""The episode source (shifu.rollout.episodes) on a real tiny model: token in / token out, the decode's
log-probs against the trainer's forward, masks, per-turn rewards, budgets, and environment faults."""

from __future__ import annotations

import json
import math

import pytest
import scripted_envs
import torch
from ppo_task import build_char_model

from shifu import core
from shifu.config.loader import from_dict
from shifu.config.sources import EnvConfig
from shifu.envs.base import EnvFault, Environment
from shifu.generation.rollout import SamplingParams, policy_forward, sample
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.rollout.batch import PromptBatch
from shifu.rollout.episodes import EpisodeLimits, Episodes
from shifu.rollout.sources import Policy
from shifu.trainers.ppo_rollout import reward_signals

pytestmark = pytest.mark.unit

STOPS = list("abcdefghijkl")  # every letter ends a turn: turns are short, their ends known


@pytest.fixture(scope="module")
def char(tmp_path_factory):
    path = build_char_model(tmp_path_factory.mktemp("char"))
    tok = load_tokenizer(path)
    return load_causal_lm(path, dropout=False).eval(), tok


def rows(n: int = 12) -> list[dict]:
    # 12 prompts with distinct first letters: a context's first token names its episode
    return [{"prompt": "".join("abcdefghijkl"[(i * 7 + j) % 12] for j in range(3 + i % 3))} for i in range(n)]


LIMITS = ("max_turns", "max_new_tokens", "max_total_tokens", "stop")


def env(**over) -> Episodes:
    """An episode source on the scripted environment: 3 turns of at most 6 tokens, 24 in all, every letter a stop
    (``over``: the limits' keys and the environment's)."""
    limits = {"max_turns": 3, "max_new_tokens": 6, "max_total_tokens": 24, "stop": STOPS}
    limits |= {k: over.pop(k) for k in LIMITS if k in over}
    cfg = {"factory": "scripted_envs:Scripted", "step_timeout_s": None} | over
    e = Environment(from_dict(EnvConfig, cfg))
    return Episodes(
        e, EpisodeLimits(**(limits | {"stop": tuple(limits["stop"])})), chat=False, max_prompt_len=16
    )


def run(char, source: Episodes, seed: int = 0, with_log_probs: bool = False, sampler=sample):
    model, tok = char
    policy = Policy(model, tok, with_log_probs, sampler=sampler)
    batch = PromptBatch(torch.zeros(12, 1, dtype=torch.long), torch.ones(12, 1, dtype=torch.long), rows())
    return source.collect(
        policy, batch, SamplingParams(1, temperature=1.0), torch.Generator().manual_seed(seed)
    )


def final_rows(t) -> list[list[int]]:
    """Each episode's real ids: its first input, then every sampled and observation token."""
    out = []
    for i in range(len(t)):
        prompt = t.prompt_ids[i][t.prompt_mask[i].bool()].tolist()
        out.append(prompt + t.ids[i][t.attention[i]].tolist())
    return out


def test_every_turn_reads_a_prefix_of_its_final_row_and_the_decode_log_probs_are_the_trainers(char):
    model, tok = char
    contexts = []

    def recording(m, ids, mask, *args, **kwargs):
        contexts.extend(row[keep.bool()].tolist() for row, keep in zip(ids, mask))
        return sample(m, ids, mask, *args, **kwargs)

    e = env(kwargs={"rewards": [0.5, 1.0, 2.0], "observation": "kk"})
    eps = run(char, e, with_log_probs=True, sampler=recording)
    finals = {row[0]: row for row in final_rows(eps)}
    assert len(finals) == 12 and len(contexts) >= 12 + 1  # more than one turn was sampled
    for ctx in contexts:  # token in, token out: what the sampler read is where the final row starts
        assert finals[ctx[0]][: len(ctx)] == ctx
    assert max(eps.counts["turns"]) >= 2 and sum(eps.counts["observation_tokens"]) > 0
    # the sampler's own log-probs at the sampled tokens = the trainer's one forward over the whole trajectory
    P = eps.prompt_ids.shape[1]
    ids = eps.input_ids
    am = eps.attention_mask
    lp, ent, _ = policy_forward(model, ids, am, P, 1.0, with_entropy=True)
    mask = eps.trainable
    assert mask.sum() > 0 and (mask & ~eps.attention).sum() == 0
    torch.testing.assert_close(lp[mask], eps.log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[mask], eps.entropy[mask], atol=1e-5, rtol=0)
    # observation tokens are read (attention) but not sampled (mask), and hold the environment's text
    obs = eps.attention & ~mask
    assert obs.sum() == sum(eps.counts["observation_tokens"])
    assert set(tok.decode(eps.ids[obs].tolist()).split()) <= {"k"}


def test_per_turn_rewards_sit_on_each_turns_last_sampled_token(char):
    eps = run(char, env(kwargs={"rewards": [0.5, 1.0, 2.0], "done_after": 3}))
    mask = eps.trainable
    for i in range(12):
        ends = eps.turn_ends[i].nonzero().flatten().tolist()
        assert len(ends) == eps.counts["turns"][i] and all(mask[i, p] for p in ends)
        # a turn cut by its budget is not stepped
        stepped = ends if _ended_by_stop(char, eps, i) else ends[:-1]
        want = [0.5, 1.0, 2.0][: len(stepped)]
        assert eps.rewards[i, stepped].tolist() == want
        assert eps.rewards[i].sum() == eps.returns[i] == sum(want)
        assert (eps.rewards[i] != 0).sum() == len(stepped)  # nothing anywhere else
        # a turn's last sampled token is followed by an observation or the end of the row
        for p in ends[:-1]:
            assert not mask[i, p + 1]
    done = ~eps.truncated
    assert done.any() and (eps.returns[done] == 3.5).all()
    # the trainer's two views: per turn (last turn's reward as the score, the rest as process rewards) or the
    # whole return as one score (group estimators)
    scores, token_rewards, steps = reward_signals(eps, per_turn=True)
    last = (mask.long().cumsum(1) == mask.sum(1, keepdim=True)) & mask
    torch.testing.assert_close(scores + token_rewards.sum(1), eps.returns)
    assert (token_rewards[last] == 0).all() and torch.equal(steps, eps.turn_ends)
    core_rewards = core.shape_rewards(scores, torch.zeros_like(token_rewards), mask, 0.0) + token_rewards
    torch.testing.assert_close(core_rewards, eps.rewards)
    whole, none, _ = reward_signals(eps, per_turn=False)
    assert none is None and torch.equal(whole, eps.returns)


def _ended_by_stop(char, eps, i) -> bool:
    """Whether episode i's last turn ended at EOS or a stop letter (then the environment saw it)."""
    _, tok = char
    mask = eps.trainable[i]
    last = eps.ids[i][mask][-1].item()
    return last == tok.eos_token_id or tok.decode([last]).strip() in STOPS


def test_max_turns_and_the_token_budgets_end_episodes_truncated(char):
    scripted_envs.STEPS.clear()
    eps = run(char, env(max_turns=2, kwargs={"rewards": [1.0, 1.0]}))  # never done
    assert eps.truncated.all() and max(eps.counts["turns"]) == 2
    assert eps.trainable.sum(1).min() >= 1
    # no stop strings, 2 tokens a turn: a turn that reaches 2 tokens without EOS is cut and never stepped
    scripted_envs.STEPS.clear()
    eps = run(char, env(stop=[], max_new_tokens=2, kwargs={"done_after": 1}))
    for i in range(12):
        n, ended = int(eps.trainable[i].sum()), bool(eps.truncated[i])
        assert n <= 2 and eps.counts["turns"][i] == 1
        assert ended == (eps.ids[i][n - 1].item() != char[1].eos_token_id)
    assert len(scripted_envs.STEPS) == int((~eps.truncated).sum())
    # the episode's budget: sampled + observation tokens never pass max_total_tokens; the episode that
    # would is truncated
    eps = run(char, env(max_total_tokens=5, max_turns=3, kwargs={"observation": "kkk"}))
    assert eps.attention.sum(1).max() <= 5 and eps.truncated.all()


@pytest.mark.parametrize(
    "fault, said",
    [
        ("raise", "step() raised at tests/scripted_envs.py:"),
        ("type", "step() returned dict {'observation': 'x'}, not a shifu.Step"),
        ("nan", "step() returned the reward nan; it must be a finite number"),
        ("sleep", "step() took longer than env.step_timeout_s=1.0 s"),
        ("long", "the observation is 500 tokens, over generation.max_total_tokens=24 on its own"),
        ("reset", "reset() raised at tests/scripted_envs.py:"),
    ],
)
def test_a_faulty_environment_is_named_with_the_row_and_turn_or_ends_its_episode(char, fault, said):
    bad = rows()[3]["prompt"]
    kw = {
        "kwargs": {"fault": fault, "fault_turn": 1, "fault_prompt": bad, "sleep_s": 3.0, "rewards": [1.0]},
        "step_timeout_s": 1.0,  # (12 calls at once on a loaded machine: a fast step takes well under it)
    }
    with pytest.raises(EnvFault) as e:
        run(char, env(**kw))
    turn = "reset" if fault == "reset" else "turn 2"
    assert f"environment scripted_envs:Scripted, row {bad!r}, {turn}: {said}" in str(e.value)
    assert "env.on_error=end_episode" in str(e.value)
    # on_error=end_episode: that episode ends with reward 0, counted; the others are untouched
    eps = run(char, env(**kw, on_error="end_episode"))
    i = 3
    assert eps.failed[i] and eps.failed.sum() == 1 and eps.returns[i] == 0 and eps.rewards[i].abs().sum() == 0
    assert eps.metrics["env/errors"] == pytest.approx(1 / 12)
    if fault == "reset":  # no turn at all: no sampled token, and a NaN score (the trainer drops the row)
        assert not eps.trainable[i].any() and math.isnan(reward_signals(eps, True)[0][i])
    else:
        assert eps.trainable[i].any() and eps.counts["turns"][i] == 2


def test_chat_messages_for_a_plain_tokenizer_are_refused_by_name(char):
    from shifu.rollout.turns import TemplateError

    with pytest.raises(TemplateError, match="row .*reset: the environment's first input is a list of chat "):
        run(char, env(kwargs={"fault": "messages"}))


def test_gae_and_returns_carry_across_observation_spans():
    """A row with observation tokens masked out gets the advantages and returns of the same row with those
    tokens removed: GAE skips them (V_{t+1} is the next *sampled* token's value), as do discounted returns."""
    g = torch.Generator().manual_seed(0)
    sampled = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0]], dtype=torch.bool)
    rewards, values = torch.randn(1, 11, generator=g), torch.randn(1, 11, generator=g)
    adv, ret = core.gae(rewards, values, sampled, gamma=0.9, lam=0.8)
    keep = sampled[0]
    compact = torch.ones(1, int(keep.sum()), dtype=torch.bool)
    adv_c, ret_c = core.gae(rewards[:, keep], values[:, keep], compact, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, keep], adv_c)
    torch.testing.assert_close(ret[:, keep], ret_c)
    assert (adv[:, ~keep] == 0).all() and (ret[:, ~keep] == 0).all()
    torch.testing.assert_close(
        core.discounted_returns(rewards, sampled, 0.9)[:, keep],
        core.discounted_returns(rewards[:, keep], compact, 0.9),
    )


def test_no_gradient_reaches_the_logits_of_observation_positions(char):
    """The policy loss, the k3 KL loss and the entropy of an episode rollout: their gradient with respect to the
    logits is exactly 0 at every position that predicts an observation token (and nonzero where the policy
    sampled)."""
    model, _ = char
    eps = run(char, env(kwargs={"rewards": [1.0, 0.5]}), with_log_probs=True)
    P, mask = eps.prompt_ids.shape[1], eps.trainable
    ids = eps.input_ids
    am = eps.attention_mask
    from shifu.models.padding import position_ids_from_mask

    logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits
    logits = logits[:, P - 1 : -1]
    logits.retain_grad()
    lp, ent = core.log_probs_and_entropy(logits, ids[:, P:], 1.0)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    pg, _ = core.ppo_policy_loss(lp, eps.log_probs.detach() - 0.1, adv, mask)
    kl, _ = core.kl_loss(lp, lp.detach() + 0.3, mask)
    loss = pg + 0.1 * kl - 0.01 * core.masked_mean(ent, mask)
    loss.backward()
    grad = logits.grad.abs().sum(-1)  # (B, R)
    observed = eps.attention & ~mask
    assert observed.any() and (grad[observed] == 0).all()
    assert (grad[mask] > 0).float().mean() > 0.9


def test_samples_and_metrics_are_json(char):
    eps = run(char, env(kwargs={"rewards": [1.0], "done_after": 2}))
    m = eps.metrics
    assert set(m) == {
        f"env/{k}"
        for k in (
            "turns",
            "tool_calls",
            "tool_errors",
            "observation_tokens",
            "tool_use",
            "terminated",
            "truncated",
            "errors",
            "return",
        )
    }
    json.dumps(m)
    assert all(t.startswith("\u27e6") and "\u27e7" in t for t in [t.response for t in eps.transcripts])


def test_a_budget_tells_the_environment_and_its_final_reward_lands_on_the_last_sampled_token(char):
    """gymnasium's truncated vs terminated: an episode cut by max_turns calls the environment's truncate(), whose
    reward is added on the episode's last sampled token; done episodes are not asked; the metrics keep the two
    apart. A truncate() that raises is a fault naming it."""
    eps = run(char, env(max_turns=2, kwargs={"rewards": [0.25, 0.5], "truncate_reward": 0.75}))  # never done
    assert (
        eps.truncated.all() and eps.metrics["env/truncated"] == 1.0 and eps.metrics["env/terminated"] == 0.0
    )
    last = core.last_true(eps.trainable)
    for i in range(12):
        stepped = 2 if _ended_by_stop(char, eps, i) else 1  # a turn cut by its token budget is not stepped
        want = [0.25, 0.5][:stepped]
        assert eps.rewards[i][last[i]].item() == pytest.approx((want[-1] if stepped == 2 else 0.0) + 0.75)
        assert eps.returns[i].item() == pytest.approx(sum(want) + 0.75)
    done = run(char, env(kwargs={"rewards": [1.0], "done_after": 1, "truncate_reward": 5.0}))
    ended = ~done.truncated
    assert ended.any() and (done.returns[ended] == 1.0).all()  # done: truncate() is not asked
    assert done.metrics["env/terminated"] == pytest.approx(float(ended.float().mean()))
    with pytest.raises(
        EnvFault, match=r"truncate\(\) raised at .*scripted_envs\.py:\d+ RuntimeError: cannot score"
    ):
        run(char, env(max_turns=1, kwargs={"fault": "truncate"}))


def test_an_environment_that_does_not_report_tool_calls_has_no_tool_metrics(char):
    eps = run(char, env(kwargs={"done_after": 2, "report_tools": False}))  # Step.info says nothing of tools
    assert (
        "env/tool_use" not in eps.metrics
        and "env/tool_calls" not in eps.metrics
        and "env/turns" in eps.metrics
    )
    reported = run(char, env(kwargs={"done_after": 2}))  # Scripted reports tool_calls
    assert reported.metrics["env/tool_use"] == 1.0


def test_the_transcript_keeps_the_first_input_as_the_policy_read_it(char):
    """What ``reset(row)`` returned, as ids the policy read (not the data row's prompt): recorded in the
    transcript and in an evaluation's sample records."""
    from shifu.evaluation.evaluate import evaluate

    src = env(kwargs={"done_after": 1, "intro": "kkk "})
    eps = run(char, src)
    model, tok = char
    read = [tok.decode(tok("kkk " + r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows()]
    assert [t.first_input for t in eps.transcripts] == read
    batch = PromptBatch(torch.zeros(12, 1, dtype=torch.long), torch.ones(12, 1, dtype=torch.long), rows())
    done = evaluate(Policy(model, tok), src, [batch], SamplingParams(1), torch.Generator().manual_seed(0))
    records = done.records(None)
    assert [r["input"] for r in records] == read
    assert [r["prompt"] for r in records] == [r["prompt"] for r in rows()] and all(
        "turns" in r for r in records
    )


def test_an_async_environment_is_awaited(char):
    eps = run(char, env(factory="scripted_envs:AsyncEcho", kwargs={"turns": 2}))
    ended = ~eps.truncated
    assert ended.any() and (eps.returns[ended] == 1.0).all() and max(eps.counts["turns"]) == 2

"""The agent source (shifu.rollout.agent): agents written against the real ``openai`` client, on a real recording
gateway (uvicorn on 127.0.0.1) and real tiny models, become the trajectory batch token for token: every sampled
token's recorded log-prob is the trainer's recomputation over the whole trajectory, every call extends its
trajectory or is a counted fork, only sampled ids train, rewards sit on their calls; faults follow on_error;
budgets cut trajectories; ``shifu ppo`` with ``agent.factory`` learns (GAE with a critic).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import (  # noqa: E402
    CALL_TEXT,
    QUESTION,
    TOOLS,
    chat_tokenizer,
    memorized_policy,
    smollm2_tokenizer,
    tiny_llama,
    tiny_policy,
)
from test_tool_calls import QWEN_STYLE  # noqa: E402

from shifu import core  # noqa: E402
from shifu.config.schema import PPOConfig  # noqa: E402
from shifu.envs.base import describe_row  # noqa: E402
from shifu.errors import ConfigError, ShifuError  # noqa: E402
from shifu.evaluation.evaluate import evaluate  # noqa: E402
from shifu.generation.rollout import SamplingParams, policy_forward  # noqa: E402
from shifu.models.padding import position_ids_from_mask  # noqa: E402
from shifu.rollout.agent import AgentEpisodes, AgentFault, load_agent, set_reward  # noqa: E402
from shifu.rollout.batch import PromptBatch  # noqa: E402
from shifu.rollout.episodes import EpisodeLimits  # noqa: E402
from shifu.rollout.sources import Policy  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
# Qwen2.5-style native tools whose end of turn is the tiny tokenizer's EOS (a turn the policy ends is closed by it)
NATIVE = QWEN_STYLE.replace("<|im_end|>", "<|endoftext|>")
T = 0.8
CALLS: dict[
    int, list[tuple[list[int], list[int], str]]
] = {}  # row id -> (prompt ids, sampled ids, id) per call


def batch_of(rows: list[dict]) -> PromptBatch:
    n = len(rows)  # (an agent renders its own first input: the prompt ids are not read)
    return PromptBatch(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), rows)


def collect(source, model, tok, rows, temperature=T, with_log_probs=True, max_new_tokens=8):
    policy = Policy(model, tok, with_log_probs=with_log_probs)
    params = SamplingParams(max_new_tokens, temperature)
    return source.collect(policy, batch_of(rows), params, torch.Generator().manual_seed(0))


async def tool_agent(client, row: dict) -> float:
    """Three calls that send each answer back (a tool result after a tool call, else a user turn), a reward on
    the first call, and for rows with ``fork`` a fourth call that rewrites the first user message."""
    messages, log = [{"role": "user", "content": row["prompt"]}], []
    CALLS[row["id"]] = log

    async def call(msgs):
        out = await client.chat.completions.create(
            model="policy", messages=msgs, tools=TOOLS, extra_body={"return_token_ids": True}
        )
        log.append((out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"], out.id))
        return out

    for _ in range(3):
        said = (await call(messages)).choices[0].message
        turn = {"role": "assistant", "content": said.content}
        if said.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in said.tool_calls]
            messages += [turn, {"role": "tool", "tool_call_id": said.tool_calls[0].id, "content": "5"}]
        else:
            messages += [turn, {"role": "user", "content": "and then?"}]
    await set_reward(client, 0.25, call=log[0][2])
    if row["fork"]:
        await call([{"role": "user", "content": "what is one plus one?"}, *messages[1:3]])
    return 1.0


def setup_model(setup: str):
    if setup == "smollm2_template":
        tok = smollm2_tokenizer()
        return tiny_llama(tok), tok
    if setup == "native_tools":
        tok = chat_tokenizer(NATIVE)
        return tiny_policy(tok, positions=1024), tok
    if (
        setup == "native_tool_calls"
    ):  # a model that calls the calculator on the question, in the template's syntax
        tok = chat_tokenizer(NATIVE)
        body = {"model": "policy", "messages": QUESTION, "tools": TOOLS}
        target = CALL_TEXT.replace("{", "\n{", 1).replace("}</", "}\n</")
        return memorized_policy(tok, body, target), tok
    tok = chat_tokenizer()
    return tiny_policy(tok, positions=1024), tok


@pytest.mark.parametrize("setup", ["tiny_chatml", "smollm2_template", "native_tools", "native_tool_calls"])
def test_agent_episodes_are_the_trajectories_the_policy_sampled(setup):
    model, tok = setup_model(setup)
    CALLS.clear()
    rows = [{"id": i, "prompt": QUESTION[0]["content"], "fork": i % 2 == 0} for i in range(6)]
    cap = 100 if setup == "native_tool_calls" else 8  # (room for the whole call)
    source = AgentEpisodes(tool_agent, "test_agent:tool_agent", EpisodeLimits(10, cap, 4096), concurrency=4)
    t = collect(source, model, tok, rows, max_new_tokens=cap)
    P, mask = t.prompt_ids.shape[1], t.trainable
    # every call was captured: 3 forks (the even rows), each a trajectory of its own, trained as a row
    n_calls = sum(len(v) for v in CALLS.values())
    assert n_calls == 6 * 3 + 3 and sum(t.counts["turns"]) == n_calls
    assert len(t) == 6 + 3 and t.counts["forks"][:6] == [1, 0] * 3 and t.metrics["agent/forks"] == 0.5
    assert t.metrics["agent/fork_rows"] == 0.5 and t.metrics["agent/calls"] == n_calls / 6
    if setup == "native_tool_calls":
        assert t.metrics["agent/tool_calls"] > 0  # the memorized call, then the tool result read back
    # the trainable mask is exactly the sampled ids of the calls: each call's prompt + completion is a prefix of
    # a row of its episode, its completion sits on trainable positions, and nothing else is trainable
    full = [t.input_ids[i][t.attention_mask[i].bool()].tolist() for i in range(len(t))]
    covered = torch.zeros_like(mask)
    for rid, calls in CALLS.items():
        mine = [i for i in range(len(t)) if t.rows[i]["id"] == rid]
        for prompt, sampled, _ in calls:
            i = next(i for i in mine if full[i][: len(prompt) + len(sampled)] == prompt + sampled)
            pad = P - int(t.prompt_mask[i].sum())  # the row's first input is left-padded to P
            lo = len(prompt) + pad - P
            assert mask[i, lo : lo + len(sampled)].all() and t.turn_ends[i, lo + len(sampled) - 1]
            covered[i, lo : lo + len(sampled)] = True
    assert torch.equal(covered, mask) and (t.attention & ~mask).any()
    # faithfulness: the trainer's log-probs over the whole trajectories at the sampling temperature
    lp, ent, _ = policy_forward(model, t.input_ids, t.attention_mask, P, T, with_entropy=True)
    # (the memorized model's sharp logits over ~700 tokens round further apart in float32: its decode and one
    # unpadded forward differ by up to ~2e-5, as its padded and unpadded forwards differ by ~1e-5)
    tolerance = 5e-5 if setup == "native_tool_calls" else 1e-5
    assert (lp - t.log_probs)[mask].abs().max() <= tolerance
    assert (ent - t.entropy)[mask].abs().max() <= 1e-4
    assert (t.log_probs[~mask] == 0).all()
    # rewards: the first call's 0.25 on its last token, the episode's 1.0 on each trajectory's last token
    last = core.last_true(mask)
    assert torch.allclose(t.rewards[last], torch.full((len(t),), 1.0) + 0.25 * (t.rewards[last] > 1.1))
    assert t.returns[:6].tolist() == [1.0, 1.25] * 3  # the fork (a new first message) is the main trajectory
    # no gradient of the policy loss, the KL loss or the entropy reaches the logits that predict read ids
    ids, am = t.input_ids, t.attention_mask
    logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits
    logits = logits[:, P - 1 : -1]
    logits.retain_grad()
    lp, ent = core.log_probs_and_entropy(logits, ids[:, P:], T)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    pg, _ = core.ppo_policy_loss(lp, t.log_probs - 0.1, adv, mask)
    kl, _ = core.kl_loss(lp, lp.detach() + 0.3, mask)
    (pg + 0.1 * kl - 0.01 * core.masked_mean(ent, mask)).backward()
    grad = logits.grad.abs().sum(-1)
    read = t.attention & ~mask
    assert (grad[read] == 0).all() and (grad[mask] > 0).float().mean() > 0.9


def test_without_train_forks_and_in_an_evaluation_each_row_is_its_main_trajectory():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    CALLS.clear()
    rows = [{"id": i, "prompt": f"question {i}", "fork": True} for i in range(4)]
    source = AgentEpisodes(tool_agent, "t:a", EpisodeLimits(10, 6, 4096), train_forks=False)
    t = collect(source, model, tok, rows)
    assert len(t) == 4 and t.metrics["agent/forks"] == 1.0 and t.metrics["agent/fork_rows"] == 0.0
    assert [r["id"] for r in t.rows] == [0, 1, 2, 3] and t.counts["turns"] == [
        1
    ] * 4  # the fork holds the last call
    forking = AgentEpisodes(tool_agent, "t:a", EpisodeLimits(10, 6, 4096), train_forks=True)
    params = SamplingParams(6, 1.0)
    done = evaluate(Policy(model, tok), forking, [batch_of(rows[:2]), batch_of(rows[2:])], params, None)
    assert [r["id"] for r in done.rows] == [0, 1, 2, 3] and done.returns == [1.0] * 4
    assert done.metrics("eval/")["eval/env/turns"] == 1.0


async def one_call(client, row: dict) -> float:
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return 1.0


def test_a_trainers_gateway_waits_for_every_episodes_call_before_it_samples():
    """The episodes' first calls arrive one by one; the recording gateway waits for all of them (every open
    session has a call pending) and samples them in one call, as the in-process episode source would."""
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    rows = [{"prompt": f"hello {i}"} for i in range(8)]
    t = collect(AgentEpisodes(one_call, "t:one", EpisodeLimits(2, 6, 64)), model, tok, rows)
    assert t.metrics["agent/calls"] == 1 and t.metrics["agent/batched_calls"] == 8
    # one call per episode: nothing cached before it, every prompt token prefilled
    assert t.metrics["agent/prefix_hit_rate"] == 0.0 and t.metrics["agent/prefill_tokens"] > 0


def test_the_batching_queue_waits_as_long_as_it_is_told():
    from concurrent.futures import ThreadPoolExecutor

    from shifu.http.batching import BatchQueue

    calls = []

    async def main(wait):
        with ThreadPoolExecutor(1) as ex:
            q = BatchQueue(
                lambda items: calls.append(list(items)) or items, ex, lambda batch, item: True, wait
            )
            first = asyncio.ensure_future(q.submit(1))
            await asyncio.sleep(0.2)  # the others come later
            await asyncio.gather(first, q.submit(2), q.submit(3))
            await q.close()

    asyncio.run(main(lambda items: 0.0 if len(items) >= 3 else 30.0))  # waits for the third
    assert calls == [[1, 2, 3]]
    calls.clear()
    asyncio.run(main(lambda items: 0.0 if len(items) >= 3 else 0.05))  # waits 50 ms, then goes alone
    asyncio.run(main(None))  # never waits
    assert calls[0] == [1] and calls[2] == [1]
    # math.inf: no call until wake() (from another thread) lets wait answer again; then the calls take the
    # items by their keys, two at a time, whatever order they came in
    calls.clear()
    ready = []

    async def ordered():
        with ThreadPoolExecutor(1) as ex:
            q = BatchQueue(
                lambda items: calls.append(list(items)) or items,
                ex,
                lambda batch, item: len(batch) < 2,
                lambda items: 0.0 if ready else math.inf,
                order=lambda item: -item,
            )
            pending = [asyncio.ensure_future(q.submit(x)) for x in (1, 3, 2)]
            await asyncio.sleep(0.2)
            assert calls == []  # (waiting)
            ready.append(True)
            threading.Thread(target=q.wake).start()
            assert await asyncio.gather(*pending) == [1, 3, 2]
            await q.close()

    asyncio.run(ordered())
    assert calls == [[3, 2], [1]]

    async def broken_wait():  # a wait that fails fails the pending items, and the queue goes on
        with ThreadPoolExecutor(1) as ex:
            q = BatchQueue(lambda items: items, ex, None, lambda items: 1 / 0 if 1 in items else 0.0)
            with pytest.raises(ZeroDivisionError):
                await q.submit(1)
            assert await asyncio.gather(q.submit(2), q.submit(3)) == [2, 3]
            await q.close()

    asyncio.run(broken_wait())


def test_a_recorded_completions_randomness_is_its_identity_not_its_company():
    """A recorded completion (a job with an identity: row, call) samples each choice from a generator seeded by
    the engine's seed, the identity and the choice: the same tokens alone, beside other rows or behind them in
    a wider call; another identity or another seed draws other tokens."""
    from shifu.gateway.engine import Engine, Job

    tok = chat_tokenizer()
    engine = Engine(tiny_policy(tok), tok, seed=7)

    def job(prompt: str, identity, n: int = 1) -> Job:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        return Job(ids, n, 12, [], 1.0, identity=identity)

    def ids(jobs: list[Job], at: int) -> list[list[int]]:
        return [c.ids for c in engine.run(jobs)[at]]

    mine = job("hello there", (3, 1), n=2)
    alone = ids([mine], 0)
    assert alone[0] != alone[1]  # each choice draws its own
    assert ids([job("a much longer prompt that pads the call", (0, 0)), mine, job("x", (5, 2))], 1) == alone
    assert ids([mine], 0) == alone  # (nothing consumed between calls)
    assert ids([job("hello there", (3, 2), n=2)], 0) != alone
    assert [c.ids for c in Engine(engine.model, tok, seed=8).run([mine])[0]] != alone


def test_two_agent_runs_with_one_seed_are_bit_identical(echo_task, tmp_path, monkeypatch):
    """``shifu ppo`` through an agent twice with the same seed: the same metrics and the same final weights, bit
    for bit (the sessions outnumber the concurrency: rows start as slots free, in row order)."""
    from test_resume import metric_rows, weights_digest

    from shifu.cli import main as cli

    monkeypatch.syspath_prepend(str(EXAMPLES))

    def run(out: Path) -> tuple[list[dict], str]:
        argv = [
            "ppo",
            "--out",
            str(out),
            f"model.path={echo_task['char']}",
            f"data.train={echo_task['prompts']}",
            "agent.factory=echo_agent:solve",
            "agent.concurrency=5",
            "generation.max_new_tokens=6",
            "generation.max_total_tokens=24",
            "iterations=3",
            "batch_size=16",
            "minibatch_size=8",
            "eval.every=0",
            "eval.num_prompts=4",
            "critic.init=sft",
            "optim.lr=1e-2",
            "critic.optim.lr=1e-2",
            "progress=false",
            "tensorboard=false",
        ]
        assert cli.main(argv) == 0
        return metric_rows(out), weights_digest(out / "final", out / "critic")

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    train = [r for r in first[0] if "agent/return" in r]
    assert len(train) == 3 and all(r["agent/calls"] == 2 and r["agent/errors"] == 0 for r in train)
    assert first == second


async def moody(client, row: dict):
    """Per row: an answer, a raise, a hang, a bad return, a reward given twice, no call at all."""
    kind = row["kind"]
    if kind != "silent":
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    if kind == "raise":
        raise ValueError("the tool broke")
    if kind == "timeout":  # its own (a tool's) timeout: a raise, not agent.timeout_s
        raise TimeoutError("the tool took too long")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "twice":
        await set_reward(client, 2.0)
        return 1.0
    if kind == "session":
        await set_reward(client, 0.5)
        return None
    return "yes" if kind == "bad" else 1.0


def test_faults_follow_on_error_and_are_counted():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    kinds = ["ok", "raise", "hang", "bad", "twice", "silent", "session"]
    rows = [{"prompt": k, "kind": k} for k in kinds]
    lenient = AgentEpisodes(moody, "t:moody", EpisodeLimits(5, 6, 512), timeout_s=3.0, on_error="end_episode")
    t = collect(lenient, model, tok, rows)
    # the hang is no fault: it ends at agent.timeout_s, truncated, with what it recorded
    assert t.failed.tolist() == [False, True, False, True, True, False, False] and t.truncated[2]
    assert t.returns.tolist() == [1.0, 0, 0, 0, 0, 0, 0.5]  # a fault's rewards are 0; the session's reward
    assert not t.trainable[5].any()  # no call: nothing to train (the trainer drops it as a non-finite score)
    assert t.trainable[2].any()  # the timed-out episode's call trains
    m = t.metrics
    assert (m["agent/errors"], m["agent/timeouts"], m["agent/no_calls"]) == (3 / 7, 1 / 7, 1 / 7)
    strict = AgentEpisodes(moody, "t:moody", EpisodeLimits(5, 6, 512), timeout_s=3.0)
    for kind, said in [
        ("raise", "solve() raised ValueError: the tool broke"),
        ("timeout", "solve() raised TimeoutError"),
        ("bad", "solve() returned str 'yes'; it must return a finite number or None"),
        ("twice", "solve() returned 1.0 and also set the episode's reward 2.0"),
    ]:
        with pytest.raises(AgentFault) as e:
            collect(
                strict, model, tok, [{"prompt": "ok", "kind": "ok"}, {"prompt": f"row {kind}", "kind": kind}]
            )
        assert f"agent t:moody, row 'row {kind}': {said}" in str(e.value)
        assert "agent.on_error=end_episode" in str(e.value)


async def chatty(client, row: dict) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        out = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages += [{"role": "assistant", "content": out.choices[0].message.content}]
        messages += [{"role": "user", "content": "more"}]
    return 1.0


def test_budgets_cut_trajectories_before_the_call_that_does_not_fit():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    rows = [{"prompt": "hello there"}] * 3
    t = collect(AgentEpisodes(chatty, "t:c", EpisodeLimits(2, 8, 4096)), model, tok, rows)
    assert t.counts["turns"] == [2] * 3 and t.truncated.all() and t.metrics["agent/calls"] == 4
    assert t.returns.tolist() == [1.0] * 3  # the episode's reward on the last call kept
    t = collect(AgentEpisodes(chatty, "t:c", EpisodeLimits(10, 8, 12)), model, tok, rows)
    after_first = (t.attention.sum(1)).tolist()
    assert all(n <= 12 for n in after_first) and t.truncated.all() and max(t.counts["turns"]) < 4


async def out_of_room(client, row: dict) -> float:
    """A call, then a second whose prompt leaves no room in the model's positions (the openai client raises the
    gateway's context_length_exceeded; this agent lets it out)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    out = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": out.choices[0].message.content}]
    await client.chat.completions.create(
        model="policy", messages=[*messages, {"role": "user", "content": "more, " * 60}]
    )
    return 1.0


def test_an_episode_ended_by_its_timeout_or_the_context_limit_is_truncated_not_failed():
    """As an environment's episode cut by a budget: the trajectory it recorded trains, flagged truncated in the
    batch (the trainer's missing-EOS penalty reads it), and ``on_error=raise`` does not stop the run."""
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=96)
    with torch.no_grad():  # every call ends at once with EOS (finish "stop"): no budget truncates it
        model.transformer.ln_f.bias[0] = 10.0
        model.lm_head.weight[tok.eos_token_id, 0] = 10.0  # (tied: the EOS embedding's too)
    rows = [{"prompt": "ok", "kind": "ok"}, {"prompt": "hang", "kind": "hang"}]
    t = collect(AgentEpisodes(moody, "t:moody", EpisodeLimits(5, 6, 512), timeout_s=2.0), model, tok, rows)
    assert t.truncated.tolist() == [False, True] and t.failed.tolist() == [False, False]
    assert t.trainable[1].any() and t.metrics["agent/timeouts"] == 0.5 and t.metrics["agent/truncated"] == 0.5
    t = collect(
        AgentEpisodes(out_of_room, "t:room", EpisodeLimits(5, 6, 512)), model, tok, [{"prompt": "hi"}]
    )
    assert t.truncated.tolist() == [True] and t.failed.tolist() == [False] and t.trainable[0].any()
    assert t.metrics["agent/context_exceeded"] == 1.0 and t.returns.tolist() == [0.0]


async def titled(client, row: dict) -> float:
    """Two turns of the agent's own (its system prompt), then the harness's title call with another."""
    system = {"role": "system", "content": "You answer sums."}
    messages = [system, {"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        out = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": out.choices[0].message.content}]
        messages += [{"role": "user", "content": "and then?"}]
    title = [
        {"role": "system", "content": "Write a short title for this conversation, in five words."},
        messages[1],
    ]
    await client.chat.completions.create(model="policy", messages=title)
    return 1.0


@pytest.mark.parametrize("side_calls", ["skip", "train"])
def test_side_calls_are_skipped_or_trained_as_forks_and_never_the_main_trajectory(side_calls):
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    rows = [{"prompt": f"question {i}"} for i in range(3)]
    source = AgentEpisodes(titled, "t:titled", EpisodeLimits(5, 6, 4096), side_calls=side_calls)
    t = collect(source, model, tok, rows)
    m = t.metrics
    assert (m["agent/calls"], m["agent/forks"], m["agent/side_calls"]) == (3, 1, 1)
    assert t.counts["turns"][:3] == [2] * 3  # the main trajectory is the agent's, though the title came last
    assert len(t) == (3 if side_calls == "skip" else 6)
    assert m["agent/fork_rows"] == (0 if side_calls == "skip" else 1)
    if side_calls == "train":  # the title's row: one call, trained with the episode's reward
        assert t.counts["turns"][3:] == [1] * 3 and t.returns[3:].tolist() == [1.0] * 3
    else:  # a skipped side call's first input is not read: max_prompt_len bounds the trained ones only
        longest = int(t.prompt_mask.sum(1).max())
        fits = AgentEpisodes(titled, "t:titled", EpisodeLimits(5, 6, 4096), max_prompt_len=longest)
        assert len(collect(fits, model, tok, rows)) == 3
        trains = AgentEpisodes(
            titled, "t:titled", EpisodeLimits(5, 6, 4096), max_prompt_len=longest, side_calls="train"
        )
        with pytest.raises(ShifuError, match="the first input is"):
            collect(trains, model, tok, rows)


def test_a_first_input_longer_than_max_prompt_len_is_an_error_naming_the_row():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    rows = [{"prompt": "hello there"}, {"prompt": "a longer first question, " * 3}]
    t = collect(AgentEpisodes(chatty, "t:c", EpisodeLimits(2, 8, 4096)), model, tok, rows)
    short, long = t.prompt_mask.sum(1).tolist()
    assert short < long
    fits = AgentEpisodes(chatty, "t:c", EpisodeLimits(2, 8, 4096), max_prompt_len=long)
    assert collect(fits, model, tok, rows).prompt_mask.sum(1).tolist() == [short, long]
    bounded = AgentEpisodes(chatty, "t:c", EpisodeLimits(2, 8, 4096), max_prompt_len=long - 1)
    with pytest.raises(ShifuError) as e:
        collect(bounded, model, tok, rows)
    assert str(e.value).startswith(
        f"agent t:c, row {describe_row(rows[1])}: the first input is {long} tokens"
    )
    assert f"data.max_prompt_len={long - 1}: raise it" in str(e.value)


def test_the_config_refuses_what_an_agent_cannot_run(tmp_path, monkeypatch):
    base = {"out_dir": "o", "model": {"path": "m"}, "data": {"train": "p.jsonl"}}
    base["agent"] = {"factory": "echo_agent:solve"}

    from shifu.config.loader import from_dict

    def check(extra: dict) -> str:
        with pytest.raises(ConfigError) as e:
            from_dict(PPOConfig, json.loads(json.dumps(base)) | extra).validate()
        return str(e.value)

    from_dict(PPOConfig, base).validate()  # alone it is a complete source
    assert "give env.factory or agent.factory, not both" in check({"env": {"factory": "x:Y"}})
    assert "agent.factory rewards its episodes" in check({"reward": {"function": "x:f"}})
    from_dict(
        PPOConfig, base | {"distributed": {"strategy": "fsdp2"}}
    ).validate()  # sharded actors run agents
    assert "unset generation.stop" in check({"generation": {"stop": ["]"]}})
    assert "agent.concurrency must be >= 1" in check({"agent": {"factory": "a:b", "concurrency": 0}})
    with pytest.raises(ConfigError) as e:
        from_dict(PPOConfig, {k: v for k, v in base.items() if k != "agent"}).validate()
    assert "reward.url, env.factory, agent.factory and verifiers.taskset" in str(e.value)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    (tmp_path / "sync_agent.py").write_text("def solve(client, row):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="is not an async function"):
        load_agent("sync_agent:solve")
    assert load_agent("echo_agent:solve").__name__ == "solve"


def test_a_quickstart_plan_takes_an_agent_instead_of_its_environment():
    from shifu.pipelines.quickstart import _plan
    from shifu.rollout.build import describe

    sets = ["ppo.env.factory=null", "ppo.generation.stop=[]", "ppo.agent.factory=arith_tool_agent:solve"]
    plan = _plan("arith_tool", "smollm2", sets)
    assert (
        describe(plan["ppo"]).kind == "agent" and describe(plan["ppo"]).name == "agent arith_tool_agent:solve"
    )
    assert describe(_plan("arith_tool", "smollm2", [])["ppo"]).kind == "environment"
    with pytest.raises(ConfigError, match="give env.factory or agent.factory, not both"):
        _plan("arith_tool", "smollm2", sets[1:])


def test_the_example_environment_reads_the_first_input_the_example_agent_sends(monkeypatch):
    """The like-for-like pair of the agent-equivalence benchmark: ``arith_tool_agent.environment`` starts each
    episode with exactly the ids the gateway rendered for ``arith_tool_agent.solve``'s first call (its system
    message, then the tools block of a template without tools, as SmolLM2's), read as the policy reads them."""
    from shifu.rollout.turns import turn_encoder

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import arith_tool_agent

    model, tok = setup_model("smollm2_template")
    rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a, b in ((347, 29), (120, 11))]
    source = AgentEpisodes(arith_tool_agent.solve, "arith_tool_agent:solve", EpisodeLimits(3, 8, 4096))
    t = collect(source, model, tok, rows)
    env = arith_tool_agent.environment()
    for i, row in enumerate(rows):
        agent_first = t.prompt_ids[i][t.prompt_mask[i].bool()].tolist()
        assert agent_first == turn_encoder(tok, True, env).first(env.reset(row))
        assert len(agent_first) > 100  # (the tools block is there: the task's own system message is ~70 ids)


def test_the_example_environment_ends_an_episode_where_the_agent_does(monkeypatch):
    """A turn the gateway returns as text (no call parses in the syntax it reads for SmolLM2's template) ends
    the agent's episode as an answer; the example environment ends it too, where the task's own environment
    reports a failed call and goes on."""
    from shifu.models.tool_calls import parse_tool_calls, tool_format
    from shifu.tasks.arith_tool import calculator_env

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import arith_tool_agent

    syntax = tool_format(smollm2_tokenizer()).syntax
    row = {"prompt": "What is 2*3?", "answer": "6"}
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    broken = ['<tool_call>{"name": "2*3"}}</tool_call>', '<tool_call>{"name": "calculator", "arguments": {"e']
    llama = '{"name": "calculator", "parameters": {"expression": "2*3"}}'
    for action, calls in [(call, 1), ("6", 0), (llama, 0), *[(b, 0) for b in broken]]:
        assert len(parse_tool_calls(action, syntax)[1]) == calls  # what the agent gets back as tool_calls
        env = arith_tool_agent.environment()
        env.reset(row)
        step = env.step(action)
        assert step.done == (calls == 0) and step.reward == float(action == "6")
    for action in broken:  # the task's environment: a failed call, read by the policy
        env = calculator_env("json")
        env.reset(row)
        step = env.step(action)
        assert not step.done and step.info == {"tool_calls": 1, "tool_errors": 1}
    with pytest.raises(ValueError, match="invalid_calls must be 'error' or 'answer'"):
        calculator_env("json", invalid_calls="ignore")


@pytest.mark.slow
def test_the_arith_tool_smollm2_quickstart_runs_through_the_example_agent(tmp_path, monkeypatch):
    """The plumbing of `shifu quickstart --task arith_tool --preset smollm2` with ppo.agent.factory (the
    example's calculator as a tools= function), on a tiny stand-in for SmolLM2 (tests/test_smollm2_presets.py
    runs the environment path the same way): SFT, LoRA RLOO on the agent's episodes, the final evaluation
    through the agent."""
    from conftest import build_tiny_tokenizer

    from shifu.cli.main import main as cli_main
    from shifu.models.loading import build_tiny_gpt2, load_tokenizer
    from shifu.tasks import assets

    stand_in = tmp_path / "cache" / "smollm2-135m-instruct"
    build_tiny_tokenizer().save_pretrained(str(stand_in))
    tok = load_tokenizer(stand_in)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok.save_pretrained(str(stand_in))
    build_tiny_gpt2(tok, n_layer=2, n_embd=64, n_head=2, n_positions=2048, seed=0).save_pretrained(
        str(stand_in)
    )
    monkeypatch.setattr(assets, "converted_smollm2", lambda: stand_in)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    out = tmp_path / "run"
    sets = [
        "sft.max_steps=2",
        "sft.batch_size=4",
        "sft.lora.target_modules=null",  # the stand-in is a GPT-2: peft's default layers (c_attn)
        "ppo.iterations=1",
        "ppo.batch_size=8",
        "ppo.minibatch_size=8",
        "ppo.env.factory=null",
        "ppo.generation.stop=[]",
        "ppo.generation.max_total_tokens=200",
        "ppo.generation.max_new_tokens=100",  # (a whole call in the stand-in's ids: SFT starts from the teacher's)
        "ppo.agent.factory=arith_tool_agent:solve",
        "ppo.data.max_prompt_len=600",  # the stand-in's tokenizer reads the tools block as ~570 ids
        "eval.num_prompts=8",
        "teacher.num_rows=16",
        "teacher.eval_rows=4",
    ]
    argv = ["quickstart", "--task", "arith_tool", "--preset", "smollm2", "--out", str(out)]
    assert cli_main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_judge"] == "episode return of arith_tool_agent:solve"
    assert json.loads((out / "teacher" / "DONE").read_text())["sft_train"]["demonstrations"] == 16
    assert s["eval_prompts"] == 8 and 0 <= s["tool_use_before"] <= 1 and s["kl"] >= 0
    metrics = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "agent/calls" in m]
    assert len(train) == 1 and train[0]["agent/errors"] == 0 and train[0]["rollout/rows"] == 8


# ------------------------------------------------------------------------------------- training
def build_echo_task(d: Path) -> dict[str, Path]:
    """The tests' character model (ppo_task) with a chat template whose end of an assistant turn is EOS, and a
    decoder that joins characters as they are (without one, decoding puts a space between tokens, so the text of
    a completion does not decode back from its ids and the gateway re-tokenises the history: every call forks);
    64 prompts."""
    from ppo_task import build_char_model, write_prompts
    from tokenizers import decoders

    from shifu.models.loading import load_tokenizer

    char = build_char_model(d / "char")
    tok = load_tokenizer(char)
    tok.backend_tokenizer.decoder = decoders.Fuse()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
        "{% else %}{{ ' ' }}{% endif %}{% endfor %}"
    )
    tok.save_pretrained(str(char))
    return {"char": char, "prompts": write_prompts(d / "prompts.jsonl", 64)}


@pytest.fixture(scope="module")
def echo_task(tmp_path_factory):
    return build_echo_task(tmp_path_factory.mktemp("agent_ppo"))


@pytest.mark.slow
def test_shifu_ppo_trains_an_openai_client_agent_with_a_critic(echo_task, tmp_path, monkeypatch):
    """examples/agents/echo_agent.py (two calls, a reward on the second over POST /rl/set_reward, nothing from
    shifu) trains with PPO, GAE on a critic: the agent's return (the fraction of `a` in its second answer, ~0.08
    for the random policy) rises in training and on held-out episodes."""
    from shifu.cli import main as cli

    monkeypatch.syspath_prepend(str(EXAMPLES))
    out = tmp_path / "run"
    argv = [
        "ppo",
        "--out",
        str(out),
        f"model.path={echo_task['char']}",
        f"data.train={echo_task['prompts']}",
        f"data.eval={echo_task['prompts']}",
        "agent.factory=echo_agent:solve",
        "agent.concurrency=32",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=12",
        "batch_size=32",
        "minibatch_size=16",
        "ppo_epochs=2",
        "eval.every=12",
        "eval.num_prompts=32",
        "eval.temperature=1.0",
        "critic.init=sft",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.01",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "agent/return" in r]
    assert len(train) == 12 and all(r["agent/calls"] == 2 and r["agent/errors"] == 0 for r in train)
    assert all(r["agent/turns"] == 2 and r["agent/forks"] == 0 for r in train)  # every call joined
    early = sum(r["agent/return"] for r in train[:3]) / 3
    late = sum(r["agent/return"] for r in train[-3:]) / 3
    assert late > early + 0.1, (early, late)
    evals = [r for r in rows if "gold/score" in r]
    assert evals[-1]["gold/score"] > evals[0]["gold/score"] + 0.1, evals
    assert all(r["eval/score"] == r["gold/score"] == r["eval/env/return"] for r in evals)
    assert all(0 < r["rollout/response_len"] <= 2 * 6 for r in train)  # sampled tokens only
    assert "value/explained_var" in train[-1]  # the critic trained
    # shifu eval --run: the run's start against its final policy, held-out episodes through the run's agent
    record = tmp_path / "eval.json"
    assert cli.main(["eval", "--run", str(out), "--out", str(record)]) == 0
    rec = json.loads(record.read_text())
    assert rec["judge"] == "episode return of echo_agent:solve" and rec["prompts"]["count"] > 0
    assert rec["paired"]["gain"] > 0
    assert cli.main(["eval", "--run", str(out), "--stop", "]", "--out", str(tmp_path / "x.json")]) == 2


async def forking(client, row: dict) -> float:
    """Two calls, the second starting over from another first message (a fork): returns its fraction of `a`."""
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    retry = [{"role": "user", "content": row["prompt"] + "a"}]
    text = (await client.chat.completions.create(model="policy", messages=retry)).choices[0].message.content
    return (text or "").count("a") / max(1, len(text or ""))


@pytest.mark.parametrize("estimator", ["gae", "rloo"])
def test_forks_train_as_rows_of_their_own_unless_an_estimator_compares_groups(echo_task, tmp_path, estimator):
    """GAE (one process, group_size 1): each episode's fork trajectory is a row of its own, trained with the
    episode's reward (twice the rows); RLOO (group_size 4): one row per episode, the fork counted."""
    from shifu.cli import main as cli

    out = tmp_path / estimator
    argv = [
        "ppo",
        "--out",
        str(out),
        f"model.path={echo_task['char']}",
        f"data.train={echo_task['prompts']}",
        "agent.factory=test_agent:forking",
        "generation.max_new_tokens=5",
        "generation.max_total_tokens=12",
        "iterations=2",
        "batch_size=16",
        "minibatch_size=8",
        "eval.every=0",
        "eval.num_prompts=4",
        "critic.init=sft",
        "progress=false",
        "tensorboard=false",
    ]
    if estimator == "rloo":
        argv += ["advantage_estimator=rloo", "group_size=4"]
    assert cli.main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "agent/return" in r]
    assert len(train) == 2 and all(r["agent/forks"] == 1 and r["agent/calls"] == 2 for r in train)
    forks = 1 if estimator == "gae" else 0
    assert all(r["agent/fork_rows"] == forks and r["rollout/rows"] == 16 * (1 + forks) for r in train)
    assert all(abs(r["loss/policy"]) < 1e3 for r in train)


def test_the_quickstart_evaluation_runs_held_out_episodes_through_the_plans_agent(
    echo_task, tmp_path, monkeypatch
):
    from shifu.evaluation.final import evaluate as final_evaluation

    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = {
        "agent": {"factory": "echo_agent:solve"},
        "generation": {"max_new_tokens": 6, "max_total_tokens": 24},
    }
    ev = {"temperature": 1.0, "num_prompts": 8, "batch_size": 4}
    char = echo_task["char"]
    summary = final_evaluation("echo", char, char, str(echo_task["prompts"]), ev, 0, tmp_path, ppo_plan=plan)
    assert summary["eval_prompts"] == 8 and summary["gold_judge"] == "episode return of echo_agent:solve"
    assert summary["turns_after"] == 2 and 0 <= summary["gold_after"] <= 1
    assert len((tmp_path / "samples_after.jsonl").read_text().splitlines()) == 8


def test_an_agent_run_ends_with_its_paired_evaluation_and_reports_the_agent(echo_task, tmp_path, monkeypatch):
    """``shifu ppo`` with agent.factory ends as an environment run does: the run's start and its final policy on
    the held-out prompts through the agent (its return the gold), paired gain ± standard error in summary.json,
    which also records the source; the model card and the report name the agent and how it scored. Then
    ``shifu eval --agent`` measures two policies through the agent, paired, as the record says."""
    from shifu.cli import main as cli
    from shifu.core.stats import mean_se
    from shifu.reporting.report import render_report

    monkeypatch.syspath_prepend(str(EXAMPLES))
    out = tmp_path / "run"
    argv = [
        "ppo",
        "--out",
        str(out),
        f"model.path={echo_task['char']}",
        f"data.train={echo_task['prompts']}",
        f"data.eval={echo_task['prompts']}",
        "agent.factory=echo_agent:solve",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "iterations=2",
        "batch_size=16",
        "minibatch_size=8",
        "eval.every=0",
        "eval.num_prompts=8",
        "eval.final_prompts=12",
        "eval.temperature=1.0",
        "critic.init=sft",
        "progress=false",
        "tensorboard=false",
    ]
    assert cli.main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_judge"] == "episode return of echo_agent:solve" and s["eval_prompts"] == 12
    assert s["turns_before"] == s["turns_after"] == 2 and s["kl"] >= 0
    after = [json.loads(x) for x in (out / "samples_after.jsonl").read_text().splitlines()]
    before = [json.loads(x) for x in (out / "samples_before.jsonl").read_text().splitlines()]
    gain, gain_se = mean_se([a["gold"] - b["gold"] for a, b in zip(after, before)])
    assert s["gold_gain"] == pytest.approx(gain) and s["gold_gain_se"] == pytest.approx(gain_se)
    assert s["source"] == {
        "name": "agent echo_agent:solve",
        "kind": "agent",
        "scored_by": "agent's reward",
        "spec": "echo_agent:solve",
        "gold": True,
        "records": ["turns", "tool_calls", "observation_tokens"],
        "available": True,
    }
    card = (out / "final" / "README.md").read_text()
    assert "through the agent echo_agent:solve" in card and "the agent's return is its reward" in card
    assert "episode return of `echo_agent:solve`, final evaluation" in card and "- agent" in card
    assert "scored by the run's reward" not in card and "score by" not in card
    page = render_report(out).read_text(encoding="utf-8")
    assert "the agent echo_agent:solve (its episode return)" in page
    # shifu eval --agent: the run's start (A) against its final policy (B), the same prompts and seed
    record = tmp_path / "eval.json"
    flags = ["--prompts", str(echo_task["prompts"]), "--num-prompts", "8", "--max-new-tokens", "6"]
    flags += ["--max-total-tokens", "24", "--temperature", "1", "--out", str(record)]
    assert cli.main(["eval", str(echo_task["char"]), str(out), "--agent", "echo_agent:solve", *flags]) == 0
    rec = json.loads(record.read_text())
    assert rec["judge"] == "episode return of echo_agent:solve" and rec["prompts"]["count"] == 8
    diffs = [r["B"]["score"] - r["A"]["score"] for r in rec["rows"]]
    assert rec["paired"]["gain"] == pytest.approx(mean_se(diffs)[0]) and rec["paired"]["pairs"] == 8
    assert all(p["turns"] == 2 for p in rec["policies"].values()) and rec["paired"]["kl"] is not None
    bad = ["eval", str(echo_task["char"]), "--agent", "echo_agent:nope", *flags, "--overwrite"]
    assert cli.main(bad) == 2


def test_an_agent_without_its_extras_is_refused_before_the_run_writes_anything(
    echo_task, tmp_path, monkeypatch, capsys
):
    """The agent source says whether it can run here (SourceDescription.available): without the openai client
    (its import blocked, as when the extra is not installed) `shifu ppo` stops before its run directory is made,
    naming the extras to install."""
    import sys

    from shifu.cli import main as cli

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setitem(sys.modules, "openai", None)
    out = tmp_path / "run"
    argv = ["ppo", "--out", str(out), f"model.path={echo_task['char']}", f"data.train={echo_task['prompts']}"]
    assert cli.main([*argv, "agent.factory=echo_agent:solve", "progress=false"]) == 2
    assert "agent.factory echo_agent:solve needs its extras: pip install" in capsys.readouterr().err
    assert not out.exists()


def test_without_a_generator_each_evaluation_batch_samples_its_own_tokens_the_same_every_time():
    """An evaluation through an agent with no generator: the gateway's seed is the collect's number, so two
    batches of the same rows sample other tokens, and a fresh source repeats them."""
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    rows = [{"prompt": f"hello {i}"} for i in range(3)]
    params = SamplingParams(6, 1.0)

    def run() -> list[str]:
        source = AgentEpisodes(one_call, "t:one", EpisodeLimits(2, 6, 64))
        return evaluate(Policy(model, tok), source, [batch_of(rows), batch_of(rows)], params, None).responses

    first = run()
    assert first[:3] != first[3:] and run() == first


def test_sessions_without_a_row_id_sample_as_numbered_sessions_not_by_their_random_keys():
    """A session started without a row id (an outside harness) is identified by its number among such
    sessions: two gateways with one seed give its calls the same tokens, and another seed other ones."""
    from shifu.gateway import Gateway
    from shifu.gateway.engine import Job

    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    ids = tok("hello there", add_special_tokens=False)["input_ids"]

    def sampled(seed: int) -> list[list[int]]:
        gw = Gateway(model, tok, recording=True, token="t", seed=seed)
        keys = [gw.start_session(), gw.start_session()]
        jobs = [gw.identify(Job(ids, 1, 12, [], 1.0), k) for k in keys]
        assert [j.identity for j in jobs] == [(("session", 0), 0), (("session", 1), 0)]
        return [c[0].ids for c in gw.engine.run(jobs)]

    first = sampled(3)
    assert first == sampled(3) and first[0] != first[1] and sampled(4) != first

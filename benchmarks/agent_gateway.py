"""The agent source on the policy gateway (shifu.rollout.agent): load, and the HTTP overhead against the in-process
episode source.

Setup: a GPT-2-style policy (``--layers`` x ``--width``, 4 heads, 512 positions) with a byte-level BPE tokenizer
(trained in milliseconds on a fixed corpus) and a ChatML template whose end of turn is EOS, trained for a few
seconds to answer each turn with the same ``--tokens``-token sentence and EOS. Every episode is the same scripted
conversation: the question, then ``--turns`` policy turns (each capped at ``--tokens`` + 8), each answered with
the user message "go on" (the last with a reward).

``--load``: ``--sessions`` agents at once (``agent.concurrency``) through ``AgentEpisodes.collect``, the real
``openai.AsyncOpenAI`` on real HTTP (uvicorn on 127.0.0.1), sampled at T = 1. Reports every call answered (the
calls made, answered and failed), per-call latency p50 / p99 (ms, timed in the agent around each request),
calls/s and completions per sampler call (the gateway's merging of concurrent calls), over ``--repeats``
rollouts.

``--overhead``: the same episodes, greedy (both sources sample the same tokens), through the agent source and
through the in-process episode source (``shifu.rollout.episodes.Episodes`` with an environment that answers as
the agent does), alternating, ``--repeats`` times each: process CPU seconds (every thread: server, sampler,
tokenizer, agents) and wall seconds per rollout of ``--sessions`` episodes, and the ratio agent / in-process.

    python benchmarks/agent_gateway.py --load --sessions 32 --record
    python benchmarks/agent_gateway.py --overhead --sessions 32 --record
    python benchmarks/agent_gateway.py --load --overhead --short      # seconds: keeps it from rotting
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import provenance  # noqa: E402  (benchmarks/provenance.py: this script's own folder is on sys.path)
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTION = "What is the capital of France, and why is it there?"
FOLLOW = "go on"
WORDS = "the a of to and in is it that was for on are as with his they at be this from have or by".split()
ANSWER = " ".join(WORDS + WORDS[:10])  # distinct words in order: a tiny model learns it in seconds
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LATENCIES: list[float] = []  # per call, seconds (the load run's agent appends)
FAILED: list[str] = []


def build_policy(layers: int, width: int, turns: int, tokens: int):
    """A GPT-2 and its byte-level BPE tokenizer with the ChatML template (EOS ``<|im_end|>``), the model trained
    to answer every turn with the same sentence (:func:`memorize`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shifu.models.loading import build_tiny_gpt2

    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(400)]
    corpus += [QUESTION, FOLLOW, ANSWER, "assistant user system"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|im_end|>", "<|pad|>", "<|im_start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.chat_template = CHATML
    tok.padding_side = "left"
    model = build_tiny_gpt2(tok, n_layer=layers, n_embd=width, n_head=4, n_positions=512, seed=0)
    return memorize(model, tok, turns, tokens), tok


def memorize(model, tok, turns: int, tokens: int):
    """``model`` trained to answer every turn of the conversation with the same ``tokens``-token sentence and
    EOS (greedy decoding then writes exactly that; sampling mostly does), so that turns end as they would."""
    import torch.nn.functional as F

    answer = tok(ANSWER, add_special_tokens=False)["input_ids"][:tokens] + [tok.eos_token_id]
    said = tok.decode(answer[:-1])
    messages, rows = [{"role": "user", "content": QUESTION}], []
    for _ in range(turns):
        prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))[
            "input_ids"
        ]
        rows.append((prompt, answer))
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": FOLLOW}]
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(120):
        loss = 0.0
        for prompt, target in rows:
            ids = torch.tensor([prompt + target])
            loss = loss + F.cross_entropy(model(ids).logits[0, len(prompt) - 1 : -1], ids[0, len(prompt) :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


async def scripted_agent(client, row: dict, turns: int) -> float:
    """The conversation through the ``openai`` client: each answer sent back, then "go on"."""
    messages = [{"role": "user", "content": QUESTION}]
    for turn in range(turns):
        t0 = time.perf_counter()
        try:
            out = await client.chat.completions.create(model="policy", messages=messages)
        except Exception as e:  # counted, not raised: a benchmark reports what failed
            FAILED.append(f"{type(e).__name__}: {e}")
            raise
        LATENCIES.append(time.perf_counter() - t0)
        messages += [{"role": "assistant", "content": out.choices[0].message.content}]
        if turn + 1 < turns:
            messages += [{"role": "user", "content": FOLLOW}]
    return 1.0


class Scripted:
    """The same conversation as an environment (``shifu.rollout.episodes``): "go on" after each turn, done with
    reward 1 after the last."""

    def __init__(self, turns: int):
        self.turns = turns

    def reset(self, row: dict) -> list[dict]:
        self.turn = 0
        return [{"role": "user", "content": QUESTION}]

    def step(self, action: str):
        from shifu.envs.base import Step

        self.turn += 1
        if self.turn == self.turns:
            return Step(reward=1.0, done=True)
        return Step(observation=[{"role": "user", "content": FOLLOW}])


def sources(args, concurrency: int):
    from shifu.config.loader import from_dict
    from shifu.config.sources import EnvConfig
    from shifu.envs.base import Environment
    from shifu.rollout.agent import AgentEpisodes
    from shifu.rollout.episodes import EpisodeLimits, Episodes

    cap = args.tokens + 8  # (room for EOS: every turn ends)
    limits = EpisodeLimits(args.turns, cap, args.turns * (cap + 24))
    turns = {"turns": args.turns}
    agent = AgentEpisodes(
        scripted_agent, "agent_gateway:scripted_agent", limits, concurrency, timeout_s=None, kwargs=turns
    )
    env = Environment(from_dict(EnvConfig, {"factory": "agent_gateway:Scripted", "kwargs": turns}))
    return agent, Episodes(env, limits, chat=True)


def rollout(source, policy, n: int, params) -> tuple[object, float, float]:
    """One collect of ``n`` episodes: (trajectories, process CPU seconds, wall seconds)."""
    from shifu.rollout.batch import PromptBatch

    batch = PromptBatch(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), [{}] * n)
    c0, t0 = time.process_time(), time.perf_counter()
    out = source.collect(policy, batch, params, torch.Generator().manual_seed(0))
    return out, time.process_time() - c0, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def load(args, model, tok) -> dict:
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.sources import Policy

    agent, _ = sources(args, args.sessions)
    policy, params = Policy(model, tok, with_log_probs=True), SamplingParams(args.tokens + 8, 1.0)
    rollout(agent, policy, min(4, args.sessions), params)  # warm-up (imports, first server start)
    LATENCIES.clear(), FAILED.clear()
    walls, batched, calls = [], [], 0
    for _ in range(args.repeats):
        t, _, wall = rollout(agent, policy, args.sessions, params)
        walls.append(wall)
        batched.append(t.metrics["agent/batched_calls"])
        calls += round(t.metrics["agent/calls"] * args.sessions)
    expected = args.repeats * args.sessions * args.turns
    return {
        "calls_expected": expected,
        "calls_answered": len(LATENCIES),
        "calls_recorded": calls,
        "calls_failed": len(FAILED),
        "p50_ms": round(1000 * statistics.median(LATENCIES), 1),
        "p99_ms": round(1000 * percentile(LATENCIES, 99), 1),
        "max_ms": round(1000 * max(LATENCIES), 1),
        "calls_per_s": round(len(LATENCIES) / sum(walls), 1),
        "completions_per_sampler_call": round(statistics.mean(batched), 2),
        "wall_s_per_rollout": round(statistics.median(walls), 3),
    }


def overhead(args, model, tok) -> dict:
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.sources import Policy

    agent, episodes = sources(args, args.sessions)
    policy, params = (
        Policy(model, tok, with_log_probs=True),
        SamplingParams(args.tokens + 8, 1.0, greedy=True),
    )
    a, _, _ = rollout(agent, policy, args.sessions, params)  # warm-up, and the two sources' trajectories
    e, _, _ = rollout(episodes, policy, args.sessions, params)
    same = torch.equal(a.input_ids, e.input_ids) and torch.equal(a.trainable, e.trainable)
    cpu = {"agent": [], "episodes": []}
    wall = {"agent": [], "episodes": []}
    for _ in range(args.repeats):  # alternating: the machine's load drifts
        for name, source in (("agent", agent), ("episodes", episodes)):
            _, c, w = rollout(source, policy, args.sessions, params)
            cpu[name].append(c)
            wall[name].append(w)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "same_trajectories": same,
        "sampled_tokens": int(a.trainable.sum()),
        "cpu_s_agent": round(med["agent"], 3),
        "cpu_s_in_process": round(med["episodes"], 3),
        "cpu_ratio": round(med["agent"] / med["episodes"], 3),
        "overhead_cpu_ms_per_call": round(
            1000 * (med["agent"] - med["episodes"]) / (args.sessions * args.turns), 2
        ),
        "cpu_s_agent_all": [round(x, 3) for x in cpu["agent"]],
        "cpu_s_in_process_all": [round(x, 3) for x in cpu["episodes"]],
        "wall_s_agent": round(statistics.median(wall["agent"]), 3),
        "wall_s_in_process": round(statistics.median(wall["episodes"]), 3),
        "completions_per_sampler_call": a.metrics["agent/batched_calls"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", action="store_true", help="concurrent sessions: latency, calls/s, batching")
    p.add_argument("--overhead", action="store_true", help="CPU seconds: agent source vs in-process episodes")
    p.add_argument("--sessions", type=int, default=32, help="episodes per rollout, all at once")
    p.add_argument("--turns", type=int, default=3, help="policy turns (calls) per episode")
    p.add_argument("--tokens", type=int, default=32, help="tokens of each answer (then EOS)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="rollouts measured (each source, for --overhead)")
    p.add_argument(
        "--short", action="store_true", help="4 sessions, 1 repeat, 8 tokens (keeps it from rotting)"
    )
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    if args.short:
        args.sessions, args.repeats, args.tokens = 4, 1, 8
    if not (args.load or args.overhead):
        p.error("give --load and/or --overhead")
    torch.set_num_threads(1)
    model, tok = build_policy(args.layers, args.width, args.turns, args.tokens)
    params = {
        "sessions": args.sessions,
        "turns": args.turns,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "model": f"gpt2 {args.layers}x{args.width}, vocab {len(tok)}",
    }
    for mode, run in (("load", load), ("overhead", overhead)):
        if getattr(args, mode):
            metrics = run(args, model, tok)
            print(json.dumps({"mode": mode, **params, **metrics}), flush=True)
            rec = params | {"mode": mode}
            provenance.record(args, "agent_gateway", metrics, params=rec, config=rec, threads=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

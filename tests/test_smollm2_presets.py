"""The plumbing of the SmolLM2 presets (``--preset smollm2`` of tasks arith and imdb), on a tiny stand-in.

The real presets start from the cached conversion of SmolLM2-135M-Instruct; here ``converted_smollm2`` is
replaced by a tiny GPT-2 directory with a chat template, so every step runs in seconds: the task data in
chat form, ``base/`` a link to the cached model (never a copy), no SFT stage, LoRA actor (and LoRA critic
for imdb) whose checkpoints hold only adapters, and the summary with the paired gain and its error.
The figures of the real recipe come from ``benchmarks/smollm2_recipe.py``, never from CI.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shifu.cli.main import main as cli_main
from shifu.tasks import arith, assets, imdb
from shifu.tasks.judges import final_number_match

torch.set_num_threads(1)
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture()
def cached_model(tiny_model_dir, tmp_path, monkeypatch):
    """A stand-in for the cached conversion: a tiny model directory whose tokenizer has a chat template."""
    from shifu.models.loading import load_tokenizer

    where = {"dir": tmp_path / "cache" / "smollm2-135m-instruct"}
    shutil.copytree(tiny_model_dir, where["dir"])
    tok = load_tokenizer(where["dir"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(where["dir"]))
    monkeypatch.setattr(assets, "converted_smollm2", lambda: where["dir"])
    return where


def _files_under(d: Path) -> list[Path]:
    """Every file under ``d``, without following links to directories."""
    return [Path(root) / f for root, _, files in os.walk(d) for f in files]


@pytest.mark.unit
@pytest.mark.parametrize("task", [arith, imdb])
def test_pretrained_presets_link_the_cached_model_and_ask_in_chat_form(task, cached_model, tmp_path):
    out = tmp_path / "data"
    files = task.prepare(out, "smollm2", seed=0)
    base = Path(files["base"])
    assert base.is_symlink() and base.resolve() == cached_model["dir"].resolve()
    weights = [f for f in _files_under(out) if f.suffix in (".safetensors", ".bin")]
    assert weights == [], weights  # the run's directory holds no copy of the weights
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(files["tokenizer"])
    assert tok.get_vocab() == load_tokenizer(cached_model["dir"]).get_vocab()
    assert tok.chat_template == TEMPLATE
    held = [json.loads(x) for x in Path(files["prompts_eval"]).read_text().splitlines()]
    assert len(held) == 512
    if task is arith:
        assert held[0]["prompt"].startswith("What is ") and held[0]["prompt"].endswith("only the number.")
        a, b = (int(x) for x in held[0]["prompt"][len("What is ") :].split("?")[0].split("+"))
        assert held[0]["answer"] == str(a + b)
        assert final_number_match([held[0]["prompt"]], [f"{a} + {b} = {a + b}."], held[:1]) == [1.0]
    else:
        assert all(r["prompt"].startswith("Continue this movie review: ") for r in held)
    shutil.rmtree(out)  # deleting a run's data never touches the cache the link points to
    assert (cached_model["dir"] / "model.safetensors").is_file()


@pytest.mark.unit
def test_prepare_runs_again_when_the_cached_model_it_links_to_is_gone(cached_model, tmp_path):
    from shifu.pipelines.stages import Stages

    stages = Stages(tmp_path / "run", seed=0, who="test")
    stages.prepare("arith", "smollm2")
    moved = tmp_path / "cache2"
    cached_model["dir"].rename(moved)  # the cache was cleared; a new conversion lives elsewhere
    cached_model["dir"] = moved
    stages.prepare("arith", "smollm2")
    assert (tmp_path / "run" / "data" / "base").resolve() == moved.resolve()


def _adapter_only(run: Path, name: str) -> bool:
    step = max((run / "checkpoints").glob("step-*"))
    with safe_open(str(step / f"model-{name}.safetensors"), "pt") as st:
        return all("lora_" in k or k.startswith(("head.", "gain", "bias")) for k in st.keys())


@pytest.mark.integration
@pytest.mark.slow
def test_arith_smollm2_quickstart_without_sft_lora_rloo(cached_model, tmp_path):
    out = tmp_path / "run"
    sets = ["ppo.iterations=2", "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.grad_accum=1"]
    argv = ["quickstart", "--task", "arith", "--preset", "smollm2", "--out", str(out)]
    assert cli_main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_judge"] == "shifu.tasks.judges:final_number_match" and s["eval_prompts"] == 512
    assert "gold_greedy_before" not in s  # the plan skips the greedy pass
    assert not (out / "sft").exists() and "sft" not in s["seconds"]  # the instruct model is the SFT policy
    assert (out / "data" / "base").is_symlink()
    assert s["gold_gain_se"] >= 0 and s["kl"] >= 0
    assert _adapter_only(out / "ppo", "actor") and not (out / "ppo" / "critic").exists()  # RLOO: no critic
    cfg = (out / "ppo" / "config.yaml").read_text()
    assert "rloo" in cfg and str(out / "data" / "base") in cfg


@pytest.mark.integration
@pytest.mark.slow
def test_imdb_smollm2_quickstart_lora_actor_and_critic(cached_model, tmp_path):
    out = tmp_path / "run"
    sets = [
        "pairs.num_prompts=40",
        "rm.max_steps=4",
        "ppo.iterations=2",
        "ppo.batch_size=8",
        "ppo.minibatch_size=8",
        "ppo.grad_accum=2",
        "eval.max_new_tokens=8",
    ]
    argv = ["quickstart", "--task", "imdb", "--preset", "smollm2", "--out", str(out)]
    assert cli_main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["seconds"]) == {"prepare", "pairs", "rm", "ppo", "eval"}
    assert -1 <= s["gold_gain"] <= 2 and s["gold_gain_se"] >= 0
    assert _adapter_only(out / "ppo", "actor") and _adapter_only(out / "ppo", "critic")
    from shifu.models.loading import load_causal_lm
    from shifu.models.scalar import ScalarModel

    load_causal_lm(out / "ppo" / "final")  # final/ and critic/ are plain, merged models
    ScalarModel.from_pretrained(out / "ppo" / "critic")


@pytest.mark.unit
def test_arith_tool_smollm2_demonstrations_are_the_environments_own_conversations(cached_model, tmp_path):
    from shifu.tasks import arith_tool

    files = arith_tool.prepare(tmp_path / "data", "smollm2", seed=0)
    assert Path(files["base"]).resolve() == cached_model["dir"].resolve()
    held = [json.loads(x) for x in Path(files["prompts_eval"]).read_text().splitlines()]
    a, b = (int(x) for x in held[0]["prompt"].removeprefix("What is ").removesuffix("?").split("*"))
    assert held[0]["answer"] == str(a * b) and 100 <= a <= 999 and 10 <= b <= 99
    rows = [json.loads(x)["messages"] for x in Path(files["sft_train"]).read_text().splitlines()]
    env = arith_tool.calculator_env("json")
    first_turns, calls = 0, 0
    for i, msgs in enumerate(rows):
        assert msgs[0] == {"role": "system", "content": arith_tool.CHAT_SYSTEM} and msgs[1]["role"] == "user"
        assert env.tools_system == arith_tool.CHAT_SYSTEM  # what the episode's first input shows SmolLM2
        a, b = (int(x) for x in msgs[1]["content"].removeprefix("What is ").removesuffix("?").split("*"))
        if len(msgs) == 3:  # a first turn: the call, or the product written directly
            first_turns += 1
            reply = msgs[2]["content"]
            if reply.startswith("<tool_call>"):
                calls += 1
                call = json.loads(reply.removeprefix("<tool_call>").removesuffix("</tool_call>"))
                assert call == {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
                # followed by the turn after the tool's result, where the call is read (trained here)
                assert rows[i + 1][:3] == [*msgs[:2], {**msgs[2], "train": False}]
                env.reset({"prompt": msgs[1]["content"]})
                assert (
                    rows[i + 1][3]
                    == env.step(reply).observation[0]
                    == {"role": "tool", "content": str(a * b)}
                )
            else:
                assert reply == str(a * b)
        else:
            assert len(msgs) == 5 and msgs[4] == {"role": "assistant", "content": str(a * b)}
    assert first_turns == 2000 and 0.2 < calls / first_turns < 0.3  # a quarter call the calculator


@pytest.fixture()
def chat_cached_model(cached_model):
    """The stand-in, its template closing each message with EOS (as ChatML's <|im_end|>), which the episode
    rollout needs to find the end of a turn."""
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(cached_model["dir"])
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok.save_pretrained(str(cached_model["dir"]))
    return cached_model


@pytest.mark.integration
@pytest.mark.slow
def test_arith_tool_smollm2_quickstart_sft_then_lora_rloo_episodes(chat_cached_model, tmp_path):
    out = tmp_path / "run"
    sets = [
        "sft.max_steps=2",
        "sft.batch_size=4",
        "sft.lora.target_modules=null",  # the stand-in is a GPT-2: peft's default layers (c_attn)
        "ppo.iterations=1",
        "ppo.batch_size=8",
        "ppo.minibatch_size=8",
        "ppo.data.max_prompt_len=200",
        "eval.num_prompts=8",
    ]
    argv = ["quickstart", "--task", "arith_tool", "--preset", "smollm2", "--out", str(out)]
    assert cli_main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_judge"] == "episode return of shifu.tasks.arith_tool:calculator_env"
    assert s["eval_prompts"] == 8 and 0 <= s["tool_use_before"] <= 1 and s["kl"] >= 0
    assert (out / "sft" / "final").is_dir() and (out / "data" / "base").is_symlink()
    assert _adapter_only(out / "ppo", "actor") and not (out / "ppo" / "critic").exists()  # RLOO: no critic
    cfg = (out / "ppo" / "config.yaml").read_text()
    assert "rloo" in cfg and "format: json" in cfg and "</tool_call>" in cfg
    metrics = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any("env/turns" in m for m in metrics)

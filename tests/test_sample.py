"""shifu sample: responses from a run directory or an HF dir, scored by a reward model (the exact tokens the
policy produced, as PPO scores them) or a reward function; seeds reproduce; the chat template is applied;
the interactive loop answers each stdin line; wrong inputs are named."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from shifu.cli import main as cli
from shifu.generation.rollout import SamplingParams, generate
from shifu.generation.sample import read_prompts, render_prompt
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.models.padding import pad_left
from shifu.models.scalar import ScalarModel
from shifu.runs.files import resolve_policy

pytestmark = pytest.mark.unit

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def words_reward(prompts, responses, rows):
    """A reward function: words in the response plus the row's ``bonus`` (extra fields reach it)."""
    return [len(y.split()) + r.get("bonus", 0) for y, r in zip(responses, rows)]


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A policy run directory (final/), a quickstart-shaped run, a reward model run, and a policy whose
    tokenizer has a chat template."""
    root = tmp_path_factory.mktemp("sample")
    run = root / "sft_run"
    shutil.copytree(tiny_model_dir, run / "final")
    quick = root / "quick"
    shutil.copytree(tiny_model_dir, quick / "sft" / "final")
    shutil.copytree(tiny_model_dir, quick / "ppo" / "final")
    ScalarModel.from_backbone(tiny_model_dir, seed=0).save_pretrained(root / "rm_run" / "final")
    chat = root / "chat"
    shutil.copytree(tiny_model_dir, chat)
    tok = load_tokenizer(chat)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(chat))
    return {"run": run, "quick": quick, "rm": root / "rm_run", "chat": chat}


def sample_rows(capsys, *argv) -> list[dict]:
    out = Path(argv[argv.index("--out") + 1])
    assert cli.main(["sample", *map(str, argv)]) == 0, capsys.readouterr().err
    return [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]


def test_reward_model_scores_the_tokens_the_policy_sampled(dirs, tmp_path, capsys):
    prompts = ["the movie was", "tell me a story about a cat"]
    out = tmp_path / "o.jsonl"
    argv = [dirs["run"], "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", 12]
    rows = sample_rows(
        capsys, *argv, "--seed", 5, "--temperature", 0.9, "--reward-model", dirs["rm"], "--out", out
    )
    printed = capsys.readouterr().out
    assert [r["prompt"] for r in rows] == prompts

    # the same sampler by hand: same seed and params -> the same tokens; the RM scores prompt + response ids
    tok = load_tokenizer(dirs["run"] / "final")
    policy = load_causal_lm(dirs["run"] / "final", dropout=False).eval()
    enc = pad_left([tok(p, add_special_tokens=False)["input_ids"] for p in prompts], tok.pad_token_id)
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    ids, mask = generate(
        policy,
        enc["input_ids"],
        enc["attention_mask"],
        params,
        tok.eos_token_id,
        tok.pad_token_id,
        generator=torch.Generator().manual_seed(5),
    )
    rm = ScalarModel.from_pretrained(dirs["rm"] / "final").eval()
    with torch.no_grad():
        expected = rm.score(
            torch.cat([enc["input_ids"], ids], 1), torch.cat([enc["attention_mask"], mask.long()], 1)
        )
    for i, r in enumerate(rows):
        real = ids[i][mask[i]].tolist()
        assert r["response_tokens"] == len(real)
        assert r["finished"] == (real[-1] == tok.eos_token_id)
        assert r["response"] == tok.decode(
            [t for t in real if t != tok.eos_token_id], skip_special_tokens=True
        )
        assert r["score"] == pytest.approx(float(expected[i]), abs=1e-5)
        assert f"score {r['score']:.4f}" in printed


def test_reward_function_sees_the_rows_and_seeds_reproduce(dirs, tmp_path, capsys):
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "hello there", "bonus": 100}, {"prompt": "what is two plus three?"}]
    )
    common = [dirs["run"], "--prompts", prompts, "-n", 3, "--max-new-tokens", 10, "--batch-size", 4]
    fn = ["--reward-function", "test_sample:words_reward"]
    a = sample_rows(capsys, *common, "--seed", 1, *fn, "--out", tmp_path / "a.jsonl")
    b = sample_rows(capsys, *common, "--seed", 1, "--out", tmp_path / "b.jsonl")
    c = sample_rows(capsys, *common, "--seed", 2, "--out", tmp_path / "c.jsonl")
    assert [r["prompt"] for r in a] == ["hello there"] * 3 + ["what is two plus three?"] * 3
    for r in a:
        assert r["score"] == len(r["response"].split()) + (100 if r["prompt"] == "hello there" else 0)
    assert [r["response"] for r in a] == [r["response"] for r in b]  # same seed: same responses
    assert [r["response"] for r in a] != [r["response"] for r in c]
    assert len({r["response"] for r in a[:3]}) > 1  # -n 3 draws three different samples
    assert "score" not in b[0]


def test_quickstart_run_uses_its_last_policy_and_greedy_is_deterministic(dirs, tmp_path, capsys):
    assert resolve_policy(dirs["quick"]) == dirs["quick"] / "ppo" / "final"
    assert resolve_policy(dirs["run"]) == dirs["run"] / "final"
    assert resolve_policy(dirs["run"] / "final") == dirs["run"] / "final"
    a = sample_rows(
        capsys, dirs["quick"], "--prompt", "the film", "--temperature", 0, "--out", tmp_path / "a.jsonl"
    )
    b = sample_rows(
        capsys, dirs["quick"], "--prompt", "the film", "--greedy", "--seed", 9, "--out", tmp_path / "b.jsonl"
    )
    assert a == b


def test_chat_template_is_applied_unless_switched_off(dirs, tmp_path, capsys):
    tok = load_tokenizer(dirs["chat"])
    assert render_prompt(tok, {"prompt": "hi"}) == "<|user|>hi\n<|assistant|>"
    assert render_prompt(tok, {"prompt": "hi"}, chat_template=False) == "hi"
    chat = {"messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}]}
    assert render_prompt(tok, chat) == "<|system|>be nice\n<|user|>hi\n<|assistant|>"
    plain = load_tokenizer(dirs["run"] / "final")  # no template: the SFT stage's plain chat format
    assert render_prompt(plain, chat) == "system: be nice\nuser: hi\nassistant: "

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the movie"}, chat])
    rows = sample_rows(
        capsys, dirs["chat"], "--prompts", prompts, "--max-new-tokens", 4, "--out", tmp_path / "o.jsonl"
    )
    assert [r["rendered_prompt"] for r in rows] == [
        "<|user|>the movie\n<|assistant|>",
        render_prompt(tok, chat),
    ]
    assert [r["prompt"] for r in rows] == ["the movie", "hi"]
    rows = sample_rows(
        capsys, dirs["chat"], "--prompt", "the movie", "--no-chat-template", "--out", tmp_path / "o2.jsonl"
    )
    assert rows[0]["rendered_prompt"] == "the movie"


def test_interactive_loop_answers_each_line_until_eof(dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("the movie was\n\nhello there\n"))
    out = tmp_path / "o.jsonl"
    rows = sample_rows(
        capsys,
        dirs["run"],
        "--interactive",
        "--max-new-tokens",
        6,
        "--reward-model",
        dirs["rm"],
        "--out",
        out,
    )
    assert [r["prompt"] for r in rows] == ["the movie was", "hello there"]  # the blank line is skipped
    assert all(isinstance(r["score"], float) for r in rows)


def test_errors_name_what_to_pass(dirs, tmp_path, capsys):
    assert cli.main(["sample", str(dirs["rm"]), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "is a reward model (shifu rm), not a policy: pass it as --reward-model" in err
    (tmp_path / "empty").mkdir()
    assert cli.main(["sample", str(tmp_path / "empty"), "--prompt", "x"]) == 2
    assert "holds no model: expected config.json" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n', encoding="utf-8")
    assert cli.main(["sample", str(dirs["run"]), "--prompts", str(bad)]) == 2
    assert f"{bad}, line 2, field 'prompt': missing or not a non-empty string" in capsys.readouterr().err
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n", encoding="utf-8")
    assert read_prompts(txt) == [{"prompt": "first prompt"}, {"prompt": "second prompt"}]
    assert cli.main(["sample", str(dirs["run"]), "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert cli.main(["sample", str(dirs["run"]), "--prompt", "x", "--reward-function", "nosuchmod:f"]) == 2
    assert "cannot import module 'nosuchmod'" in capsys.readouterr().err

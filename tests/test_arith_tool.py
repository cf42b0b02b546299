"""Task arith_tool: its data and calculator, and the quickstart with a calculator environment written by
someone else (examples/envs/calculator.py, only ``from shifu import Step``) that RL learns to call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shifu.cli.main import main as cli_main
from shifu.tasks import arith_tool

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "envs"


def _read(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]


def test_arith_tool_data_calculator_and_demonstrations(tmp_path):
    files = arith_tool.prepare(tmp_path / "data", "tiny", seed=0)
    held_out, train = _read(files["prompts_eval"]), _read(files["prompts_train"])
    assert len(held_out) == 512 and not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
    a, b = held_out[0]["prompt"].rstrip("=").split("*")
    assert 100 <= int(a) <= 999 and 10 <= int(b) <= 99 and held_out[0]["answer"] == str(int(a) * int(b))
    sft = _read(files["sft_train"])
    calls = [r for r in sft if isinstance(r["response"], list)]
    assert 0.2 < len(calls) / len(sft) < 0.3  # a minority calls the calculator, the rest guess
    x, y = calls[0]["prompt"].rstrip("=").split("*")
    product = str(int(x) * int(y))
    # the calculator's output is read, not trained: the environment writes it, never the policy
    assert calls[0]["response"] == [
        {"text": f"[{x}*{y}]"},
        {"text": f"{{{product}}}", "train": False},
        {"text": product},
    ]
    from shifu.data.batches import encode_sft
    from shifu.data.rows import load_rows
    from shifu.models.loading import load_tokenizer

    tok = load_tokenizer(files["tokenizer"])
    (ex,), _ = encode_sft(tok, load_rows(files["sft_train"], "sft")[sft.index(calls[0]) :][:1], 16, 32)
    assert tok.decode(ex["response_ids"][:-1]) == f"[{x}*{y}]{{{product}}}{product}"
    assert ex["response_mask"] == [True] * len(f"[{x}*{y}]") + [False] * (len(product) + 2) + [True] * (
        len(product) + 1
    )
    for text in (calls[0]["prompt"] + tok.decode(ex["response_ids"][:-1]), "{error: bad expression}"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert arith_tool.calculator("347*29") == "10063" and arith_tool.calculator("(2+3)*4") == "20"
    for bad in ("347*", "2**3", "__import__('os')", "1//0", "99999999*99999999"):
        with pytest.raises(ValueError):
            arith_tool.calculator(bad)


@pytest.mark.slow
def test_a_third_party_calculator_plugs_into_the_quickstart_and_rl_learns_to_call_it(
    tmp_path, capsys, monkeypatch
):
    """The issue's bar: held-out accuracy (the environment's own count) at least +0.15 over the SFT policy with
    PPO, calculator use >= 0.8 after RL, the summary's gold equal to the environment's count, and no action
    that contains the prompt or an observation."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as `cd examples/envs` would
    out, log = tmp_path / "run", tmp_path / "env.jsonl"
    argv = [
        "quickstart",
        "--task",
        "arith_tool",
        "--out",
        str(out),
        "--seed",
        "0",
        "--set",
        "ppo.env.factory=calculator:Calculator",
        "--set",
        f"ppo.env.kwargs={{log: {log}}}",
    ]
    assert cli_main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gold_after"] >= s["gold_before"] + 0.15, s
    assert s["tool_use_after"] >= 0.8 > s["tool_use_before"], s
    # the environment's own view: the final evaluation ran the SFT policy's 512 episodes, then the final one's
    records = _read(log)
    starts = [r["episode"] for r in records if r["event"] == "reset"]
    returns: dict[int, float] = {}
    for r in records:
        returns[r["episode"]] = returns.get(r["episode"], 0.0) + r.get("reward", 0.0)
    n = s["eval_prompts"]
    assert sum(returns[e] for e in starts[-n:]) / n == pytest.approx(s["gold_after"])
    assert sum(returns[e] for e in starts[-2 * n : -n]) / n == pytest.approx(s["gold_before"])
    assert not any(r.get("leaked") for r in records)
    after = _read(out / "samples_after.jsonl")
    assert sum(r["gold"] for r in after) / n == pytest.approx(s["gold_after"])
    assert "\u27e6[" in after[0]["response"] and "tool use: before" in capsys.readouterr().err

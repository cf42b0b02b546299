"""Task ``arith_tool``: products a tiny policy cannot compute, and a calculator it can learn to call.

Prompts are ``"347*29="`` (3-digit times 2-digit). The policy may call the calculator by writing
``[347*29]`` (its turn ends at ``]``: ``ppo.env.stop: ["]"]``); the environment answers with the observation
``{10063}``, and the policy answers ``10063`` then EOS. Reward 1.0 for the exact answer, else 0; at most 3
turns. The environment is :func:`calculator_env`, a :class:`shifu.envs.tool.ToolEnv` over :func:`calculator`
in the ``bracket`` format.

SFT demonstrations mix the two ways to answer: a minority (``call_fraction``) call the calculator
(``[347*29]{10063}10063``, the calculator's ``{10063}`` a segment marked ``"train": false``: read, not
trained, as in an episode), the rest write the product directly, which a sub-million-parameter model can only
guess. Stopped early, the SFT policy calls sometimes and copies the result it reads; RL has to discover that
calling pays. The held-out gold is the exact-match accuracy of episodes through the environment.

An agent trained on this task (``ppo.agent``) offers its own tools in its own words: :func:`teacher` answers its
calls for the SFT start made of them (:mod:`shifu.rollout.teacher`), calling whichever offered tool computes.

Data (deterministic, like ``arith``): the operand pairs are shuffled with a fixed split seed into the held-out
prompts (``prompts_eval.jsonl``), the SFT held-out demonstrations (``sft_eval.jsonl``, also PPO's validation
prompts ``prompts_val.jsonl``) and the rest (SFT demonstrations sampled with the run seed, PPO prompts). Prompt
rows carry ``prompt`` and ``answer``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import random
import re
from pathlib import Path

from shifu.runs.jsonfile import write_jsonl
from shifu.tasks.common import data_paths, preset_of, read_presets, write_base

SPLIT_SEED = 4321  # fixed: the held-out set does not depend on the run seed
# digits and the call syntax, plus what a calculator error reads like ("{error: ZeroDivisionError: ...}")
ALPHABET = "0123456789+-*/=()[]{}:. " + "abcdefghijklmnopqrstuvwxyzDEZV"


@dataclasses.dataclass(frozen=True)
class ArithToolPreset:
    n_heldout: int
    n_sft_eval: int
    n_sft: int
    call_fraction: float  # share of SFT demonstrations that call the calculator
    n_layer: int
    n_embd: int
    n_head: int
    # "smollm2": SmolLM2-135M-Instruct (its own tokenizer) asked in chat turns, tools in the json format
    pretrained: str | None = None
    prompt_template: str = "{a}*{b}="


# the presets: shifu/presets/tasks/arith_tool.yaml, each checked against ArithToolPreset's fields
PRESETS: dict[str, ArithToolPreset] = read_presets("arith_tool", ArithToolPreset)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers joined by +, -, *, // or %, with parentheses, e.g. "347*29"
    """

    def value(node: ast.AST) -> int:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("bad expression")

    if len(expression) > 40:
        raise ValueError("too long")
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError("bad expression") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if len(str(result)) > 12:
        raise ValueError("too large")
    return str(result)


def exact_answer(row: dict, answer: str) -> float:
    """1.0 when the stripped answer equals the row's ``answer``, else 0.0."""
    return float(answer.strip() == str(row["answer"]))


# the system message of the chat (json) format: the call syntax in one line, shorter than ToolEnv's default
# (every tool's JSON schema), since each token of it is read in every turn of every episode
CHAT_SYSTEM = (
    'You have a calculator. To use it, write <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"12*34"}}</tool_call> and read its result. Answer with only the number.'
)


def calculator_env(format: str = "bracket", system: str | None = None, invalid_calls: str = "error"):
    """The task's environment: :func:`calculator` as a tool, :func:`exact_answer` as the final reward
    (``ppo.env.factory: shifu.tasks.arith_tool:calculator_env``). ``format="json"`` (chat models) describes
    the tool in the system message ``system`` (default :data:`CHAT_SYSTEM`) where the chat template does not
    render tools itself; ``invalid_calls`` as :class:`shifu.envs.tool.ToolEnv` takes it."""
    from shifu.envs.tool import ToolEnv

    if format == "json" and system is None:
        system = CHAT_SYSTEM
    return ToolEnv([calculator], exact_answer, format=format, system=system, invalid_calls=invalid_calls)


# what names a tool that computes, and the argument that takes the expression (read off the offered schemas)
_COMPUTES = ("calc", "comput", "arithm", "math", "evaluat", "expression", "multipl", "product")
_TAKES_EXPRESSION = ("expr", "formula", "equation", "input", "query", "calc", "math", "problem")
_PRODUCT = re.compile(r"(\d+)\s*[*x\u00d7]\s*(\d+)")


def _computing_tool(tools: list[dict]) -> tuple[str, str] | None:
    """``(name, argument)`` of the offered tool that computes an expression: the tool whose name or description
    says it computes (:data:`_COMPUTES`), and its string argument that takes the expression (by its name or
    description, or the only string argument); None when none does."""
    for tool in tools:
        fn = tool.get("function") or {}
        about = f"{fn.get('name', '')} {fn.get('description', '')}".lower()
        if not any(w in about for w in _COMPUTES):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        strings = [k for k, v in props.items() if isinstance(v, dict) and v.get("type", "string") == "string"]
        named = [
            k
            for k in strings
            if any(w in f"{k} {props[k].get('description', '')}".lower() for w in _TAKES_EXPRESSION)
        ]
        if named or len(strings) == 1:
            return fn["name"], (named or strings)[0]
    return None


def teacher(messages: list[dict], tools: list[dict] | None) -> dict:
    """The task's teacher (:mod:`shifu.rollout.teacher`): for the product the last user message asks, a call of
    the offered tool that computes (read off the tools' schemas: :func:`_computing_tool`) with ``"a*b"`` in the
    argument its schema names; once a tool has answered, the answer as the task wants it (the number alone, the
    tool's result when it is one); without such a tool, the product computed here."""
    asked = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "user"), "")
    found = _PRODUCT.findall(asked)
    if not found:
        return {"content": "I can only multiply two numbers.", "tool_calls": []}
    a, b = (int(x) for x in found[-1])
    last = messages[-1]
    if last["role"] == "tool" and (last.get("content") or "").strip().lstrip("-").isdigit():
        return {"content": last["content"].strip(), "tool_calls": []}
    tool = _computing_tool(tools or []) if last["role"] != "tool" else None
    if tool is None:
        return {"content": str(a * b), "tool_calls": []}
    name, argument = tool
    return {
        "content": None,
        "tool_calls": [{"function": {"name": name, "arguments": {argument: f"{a}*{b}"}}}],
    }


def make_splits(n_heldout: int, n_sft_eval: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint ``heldout`` / ``sft_eval`` / ``train`` pairs ``(a, b)``, 100 <= a <= 999, 10 <= b <= 99."""
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return {
        "heldout": pairs[:n_heldout],
        "sft_eval": pairs[n_heldout : n_heldout + n_sft_eval],
        "train": pairs[n_heldout + n_sft_eval :],
    }


def chat_demonstrations(row: dict, a: int, b: int, call: bool) -> list[dict]:
    """SFT rows (``messages``) of one chat demonstration: without a call, the product as the reply; with one,
    two rows, the call (``<tool_call>...</tool_call>``) and, after the tool's result, the product, the call
    marked ``"train": false`` there (it is trained in the first row). Each row trains its last message; the
    conversation is the environment's own (:func:`calculator_env`, json)."""
    env = calculator_env("json")
    start = [{"role": "system", "content": env.tools_system}, *env.reset(row)]  # as SmolLM2 reads the episode
    product = str(a * b)
    if not call:
        return [{"messages": [*start, {"role": "assistant", "content": product}]}]
    args = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    said = [*start, {"role": "assistant", "content": f"<tool_call>{args}</tool_call>"}]
    result = env.step(said[-1]["content"]).observation
    read = [*said[:-1], {**said[-1], "train": False}]
    return [{"messages": said}, {"messages": [*read, *result, {"role": "assistant", "content": product}]}]


def demonstration(a: int, b: int, call: bool) -> str | list[dict]:
    """An SFT response: the value alone, or when it calls the calculator the segments ``[a*b]``, the
    calculator's ``{value}`` (read, not trained: the environment writes it) and ``value``."""
    product = str(a * b)
    if not call:
        return product
    return [{"text": f"[{a}*{b}]"}, {"text": f"{{{product}}}", "train": False}, {"text": product}]


def build_tokenizer(out_dir: str | Path):
    """Character-level tokenizer over :data:`ALPHABET` (:func:`shifu.tasks.arith.build_tokenizer`)."""
    from shifu.tasks import arith

    return arith.build_tokenizer(out_dir, ALPHABET)


def prepare(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> dict[str, str]:
    """Write the data files, the tokenizer (``tokenizer/``) and the base model (``base/``: an untrained GPT-2,
    or for preset ``smollm2`` a link to the cached SmolLM2 conversion); returns name -> path for
    ``sft_train``, ``sft_eval``, ``prompts_train``, ``prompts_val``, ``prompts_eval``, ``tokenizer``, ``base``."""
    p = preset_of("arith_tool", PRESETS, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(p.n_heldout, p.n_sft_eval)
    rng = random.Random(seed)
    sft_pairs = rng.sample(splits["train"], p.n_sft)
    calls = [rng.random() < p.call_fraction for _ in sft_pairs]

    def prompt_row(a: int, b: int) -> dict:
        return {"prompt": p.prompt_template.format(a=a, b=b), "answer": str(a * b)}

    def sft_rows(a: int, b: int, call: bool) -> list[dict]:
        if p.pretrained:
            return chat_demonstrations(prompt_row(a, b), a, b, call)
        return [{"prompt": prompt_row(a, b)["prompt"], "response": demonstration(a, b, call)}]

    eval_calls = [random.Random(SPLIT_SEED + i).random() < p.call_fraction for i in range(p.n_sft_eval)]
    write_jsonl(
        out / "sft_train.jsonl", [r for (a, b), c in zip(sft_pairs, calls) for r in sft_rows(a, b, c)]
    )
    write_jsonl(
        out / "sft_eval.jsonl",
        [r for (a, b), c in zip(splits["sft_eval"], eval_calls) for r in sft_rows(a, b, c)],
    )
    write_jsonl(out / "prompts_train.jsonl", [prompt_row(a, b) for a, b in splits["train"]])
    write_jsonl(out / "prompts_eval.jsonl", [prompt_row(a, b) for a, b in splits["heldout"]])
    write_jsonl(out / "prompts_val.jsonl", [prompt_row(a, b) for a, b in splits["sft_eval"]])

    def untrained() -> tuple:
        from shifu.models.loading import build_tiny_gpt2

        tok = build_tokenizer(out / "tokenizer")
        # "347*29=" + "[347*29]{10063}10063" + EOS is 28 tokens: 48 positions leave room for a third turn
        model = build_tiny_gpt2(
            tok, n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head, n_positions=48, seed=seed
        )
        return tok, model

    write_base(out, p.pretrained, untrained)
    return data_paths(out, ["sft_train", "sft_eval", "prompts_train", "prompts_val", "prompts_eval"])

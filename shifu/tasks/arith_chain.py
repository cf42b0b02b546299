"""Task ``arith_chain``: a product then a sum, with a calculator of one operation per call.

Prompts are ``"347*29+512="`` (3-digit times 2-digit, plus 3-digit). The calculator (:func:`calculator`)
computes one operation per call and refuses more (``[347*29+512]`` reads ``{error: one operation per call}``),
so the answer takes two calls in sequence, the second on the first's result::

    347*29+512=[347*29]{10063}[10063+512]{10575}10575

(the policy's turns end at ``]``; the environment writes ``{...}``). Reward 1.0 for the exact final answer,
else 0 (:func:`shifu.tasks.arith_tool.exact_answer`); at most 4 turns. The reward counts the answer only, not
the calls that led to it: for a model that cannot multiply and add five-digit numbers the two calls are the
only way to the answer, and a reward that also checked the route would score how the policy works rather
than what it gets right (a model that adds correctly on its own would lose for it). The held-out gold is,
as for ``arith_tool``, the exact-match accuracy of episodes through the environment.

The pieces are ``arith_tool``'s: its calculator (behind the one-operation check), its reward, its tokenizer,
its operand split (each pair ``(a, b)`` given a third operand ``c`` drawn with the split seed) and its preset
fields. SFT demonstrations mix the full chain (a minority, ``call_fraction``: both calls, each result read, not
trained) with the answer written directly (a guess); RL has to find that the chain pays. The ``smollm2``
preset asks in chat turns and calls in the json format (:func:`chat_demonstrations`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
from pathlib import Path

from shifu.runs.jsonfile import write_jsonl
from shifu.tasks import arith_tool
from shifu.tasks.common import data_paths, preset_of, read_presets, write_base

CHAIN_SEED = arith_tool.SPLIT_SEED + 1  # fixed: the third operands do not depend on the run seed
ONE_OPERATION = "one operation per call"


@dataclasses.dataclass(frozen=True)
class ArithChainPreset(arith_tool.ArithToolPreset):
    """:class:`shifu.tasks.arith_tool.ArithToolPreset`'s fields; ``call_fraction`` is the share of SFT
    demonstrations that make the two calls, and the prompt names the third operand ``{c}``."""

    prompt_template: str = "{a}*{b}+{c}="


# the presets: shifu/presets/tasks/arith_chain.yaml, each checked against ArithChainPreset's fields
PRESETS: dict[str, ArithChainPreset] = read_presets("arith_chain", ArithChainPreset)


def _operand(node: ast.AST) -> bool:
    """Whether ``node`` is an integer literal, negative or not."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def calculator(expression: str) -> str:
    """Evaluate one integer operation.

    Args:
        expression: two integers joined by +, -, *, // or %, e.g. "347*29" (one operation per call)
    """
    try:
        body = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("bad expression") from None
    if isinstance(body, ast.BinOp) and not (_operand(body.left) and _operand(body.right)):
        raise ValueError(ONE_OPERATION)
    return arith_tool.calculator(expression)


# the system message of the chat (json) format: the call syntax, and that a call computes one operation
CHAT_SYSTEM = (
    'You have a calculator. To use it, write <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"12*34"}}</tool_call> and read its result. It computes one operation per call: use its result in the '
    "next call. Answer with only the number."
)


def chain_env(format: str = "bracket", system: str | None = None, invalid_calls: str = "error"):
    """The task's environment (``ppo.env.factory: shifu.tasks.arith_chain:chain_env``): the one-operation
    :func:`calculator` as the tool, :func:`shifu.tasks.arith_tool.exact_answer` as the final reward;
    ``format``, ``system`` (default :data:`CHAT_SYSTEM` in the json format) and ``invalid_calls`` as
    :class:`shifu.envs.tool.ToolEnv` takes them."""
    from shifu.envs.tool import ToolEnv

    if format == "json" and system is None:
        system = CHAT_SYSTEM
    reward = arith_tool.exact_answer
    return ToolEnv([calculator], reward, format=format, system=system, invalid_calls=invalid_calls)


def steps(a: int, b: int, c: int) -> list[str]:
    """The chain's calls in order: ``a*b``, then ``c`` added to its result."""
    return [f"{a}*{b}", f"{a * b}+{c}"]


def make_splits(n_heldout: int, n_sft_eval: int) -> dict[str, list[tuple[int, int, int]]]:
    """:func:`shifu.tasks.arith_tool.make_splits`'s disjoint ``heldout`` / ``sft_eval`` / ``train`` pairs,
    each given a third operand 100 <= c <= 999 drawn with :data:`CHAIN_SEED`, split after split."""
    rng = random.Random(CHAIN_SEED)
    pairs = arith_tool.make_splits(n_heldout, n_sft_eval)
    return {name: [(a, b, rng.randrange(100, 1000)) for a, b in split] for name, split in pairs.items()}


def demonstration(a: int, b: int, c: int, call: bool) -> str | list[dict]:
    """An SFT response: the value alone, or the two calls, each followed by the calculator's ``{result}``
    (read, not trained: the environment writes it), then the value."""
    value = str(a * b + c)
    if not call:
        return value
    segments = []
    for expression in steps(a, b, c):
        segments += [{"text": f"[{expression}]"}, {"text": f"{{{calculator(expression)}}}", "train": False}]
    return [*segments, {"text": value}]


def chat_demonstrations(row: dict, a: int, b: int, c: int, call: bool) -> list[dict]:
    """SFT rows (``messages``) of one chat demonstration, each training its last message: without calls, the
    value as the reply; with them, one row per turn (the first call, the second after the first's result, the
    value after the second's), the earlier calls marked ``"train": false`` (each is trained in its own row).
    The conversation is the environment's own (:func:`chain_env`, json)."""
    env = chain_env("json")
    said = [{"role": "system", "content": env.tools_system}, *env.reset(row)]  # as SmolLM2 reads the episode
    value = str(a * b + c)
    if not call:
        return [{"messages": [*said, {"role": "assistant", "content": value}]}]
    rows = []
    for expression in steps(a, b, c):
        args = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        turn = {"role": "assistant", "content": f"<tool_call>{args}</tool_call>"}
        rows.append({"messages": [*said, turn]})
        said += [{**turn, "train": False}, *env.step(turn["content"]).observation]
    return [*rows, {"messages": [*said, {"role": "assistant", "content": value}]}]


def prepare(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> dict[str, str]:
    """Write the data files, the tokenizer (``tokenizer/``, ``arith_tool``'s) and the base model (``base/``:
    an untrained GPT-2, or for preset ``smollm2`` a link to the cached SmolLM2 conversion); returns name ->
    path for ``sft_train``, ``sft_eval``, ``prompts_train``, ``prompts_val``, ``prompts_eval``,
    ``tokenizer``, ``base`` (the files as ``arith_tool`` writes them)."""
    p = preset_of("arith_chain", PRESETS, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(p.n_heldout, p.n_sft_eval)
    rng = random.Random(seed)
    sft_triples = rng.sample(splits["train"], p.n_sft)
    calls = [rng.random() < p.call_fraction for _ in sft_triples]
    eval_calls = [random.Random(CHAIN_SEED + i).random() < p.call_fraction for i in range(p.n_sft_eval)]

    def prompt_row(a: int, b: int, c: int) -> dict:
        return {"prompt": p.prompt_template.format(a=a, b=b, c=c), "answer": str(a * b + c)}

    def sft_rows(triples: list[tuple[int, int, int]], calls: list[bool]) -> list[dict]:
        if p.pretrained:
            return [
                r for t, call in zip(triples, calls) for r in chat_demonstrations(prompt_row(*t), *t, call)
            ]
        return [
            {"prompt": prompt_row(*t)["prompt"], "response": demonstration(*t, call)}
            for t, call in zip(triples, calls)
        ]

    write_jsonl(out / "sft_train.jsonl", sft_rows(sft_triples, calls))
    write_jsonl(out / "sft_eval.jsonl", sft_rows(splits["sft_eval"], eval_calls))
    write_jsonl(out / "prompts_train.jsonl", [prompt_row(*t) for t in splits["train"]])
    write_jsonl(out / "prompts_eval.jsonl", [prompt_row(*t) for t in splits["heldout"]])
    write_jsonl(out / "prompts_val.jsonl", [prompt_row(*t) for t in splits["sft_eval"]])

    def untrained() -> tuple:
        from shifu.models.loading import build_tiny_gpt2

        tok = arith_tool.build_tokenizer(out / "tokenizer")
        # "347*29+512=" + "[347*29]{10063}[10063+512]{10575}10575" + EOS is 50 tokens: 64 positions leave
        # room for a retry
        model = build_tiny_gpt2(
            tok, n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head, n_positions=64, seed=seed
        )
        return tok, model

    write_base(out, p.pretrained, untrained)
    return data_paths(out, ["sft_train", "sft_eval", "prompts_train", "prompts_val", "prompts_eval"])

"""An agent written only against the ``openai`` client: the ``arith_tool`` task ("What is 347*29?") with the
calculator offered as a ``tools=`` function. The agent executes the model's tool calls itself and sends each
result back as a ``tool`` message; its reward is 1.0 when the final answer is the exact product, else 0.

Train the policy behind it (docs/how-to/agents.md), e.g. the SmolLM2 quickstart through this agent instead of
the in-process environment::

    cd examples/agents && shifu quickstart --task arith_tool --preset smollm2 --set ppo.env.factory=null \\
        --set ppo.generation.stop=[] --set ppo.agent.factory=arith_tool_agent:solve \\
        --set ppo.data.max_prompt_len=256

(its first input, the system message with the tools and the question, is about 200 tokens).

Any OpenAI-compatible server runs it too (``base_url`` and ``api_key`` are all it takes).
"""

from __future__ import annotations

import ast
import json
import operator

MODEL = "policy"  # the name the shifu gateway serves the policy under
MAX_CALLS = 3
# the task's system message (the one the quickstart's SFT demonstrations were written with)
SYSTEM = (
    'You have a calculator. To use it, write <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"12*34"}}</tool_call> and read its result. Answer with only the number.'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an integer arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'integers joined by +, -, *, // or %, with parentheses, e.g. "347*29"',
                    }
                },
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def calculator(expression: str) -> str:
    """The tool: an integer expression's value (an error's text when it is not one)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("bad expression")

    try:
        if len(expression) > 40:
            raise ValueError("too long")
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def run_tool(call) -> str:
    """A tool call of the answer executed: the calculator on its ``expression`` argument."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if call.function.name != "calculator" or not isinstance(args, dict):
        return f"error: unknown tool {call.function.name!r}"
    return calculator(str(args.get("expression", "")))


async def solve(client, row: dict) -> float:
    """One episode: up to ``MAX_CALLS`` completions; every tool call answered with a ``tool`` message."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_CALLS):
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stop=["</tool_call>"]
        )
        message = response.choices[0].message
        if not message.tool_calls:  # an answer: the episode's reward
            return float((message.content or "").strip() == str(row["answer"]))
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump() for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return 0.0  # still calling tools after MAX_CALLS: no answer


def environment(format: str = "json"):
    """The same task as an in-process environment (``ppo.env.factory=arith_tool_agent:environment``) whose
    conversation starts with exactly what :func:`solve`'s first call renders through the gateway: the tools block
    written for a template without tools (SmolLM2's), then ``SYSTEM``, in the one order environments and the
    gateway share (:func:`shifu.models.tool_calls.with_tools_system`). A ``<tool_call>`` that
    does not parse ends the episode as an answer (reward 0), as it ends :func:`solve`, which gets such a turn
    back as text. The two ways of training then read the same first input and end the same episodes, and
    differ in who runs the loop (the trainer, or this agent over HTTP) and in the wording of a tool's errors."""
    from shifu.models.tool_calls import tools_system_message, with_tools_system
    from shifu.tasks.arith_tool import calculator_env

    system = with_tools_system([{"role": "system", "content": SYSTEM}], tools_system_message(TOOLS))[0][
        "content"
    ]
    return calculator_env(format, system=system, invalid_calls="answer")

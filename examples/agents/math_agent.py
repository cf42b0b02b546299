"""An agent written without the task's formats in mind: no system prompt, its own tool (``evaluate_math``, whose
argument is ``formula``), the question sent as it comes. It shares nothing with ``arith_tool``'s SFT
demonstrations (``calculator`` / ``expression`` under the task's system message), so the quickstart starts its
SFT from this agent's own calls, answered by the task's teacher (``shifu.tasks.arith_tool:teacher`` reads the
offered schema, docs/how-to/agents.md)::

    cd examples/agents && shifu quickstart --task arith_tool --preset smollm2 --set ppo.env.factory=null \\
        --set ppo.generation.stop=[] --set ppo.agent.factory=math_agent:solve --set ppo.data.max_prompt_len=256

Reward 1.0 when the last answer is the exact product, else 0.
"""

from __future__ import annotations

import json
import re

MODEL = "policy"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "evaluate_math",
            "description": "Evaluate a math formula of integers and return its value.",
            "parameters": {
                "type": "object",
                "properties": {"formula": {"type": "string", "description": "e.g. 12*34"}},
                "required": ["formula"],
            },
        },
    }
]


def evaluate_math(formula: str) -> str:
    """A product of two integers, the only formula this tool knows."""
    found = re.fullmatch(r"\s*(-?\d+)\s*\*\s*(-?\d+)\s*", formula)
    return str(int(found[1]) * int(found[2])) if found else "cannot evaluate that"


async def solve(client, row: dict) -> float:
    """Up to three calls; each ``evaluate_math`` call is answered with a ``tool`` message."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        response = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        if not message.tool_calls:
            return float((message.content or "").strip() == str(row["answer"]))
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump() for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            try:
                formula = json.loads(call.function.arguments or "{}").get("formula", "")
            except (json.JSONDecodeError, AttributeError):
                formula = ""
            known = call.function.name == "evaluate_math"
            result = evaluate_math(str(formula)) if known else f"no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0

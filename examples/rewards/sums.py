"""Reward functions for additions (``{"prompt": "37+48=", "answer": "85"}``, the rows of the built-in task
``arith``): a rule reward (one number per response) and a process reward (one reward per step of the response).

- ``exact_match``: 1.0 when the response, stripped, is the row's answer, else 0.0.
- ``digit_steps``: a step per character of the response, ``[[end, reward], ...]`` with ``end`` the offset just
  after the character: 1.0 when it is the answer's digit at that place, else 0.0, and a last step of -1.0 for a
  response longer than the answer. The trainer places each step's reward on the token that completes its
  character (docs/how-to/reward-functions.md, "Process rewards").

Train the quickstart's additions on either (from this folder; the built-in exact-match judge still measures the
held-out gain)::

    cd examples/rewards && shifu quickstart --task arith --set ppo.reward.function=sums:digit_steps

or name one in ``shifu ppo`` (``reward.function=sums:exact_match``), ``shifu sample --reward-function`` or
``shifu serve``.
"""

from __future__ import annotations


def exact_match(prompts: list[str], responses: list[str], rows: list[dict]) -> list[float]:
    return [float(response.strip() == row["answer"]) for response, row in zip(responses, rows)]


def digit_steps(
    prompts: list[str], responses: list[str], rows: list[dict]
) -> list[list[list[float]] | float]:
    out: list[list[list[float]] | float] = []
    for response, row in zip(responses, rows):
        answer = row["answer"]
        steps = [[i + 1, float(i < len(answer) and ch == answer[i])] for i, ch in enumerate(response)]
        if len(response) > len(answer):
            steps[-1][1] -= 1.0
        out.append(steps or 0.0)  # an empty response: one number, 0.0
    return out

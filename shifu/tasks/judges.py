"""Gold judges and rule-based rewards of the built-in tasks.

Every function here has the reward-function signature of the trainers
(``fn(prompts, responses, rows) -> list[float]``, one float per response), so it can be named in a
config as ``"shifu.tasks.judges:NAME"`` either as the PPO reward or as the held-out gold judge.

- :func:`exact_match` (task ``arith``): 1.0 when the stripped response equals the answer, else 0.0.
- :func:`final_number_match` (task ``arith``, preset ``smollm2``): the reply's last number equals the answer.
- :func:`digit_credit` (task ``arith``, optional shaped reward): fraction of answer digits right.
- :func:`vader_compound` (task ``imdb``): VADER compound sentiment of the response, in [-1, 1].

:func:`bradley_terry_labels` turns gold scores of two responses into noisy preferences,
``P(a preferred over b) = sigmoid((g_a - g_b) / tau)``: the simulated human of the ``imdb`` task.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

import numpy as np

_SUM = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")


def arith_answer(prompt: str) -> str:
    """The correct answer of an ``"a+b="`` prompt, as a decimal string."""
    m = _SUM.match(prompt)
    if m is None:
        raise ValueError(f"not an addition prompt of the form 'a+b=': {prompt!r}")
    return str(int(m.group(1)) + int(m.group(2)))


def _answers(prompts: list[str], rows: list[dict] | None) -> list[str]:
    """The row's ``answer`` field when present, else the answer parsed from the prompt."""
    rows = rows or [{}] * len(prompts)
    return [str(r["answer"]) if "answer" in r else arith_answer(p) for p, r in zip(prompts, rows)]


def exact_match(prompts: list[str], responses: list[str], rows: list[dict] | None = None) -> list[float]:
    """1.0 when ``response.strip()`` equals the answer exactly, else 0.0 (the ``arith`` gold and reward)."""
    return [float(r.strip() == a) for r, a in zip(responses, _answers(prompts, rows))]


_NUMBER = re.compile(r"-?\d+")


def final_number_match(
    prompts: list[str], responses: list[str], rows: list[dict] | None = None
) -> list[float]:
    """1.0 when the last integer in the response equals the answer exactly, else 0.0 (task ``arith`` asked
    in chat form: an instruct model replies ``"37 + 48 = 85."``; the final-answer exact match of maths
    benchmarks). A reply without a number scores 0."""
    out = []
    for r, a in zip(responses, _answers(prompts, rows)):
        numbers = _NUMBER.findall(r)
        out.append(float(bool(numbers) and numbers[-1] == a))
    return out


def digit_credit(prompts: list[str], responses: list[str], rows: list[dict] | None = None) -> list[float]:
    """Partial credit: fraction of the answer's digits matched position by position from the right,
    minus a penalty for surplus characters; 1.0 exactly when :func:`exact_match` is 1."""
    out = []
    for r, a in zip(responses, _answers(prompts, rows)):
        r = r.strip()
        right = sum(x == y for x, y in zip(reversed(r), reversed(a)))
        surplus = max(0, len(r) - len(a))
        out.append(max(0.0, (right - surplus) / len(a)))
    return out


@lru_cache(maxsize=1)
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_compound(prompts: list[str], responses: list[str], rows: list[dict] | None = None) -> list[float]:
    """VADER compound sentiment of each response alone (the prompt is not judged), in [-1, 1]."""
    analyzer = _vader()
    return [float(analyzer.polarity_scores(r)["compound"]) for r in responses]


def bradley_terry_labels(gold_a: np.ndarray, gold_b: np.ndarray, tau: float, seed: int) -> np.ndarray:
    """Noisy preferences: True where a is preferred, drawn with P(a > b) = sigmoid((g_a - g_b) / tau).

    ``tau`` -> 0 gives the judge's exact ordering (ties broken by a fair coin); larger ``tau`` means
    more label noise. Deterministic given ``seed``.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0 (got {tau})")
    diff = np.asarray(gold_a, dtype=np.float64) - np.asarray(gold_b, dtype=np.float64)
    if tau == 0:
        p = np.where(diff > 0, 1.0, np.where(diff < 0, 0.0, 0.5))
    else:
        p = 1.0 / (1.0 + np.exp(-diff / tau))
    u = np.random.default_rng(seed).random(diff.shape)
    return u < p


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))

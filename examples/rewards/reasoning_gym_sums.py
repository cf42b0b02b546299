"""A reward from reasoning-gym's own scorer (https://github.com/open-thought/reasoning-gym): 2-digit additions
(its ``basic_arithmetic`` dataset: "Calculate 32 + 15."), each response scored by the dataset's
``score_answer`` on the answer taken from the response.

**The answer taken**: the last ``<answer>...</answer>`` tag when the response has one (reasoning-gym's own
``extract_answer``), else the last integer in the response (``"32 + 15 = 47"`` -> ``"47"``), else nothing (0.0).
``score_answer`` gives 1.0 for the exact answer and partial credit when the answer is inside a longer one.

**The held-out split, by unique question**: reasoning-gym makes item ``i`` of seed ``s`` from
``Random(s + i)``, so the datasets of neighbouring seeds are the same items shifted by one, and one dataset
repeats questions too (sums of two numbers from 0 to 100 are ~10,000 questions). Drawing the training prompts
from seed 0 and the held-out ones from seed 1 would hold out nothing: :func:`split` draws one dataset, keeps
each question once, shuffles them and cuts, so that no held-out question is ever trained on.

Needs ``pip install reasoning-gym`` (the ``examples`` extra). Write the prompt files, then train and measure
(from this folder)::

    cd examples/rewards && python reasoning_gym_sums.py data --train 2000 --heldout 256
    shifu ppo --out runs/sums model.path=PATH/TO/POLICY data.train=data/train.jsonl data.eval=data/heldout.jsonl \\
        reward.function=reasoning_gym_sums:score eval.gold_function=reasoning_gym_sums:score \\
        advantage_estimator=grpo group_size=4

Rows: ``{"prompt": "Calculate 32 + 15. Put the final answer in <answer></answer> tags.", "answer": "47",
"question": ..., "metadata": ..., "dataset": "basic_arithmetic"}``: the fields ``score_answer`` reads, so that
another dataset (``split(dataset="chain_sum", options={...})``) scores through the same function.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
from pathlib import Path

import reasoning_gym
from reasoning_gym.utils import extract_answer

DATASET = "basic_arithmetic"
# two terms of at most two digits, only +, no parentheses or negative numbers
OPTIONS = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 2,
    "max_digits": 2,
    "operators": ("+",),
    "allow_parentheses": False,
    "allow_negation": False,
}
INSTRUCTION = " Put the final answer in <answer></answer> tags."


def answer_of(response: str) -> str | None:
    """The last ``<answer>`` tag's content, else the last integer of the response, else None."""
    tagged = extract_answer(response)
    if tagged is not None:
        return tagged
    numbers = re.findall(r"-?\d+", response)
    return numbers[-1] if numbers else None


@functools.cache
def _scorer(dataset: str):
    return reasoning_gym.get_score_answer_fn(dataset)


def score(prompts: list[str], responses: list[str], rows: list[dict]) -> list[float]:
    """The reward function (``reward.function=reasoning_gym_sums:score``): ``score_answer`` of each row's
    dataset on the answer taken from the response."""
    return [
        float(_scorer(row["dataset"])(answer_of(response), row)) for response, row in zip(responses, rows)
    ]


def split(
    n_train: int, n_heldout: int, seed: int = 0, dataset: str = DATASET, options: dict | None = None
) -> tuple[list[dict], list[dict]]:
    """``n_train`` training rows and ``n_heldout`` held-out rows of distinct questions (see the module
    docstring); ValueError when the dataset has fewer distinct questions than that."""
    wanted = n_train + n_heldout
    items = reasoning_gym.create_dataset(dataset, size=2 * wanted, seed=seed, **(options or OPTIONS))
    unique = list({item["question"]: item for item in items}.values())
    if len(unique) < wanted:
        raise ValueError(
            f"{dataset}: {len(unique)} distinct questions among {2 * wanted} items, fewer than the {wanted} "
            "asked for: ask for fewer rows, or widen the options"
        )
    random.Random(seed).shuffle(unique)
    rows = [
        {
            "prompt": item["question"] + INSTRUCTION,
            "answer": item["answer"],
            "question": item["question"],
            "metadata": item["metadata"],
            "dataset": dataset,
        }
        for item in unique[:wanted]
    ]
    return rows[n_heldout:], rows[:n_heldout]


def write_prompts(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0) -> dict[str, Path]:
    """``OUT/train.jsonl`` and ``OUT/heldout.jsonl`` (:func:`split`); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    for rows, path in zip(split(n_train, n_heldout, seed), paths.values()):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write reasoning-gym additions as shifu prompt files.")
    parser.add_argument("out_dir", help="the folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in write_prompts(args.out_dir, args.train, args.heldout, args.seed).items():
        print(f"{name}: {path}")

"""A reward function for the pipeline-lock tests: arith's exact match, which first waits until the file
named by ``SHIFU_TEST_GATE`` exists (no wait when it is unset). A quickstart given it as
``ppo.reward.function`` stays alive in its PPO stage until the test opens the gate, so a second process
started at any moment meets a live pipeline, however fast or slow the machine."""

from __future__ import annotations

import os
import time

from shifu.tasks.judges import exact_match


def exact_match_after_gate(prompts: list[str], responses: list[str], rows: list[dict]) -> list[float]:
    gate = os.environ.get("SHIFU_TEST_GATE")
    deadline = time.monotonic() + 900
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return exact_match(prompts, responses, rows)

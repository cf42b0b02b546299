"""map_forked: independent pieces of work side by side, one forked process and torch thread each, with the same
results as one after another on one thread; a part that fails or dies is named, never silently dropped."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from shifu.errors import ShifuError
from shifu.parallel.forked import map_forked

pytestmark = pytest.mark.integration  # forked processes


def _work(k: int, progress) -> list[float]:
    """Real torch work whose float rounding depends on the thread count: a seeded product of two matrices."""
    g = torch.Generator().manual_seed(k)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    progress(1)
    out = (a @ b).sum(dim=1)
    progress(1)
    return out.tolist()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def test_forked_results_equal_one_after_another_and_progress_arrives(threads):
    threads(1)
    alone = map_forked(_work, [0, 1, 2], "part")
    threads(3)  # a thread per part: forked
    seen = []
    forked = map_forked(_work, [0, 1, 2], "part", on_progress=seen.append)
    assert forked == alone
    assert sum(seen) == 6
    assert torch.get_num_threads() == 3  # the caller's thread count is left as it was


def _fails(k: int, progress):
    if k == 1:
        raise ValueError("part one cannot")
    return k


def _dies(k: int, progress):
    if k == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return k


def test_a_failing_part_is_named_with_its_traceback(threads):
    threads(2)
    with pytest.raises(ShifuError, match=r"(?s)sampling 2 of 2 failed in its process.*part one cannot"):
        map_forked(_fails, [0, 1], "sampling")


def test_a_killed_part_is_an_error_not_a_missing_result(threads):
    threads(2)
    with pytest.raises(ShifuError, match=r"part\(s\) 2: exit status -9 ended without a result"):
        map_forked(_dies, [0, 1], "sampling")


def test_preference_pairs_in_parts_are_the_same_at_any_thread_count(tiny_model_dir, tmp_path, threads):
    from shifu.tasks.imdb import make_preference_pairs

    prompts = [f"The movie number {i} was" for i in range(40)]
    files = {}
    for n in (1, 2):
        threads(n)
        out = tmp_path / f"threads{n}"
        info = make_preference_pairs(tiny_model_dir, prompts, out, 8, 0.1, seed=3, shards=2)
        files[n] = [
            (out / f).read_text() for f in ("pairs_train.jsonl", "pairs_eval.jsonl", "sft_samples.jsonl")
        ]
        assert info["pairs"] > 0
    assert files[1] == files[2]
    samples = [json.loads(line) for line in files[1][2].splitlines()]
    # both parts sampled: prompts of the first and of the second half have responses
    assert {s["prompt"] for s in samples} & {prompts[0], prompts[-1]} == {prompts[0], prompts[-1]}


def test_the_final_evaluation_is_the_same_at_any_thread_count(tiny_model_dir, tmp_path, threads):
    from shifu.evaluation.final import evaluate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Review {i}: the film was"}) + "\n" for i in range(24)))
    summaries, samples = {}, {}
    for n in (1, 2):
        threads(n)
        out = tmp_path / f"threads{n}"
        out.mkdir()
        ev = {"temperature": 1.0, "max_new_tokens": 8}
        summaries[n] = evaluate("imdb", tiny_model_dir, tiny_model_dir, str(prompts), ev, 5, out)
        samples[n] = [(out / f).read_text() for f in ("samples_before.jsonl", "samples_after.jsonl")]
    assert summaries[1] == summaries[2]
    assert samples[1] == samples[2]
    assert summaries[1]["gold_gain"] == 0.0  # the same policy twice, the same sampling seed

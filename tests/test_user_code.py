"""An exception inside a user's reward function or gold judge, in every command that calls one (sample, ppo,
quickstart, serve), run as a user runs them (the real CLI in a subprocess, the user's package in the working
directory): one line that names the function as the user named it and the user's file:line (the innermost
frame in the user's file, not the standard library's frame below it), exit 2, no traceback; ``--verbose``
prints the traceback. :func:`shifu.errors.user_code` is the piece every caller of user code uses."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ppo_task import build_char_model, write_prompts

from shifu.errors import UserCodeError, describe_exception, user_code, user_location

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
# the user's package: `score` fails on line 5, inside json.loads (the standard library's frames are below it)
REWARDS = """import json


def parse(text):
    return json.loads("{" + text)


def score(prompts, responses, rows):
    return [parse(r) for r in responses]


def fine(prompts, responses, rows):
    return [r.count("a") / max(1, len(r)) for r in responses]
"""
WHERE = f"({os.path.join('usertask', 'rewards.py')}:5): JSONDecodeError: "
TRACEBACK = "Traceback (most recent call last)"


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """The user's working directory: usertask/rewards.py, a tiny character model, prompts."""
    root = tmp_path_factory.mktemp("user")
    (root / "usertask").mkdir()
    (root / "usertask" / "__init__.py").write_text("")
    (root / "usertask" / "rewards.py").write_text(REWARDS)
    build_char_model(root / "model")
    write_prompts(root / "prompts.jsonl", n=32)
    return root


def env() -> dict[str, str]:
    out = os.environ | {"PYTHONPATH": str(ROOT), "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out.pop("SHIFU_VERBOSE", None)
    return out


def shifu(cwd: Path, *argv: str, verbose: bool = False) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "shifu", *argv, *(["--verbose"] if verbose else [])]
    done = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    return done.returncode, done.stderr


def check(code: int, err: str, cmd: str, name: str, verbose: bool) -> None:
    """Exit 2, one error line naming ``name`` and usertask/rewards.py:5; the traceback only with --verbose."""
    lines = [x for x in err.splitlines() if x.startswith(f"shifu {cmd}: error:")]
    assert code == 2 and len(lines) == 1, err
    assert f"{name} {WHERE}" in lines[0], lines[0]
    assert lines[0].endswith("(--verbose prints the traceback)") != verbose, lines[0]
    assert (TRACEBACK in err) == verbose, err
    if verbose:  # the user's frames, down to the standard library's
        assert 'rewards.py", line 5, in parse' in err and "json/decoder.py" in err, err


@pytest.mark.parametrize("verbose", [False, True])
def test_sample_names_the_reward_function_and_its_line(user_dir, verbose):
    code, err = shifu(
        user_dir,
        "sample",
        "model",
        "--prompt",
        "abc",
        "--max-new-tokens",
        "4",
        "--reward-function",
        "usertask.rewards:score",
        verbose=verbose,
    )
    check(code, err, "sample", "--reward-function usertask.rewards:score", verbose)


PPO = [
    "model.path=model",
    "data.train=prompts.jsonl",
    "critic.init=sft",
    "iterations=1",
    "batch_size=8",
    "minibatch_size=8",
    "generation.max_new_tokens=4",
    "eval.num_prompts=8",
    "progress=false",
    "tensorboard=false",
]


@pytest.mark.parametrize(
    ("keys", "name", "verbose"),
    [
        (["reward.function=usertask.rewards:score"], "reward.function usertask.rewards:score", False),
        (
            ["reward.function=usertask.rewards:fine", "eval.gold_function=usertask.rewards:score"],
            "eval.gold_function usertask.rewards:score",
            True,
        ),
    ],
)
def test_ppo_names_the_reward_function_or_gold_judge(user_dir, tmp_path, keys, name, verbose):
    code, err = shifu(user_dir, "ppo", "--out", str(tmp_path / "run"), *PPO, *keys, verbose=verbose)
    check(code, err, "ppo", name, verbose)


def test_quickstart_names_the_plans_gold_judge_with_its_stage(user_dir, tmp_path):
    """The PPO stage of a quickstart plan: the key as the plan spells it (ppo.eval.gold_function)."""
    sets = ["ppo.eval.gold_function=usertask.rewards:score", "sft.max_steps=2", "sft.batch_size=8"]
    sets += ["ppo.iterations=1", "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.eval.num_prompts=8"]
    argv = ["quickstart", "--task", "arith", "--preset", "tiny", "--out", str(tmp_path / "qs")]
    code, err = shifu(user_dir, *argv, *(x for s in sets for x in ("--set", s)))
    check(code, err, "quickstart", "ppo.eval.gold_function usertask.rewards:score", False)


@pytest.mark.parametrize("verbose", [False, True])
def test_serve_answers_500_naming_the_function_and_logs_it(user_dir, tmp_path, verbose):
    pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
    cmd = [sys.executable, "-m", "shifu", "serve", "usertask.rewards:score", "--port", "0"]
    cmd += ["--verbose"] if verbose else []
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=user_dir, env=env(), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, (line, log.read_text())
        url = line.split(" on ")[1].split()[0]
        body = json.dumps({"prompts": ["a", "b"], "responses": ["x", "y"]}).encode()
        request = urllib.request.Request(f"{url}/v1/score", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=60)
        assert e.value.code == 500
        message = json.loads(e.value.read())["error"]["message"]
        assert message.startswith(f"reward function usertask.rewards:score {WHERE}"), message
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    err = log.read_text()
    assert f"shifu serve: request failed: {message}" in err, err  # the server's console says it too
    assert (TRACEBACK in err) == verbose, err


def test_the_users_frame_is_the_innermost_outside_libraries_and_shifu(tmp_path, monkeypatch):
    """user_code in process: the innermost frame in the user's files, relative to the working directory; a
    ShifuError passes as it is; without any frame of the user's (a library's function), no location."""
    (tmp_path / "helpers.py").write_text("import json\n\n\ndef judge(x):\n    return json.loads(x)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import helpers

    with pytest.raises(UserCodeError, match=r"^gold judge helpers:judge \(helpers.py:5\): JSONDecodeError: "):
        with user_code("gold judge helpers:judge"):
            helpers.judge("{")
    with pytest.raises(UserCodeError) as e:
        with user_code("x"):
            line = inspect.currentframe().f_lineno + 1
            json.loads("{")  # called from this test file: the test is the user here
    assert user_location(e.value.__cause__) == f"{__file__}:{line}"  # (outside the working directory)
    try:
        json.loads("[")
    except ValueError as err:
        err.__traceback__ = err.__traceback__.tb_next  # only the standard library's frames are left
        last = err.__traceback__
        while last.tb_next is not None:
            last = last.tb_next
        assert describe_exception("f", err) == (
            f"f ({last.tb_frame.f_code.co_filename}:{last.tb_lineno}): JSONDecodeError: {err}"
        )
    with pytest.raises(UserCodeError, match=r"test_user_code.py:\d+\): RuntimeError: first line \.\.\.$"):
        with user_code("f"):
            raise RuntimeError("first line\nsecond line")

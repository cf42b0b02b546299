"""The smallest agent shifu trains: two calls through the ``openai`` client and a reward on the second call,
set over the session's HTTP API (``POST /rl/set_reward``); nothing imported from shifu.

The task is the one of shifu's tests (a tiny character model over the letters a..l): the policy answers the
prompt, reads back ``k`` and the first two letters of its answer, and answers again; that second answer's reward
is its fraction of ``a``. ``tests/test_agent.py`` trains it with PPO and a critic::

    shifu ppo ... agent.factory=echo_agent:solve   # run where echo_agent.py is, or with it on PYTHONPATH
"""

from __future__ import annotations

import httpx

MODEL = "policy"  # the name the shifu gateway serves the policy under
STOP = ["i", "j", "k", "l"]  # a turn ends at the first of these letters (OpenAI allows 4 stop strings)


async def set_call_reward(client, call_id: str, reward: float) -> None:
    """``POST /rl/set_reward`` on the gateway the client talks to, with the session key the client holds."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    body = {"reward": reward, "call": call_id}
    await client.post(f"{root}/rl/set_reward", body=body, cast_to=httpx.Response)


async def solve(client, row: dict) -> None:
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, stop=STOP)
    said = first.choices[0].message.content or ""
    echo = "k" + "".join(c for c in said if c.isalpha())[:2]
    messages += [{"role": "assistant", "content": said}, {"role": "user", "content": echo}]
    second = await client.chat.completions.create(model=MODEL, messages=messages, stop=STOP)
    letters = [c for c in second.choices[0].message.content or "" if c.isalpha()]
    await set_call_reward(client, second.id, letters.count("a") / max(1, len(letters)))
    return None  # the reward is on the second call

"""A third-party agent framework from PyPI, the OpenAI Agents SDK (``openai-agents``), trained through the policy
gateway: an ``Agent`` with a function tool on ``OpenAIChatCompletionsModel`` (an ``AsyncOpenAI`` client pointed
at the gateway) completes its episodes, every call is captured, the tool's result is read and never trained, and
``shifu ppo`` trains on the episodes. Offline: the SDK's tracing is off.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.integration
pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
sdk = pytest.importorskip("agents", reason="pip install 'shifu-rlhf[agents]' (openai-agents)")

from test_agent import batch_of  # noqa: E402
from test_gateway import chat_tokenizer, tiny_policy  # noqa: E402

from shifu.generation.rollout import SamplingParams  # noqa: E402
from shifu.rollout.agent import AgentEpisodes  # noqa: E402
from shifu.rollout.episodes import EpisodeLimits  # noqa: E402
from shifu.rollout.sources import Policy  # noqa: E402

sdk.set_tracing_disabled(True)  # (the SDK would otherwise export traces to OpenAI)
QUESTION = "what is two plus three?"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
RESULT = "5"


@sdk.function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


async def solve(client, row: dict) -> float:
    """An Agents SDK agent on the client shifu hands it: 1.0 when its final answer says 5."""
    model = sdk.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = sdk.Agent(name="adder", instructions="Add numbers with the add tool.", model=model, tools=[add])
    result = await sdk.Runner.run(agent, row["prompt"], max_turns=4)
    return float(RESULT in str(result.final_output))


def collect(model, tok, n: int, temperature: float = 0.7):
    source = AgentEpisodes(solve, "test_agents_sdk:solve", EpisodeLimits(4, 96, 512), concurrency=4)
    rows = [{"prompt": QUESTION} for _ in range(n)]
    policy = Policy(model, tok, with_log_probs=True)
    return source.collect(
        policy, batch_of(rows), SamplingParams(96, temperature), torch.Generator().manual_seed(0)
    )


def calling_policy(tok, prompt: list[int]):
    """A tiny GPT-2 trained to answer the SDK's first prompt ``prompt`` with the Hermes call of ``add``."""
    import torch.nn.functional as F

    target = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    model = tiny_policy(tok, positions=1024).train()
    ids = torch.tensor([prompt + target])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = F.cross_entropy(model(ids).logits[0, len(prompt) - 1 : -1], ids[0, len(prompt) :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.slow
def test_an_agents_sdk_agent_completes_and_trains_episodes_through_the_gateway(tmp_path):
    tok = chat_tokenizer()
    # the SDK's first prompt as the gateway rendered it (instructions, the tool offered, the question)
    first = collect(tiny_policy(tok, positions=1024), tok, 1)
    prompt = first.prompt_ids[0][first.prompt_mask[0].bool()].tolist()
    assert "add" in tok.decode(prompt) and QUESTION in tok.decode(prompt)
    model = calling_policy(tok, prompt)
    t = collect(model, tok, 6)
    m = t.metrics
    assert m["agent/errors"] == 0 and m["agent/forks"] == 0  # every episode completed, every call joined
    assert (
        m["agent/tool_use"] >= 0.5 and m["agent/calls"] == m["agent/turns"]
    )  # called add; every call joined
    for i in range(len(t)):
        if t.counts["tool_calls"][i]:  # the tool's result was read between the calls, never trained
            read = t.ids[i][t.attention[i] & ~t.trainable[i]]
            assert f"\n{RESULT}" in tok.decode(read) and t.counts["turns"][i] >= 2  # then answered
            assert CALL in tok.decode(t.ids[i][t.trainable[i]])
    # and shifu ppo trains on its episodes (GAE, a critic)
    from shifu.cli import main as cli

    policy_dir, prompts = tmp_path / "policy", tmp_path / "prompts.jsonl"
    model.save_pretrained(str(policy_dir))
    tok.save_pretrained(str(policy_dir))
    prompts.write_text("".join(json.dumps({"prompt": QUESTION}) + "\n" for _ in range(16)))
    out = tmp_path / "run"
    argv = ["ppo", "--out", str(out), f"model.path={policy_dir}", f"data.train={prompts}"]
    argv += ["agent.factory=test_agents_sdk:solve", "generation.max_new_tokens=96", "data.max_prompt_len=600"]
    argv += ["generation.max_total_tokens=512", "iterations=2", "batch_size=8", "minibatch_size=4"]
    argv += ["eval.every=0", "eval.num_prompts=4", "critic.init=sft", "progress=false", "tensorboard=false"]
    assert cli.main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "agent/calls" in r]
    assert len(train) == 2 and all(r["agent/errors"] == 0 and r["agent/tool_calls"] > 0 for r in train)
    assert all(r["rollout/rows"] == 8 and abs(r["loss/policy"]) < 1e3 for r in train)

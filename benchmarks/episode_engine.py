"""The episode source's schedules on one workload: ``lockstep`` (one sampler call per turn over the episodes
still running, ``generation.kv_budget_mb=0``) against one running decode (``admit``: each episode's next turn
joins the decode as its environment answers; ``lag`` steps between a turn's end and the step before which its
environment's answer is applied, :data:`shifu.rollout.episodes.STEP_LAG` by default).

The workload is a quickstart run of a task with an environment (``--run``): its SFT policy, the first
``--episodes`` of its held-out prompts, its environment and its generation settings, sampled at T = 1 from a
generator seeded 0; ``--policy`` (a model directory), ``--plan`` (a quickstart preset or a run's
``ppo/config.yaml``: its ``ppo`` stage's environment, generation and data settings) and ``--prompts`` replace
the run's. ``--sleep-ms``: every environment step also sleeps that long (a search, a code runner, a
remote judge). Each schedule rolls the same episodes out ``--repeats`` times, in turn, after one warm-up
rollout; per schedule: the least rollout time, the tokens sampled and the turns taken (the same in every
repeat: each schedule is reproducible), sampled tokens per second and the time against lockstep's. The
schedules draw their randomness differently, so their episodes differ: tokens per second is the comparable
figure, and the held-out gain of a whole run is measured by the quickstart benchmarks.

    python benchmarks/episode_engine.py --run RUN [--sleep-ms 200] [--record]
    python benchmarks/episode_engine.py --run RUN --lags 0,1,2,4 --record
    # SmolLM2 on arith_tool's environment, the prompts of a tiny arith_tool run
    python benchmarks/episode_engine.py --run RUN --plan shifu/presets/quickstart/arith_tool-smollm2.yaml \
        --policy ~/.cache/.../smollm2 --record
    # the same with the plan's LoRA adapters on the policy (as its PPO stage trains it), against lockstep turns
    # decoded through the HF forward of the peft model (schedule lockstep-hf)
    python benchmarks/episode_engine.py ... --lora --record

``--lora``: the policy wrapped with the plan's ``lora`` adapters, their B matrices drawn small and non-zero (an
adapter some updates into training), and a third schedule, ``lockstep-hf``: lockstep turns through peft's HF
forward, the way a LoRA actor decoded before shifu's decoders merged adapters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import provenance  # noqa: E402  (benchmarks/provenance.py: this script's own folder is on sys.path)
import torch  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Slowed:
    """An environment whose every step sleeps ``sleep_ms`` milliseconds, then answers as ``factory``'s does."""

    def __init__(self, factory: str, sleep_ms: float = 0.0, **kwargs):
        from shifu.config.imports import load_callable

        self._env, self._sleep_s = (
            load_callable(factory, "env.kwargs.factory", "environment")(**kwargs),
            sleep_ms / 1000,
        )

    def step(self, action: str):
        time.sleep(self._sleep_s)
        return self._env.step(action)

    def __getattr__(self, name: str):
        return getattr(self._env, name)


def rollout(model, tok, source, rows: list[dict], params, engine: str = "auto") -> tuple[float, int, int]:
    """Seconds of one rollout of ``rows``, the tokens sampled and the turns taken (``engine``: the sampler's)."""
    from shifu.rollout.batch import PromptBatch
    from shifu.rollout.sources import Policy

    n = len(rows)
    batch = PromptBatch(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), rows)
    t0 = time.perf_counter()
    policy = Policy(model, tok, True, sample_kwargs={} if engine == "auto" else {"engine": engine})
    made = source.collect(policy, batch, params, torch.Generator().manual_seed(0))
    return time.perf_counter() - t0, int(made.trainable.sum()), sum(made.counts["turns"])


def workload(args: argparse.Namespace) -> tuple[dict, str, list[dict], Path]:
    """The plan's ``ppo`` stage with its environment slowed by ``--sleep-ms``, the environment's factory, the
    prompts' rows, the policy's directory."""
    run = Path(args.run)
    plan = yaml.safe_load(Path(args.plan or run / "ppo" / "config.yaml").read_text())
    plan = plan.get("ppo", plan)  # (a quickstart preset: its ppo stage)
    env = plan.get("env") or {}
    if not env.get("factory"):
        raise SystemExit(f"{args.plan or run}: not a plan with an environment (env.factory)")
    plan["env"] = env | {
        "factory": "episode_engine:Slowed",
        "kwargs": {"factory": env["factory"], "sleep_ms": args.sleep_ms, **(env.get("kwargs") or {})},
    }
    prompts = Path(args.prompts or run / "data" / "prompts_eval.jsonl")
    rows = [json.loads(line) for line in prompts.read_text().splitlines()][: args.episodes]
    return plan, env["factory"], rows, Path(args.policy or run / "sft" / "final")


def sources(plan: dict, lags: list[int], hf: bool = False) -> list[tuple[str, int | None, object, str]]:
    """``(schedule, lag, episode source, sampler engine)``: lockstep (``hf``: also lockstep through the HF
    forward), then the running decode at each lag."""
    from shifu.config.imports import key_prefix
    from shifu.config.loader import from_dict
    from shifu.config.sources import GenerationConfig
    from shifu.rollout.build import episodes_source, plan_section

    schedules = [("lockstep", None, "auto"), *([("lockstep-hf", None, "hf")] if hf else [])]
    schedules += [("admit", lag, "auto") for lag in lags]
    out = []
    for name, lag, engine in schedules:
        kv = {"kv_budget_mb": 0} if lag is None else {}
        with key_prefix("ppo."):
            generation = from_dict(GenerationConfig, plan["generation"] | kv)
            chat = plan.get("data", {}).get("chat_template", True)
            source = episodes_source(plan_section(plan), generation, chat)
        if lag is not None:
            source.step_lag = lag
        out.append((name, lag, source, engine))
    return out


def with_lora(model, plan: dict):
    """``model`` with the plan's LoRA adapters, B drawn from N(0, 0.02^2) (seeded): a policy some updates in."""
    from shifu.config.sections import LoraConfig
    from shifu.models import lora

    adapted = lora.wrap_lora(model, LoraConfig(**(plan.get("lora") or {}) | {"enabled": True})).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return adapted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a quickstart run of a task with an environment")
    ap.add_argument("--plan", default=None, help="default: RUN/ppo/config.yaml")
    ap.add_argument("--policy", default=None, help="default: RUN/sft/final")
    ap.add_argument("--prompts", default=None, help="default: RUN/data/prompts_eval.jsonl")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    ap.add_argument("--lags", default=None, help="comma-separated; default: shifu's STEP_LAG")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora", action="store_true", help="the plan's LoRA adapters on the policy (docstring)")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from shifu.evaluation.compare import load_policy
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.episodes import STEP_LAG

    plan, factory, rows, policy = workload(args)
    model, tok = load_policy(policy)
    if args.lora:
        model = with_lora(model, plan)
    params = SamplingParams(plan["generation"]["max_new_tokens"], 1.0)
    lags = [STEP_LAG] if args.lags is None else [int(x) for x in args.lags.split(",")]
    schedules = sources(plan, lags, hf=args.lora)
    rollout(model, tok, schedules[0][2], rows, params)  # warm-up: allocations, imports
    times: dict[tuple[str, int | None], list[float]] = {}
    counts: dict[tuple[str, int | None], tuple[int, int]] = {}
    for _ in range(args.repeats):
        for name, lag, source, engine in schedules:
            seconds, tokens, turns = rollout(model, tok, source, rows, params, engine)
            times.setdefault((name, lag), []).append(seconds)
            counts[name, lag] = (tokens, turns)
    base = min(times["lockstep", None])
    for name, lag, _, _ in schedules:
        best, (tokens, turns) = min(times[name, lag]), counts[name, lag]
        metrics = {
            "rollout_s": round(best, 3),
            "rollout_s_all": [round(t, 3) for t in times[name, lag]],
            "sampled_tokens": tokens,
            "turns": turns,
            "tokens_per_s": round(tokens / best, 1),
            "time_vs_lockstep": round(best / base, 3),
        }
        print(json.dumps({"schedule": name, "lag": lag, **metrics}), flush=True)
        params_rec = {
            "run": Path(args.run).name,
            "plan": Path(args.plan).name if args.plan else "ppo/config.yaml",
            "policy": policy.name if args.policy else "sft/final",
            "env": factory,
            "episodes": len(rows),
            "sleep_ms": args.sleep_ms,
            "schedule": name,
            "lag": lag,
            **({"lora": True} if args.lora else {}),
        }
        provenance.record(args, "episode_engine", metrics, params=params_rec, threads=args.threads)


if __name__ == "__main__":
    main()

"""Episodes under torchrun, launched by ``tests/test_distributed_trainers.py``::

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/check_episodes.py --out DIR

Same protocol as ``check_dist.py`` (``DIR/rank<r>.json``, one entry per check, every check in one launch).

``episodes_<strategy>_equals_single``: a rollout of 8 multi-turn episodes (the scripted environment, greedy
sampling) made by one process with all 8 prompts, and by the distributed strategy's models on 2 ranks, each with
its share: rank 0's episodes end after one turn, rank 1's run three, so rank 0 keeps sampling stand-in rows in step
(sharded forwards are collectives). Every rank's episodes equal the one-process episodes of the same prompts
(ids, masks, rewards; log-probs to float tolerance), and one PPO update on them agrees with the one-process
update on the whole batch to the tolerance of ``check_ppo.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import check_dist as C  # noqa: E402
import ppo_task  # noqa: E402
from check_ppo import models_for  # noqa: E402

from shifu.config.loader import load_config  # noqa: E402
from shifu.config.schema import PPOConfig as Config  # noqa: E402
from shifu.generation.rollout import SamplingParams  # noqa: E402
from shifu.parallel import distributed as D  # noqa: E402
from shifu.trainers import ppo, ppo_rollout  # noqa: E402

B = 8
# prompt i goes to rank i % 2 (strategy.share): the even ones end after one turn, the odd ones after three
PROMPTS = ["ab", "cdk", "efg", "hij", "klab", "cd", "ef", "ghij"]


def make_cfg(out: Path, model: Path, *extra: str) -> Config:
    kwargs = {"rewards": [0.5, 1.0, 2.0], "done_after": 3, "done_after_for": {p: 1 for p in PROMPTS[::2]}}
    base = [
        f"out_dir={out}",
        f"model.path={model}",
        f"data.train={out / 'p.jsonl'}",
        "env.factory=scripted_envs:Scripted",
        f"env.kwargs={json.dumps(kwargs)}",
        "env.step_timeout_s=null",
        "generation.stop=[a,b,c,d,e,f,g,h,i,j,k,l]",
        "generation.max_new_tokens=4",
        "generation.max_turns=3",
        "generation.max_total_tokens=24",
        "data.chat_template=false",
        "critic.init=sft",
        f"batch_size={B}",
        f"minibatch_size={B}",
        "ppo_epochs=1",
        "micro_batch_size=8",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
    ]
    return load_config(Config, overrides=base + list(extra))


def rollout_of(m, s, cfg: Config, indices: list[int]):
    tok = m.tokenizer
    rows = [{"prompt": p} for p in PROMPTS]
    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    batch = ppo_rollout.prompt_batch(indices, m.strategy, 1, ids, rows, tok.pad_token_id)
    greedy = SamplingParams(cfg.generation.max_new_tokens, 1.0, greedy=True)
    return ppo_rollout.collect_rollout(m, cfg, batch, greedy, s.sample_gen)


def real(rollout, i: int) -> tuple[list[int], list[bool], list[float]]:
    """Row i's real ids (first input and the rest), its trained flags and its token rewards, without padding."""
    am = rollout.attention_mask[i].bool()
    P = rollout.prompt_len
    rest = am[P:]
    return (
        rollout.input_ids[i][am].tolist(),
        rollout.response_mask[i][rest].tolist(),
        (
            rollout.token_rewards[i][rest]
            if rollout.token_rewards is not None
            else torch.zeros(int(rest.sum()))
        ).tolist(),
    )


def check_equals_single(out: Path, model: Path, strategy: str) -> str:
    cfg_single, cfg_dist = make_cfg(out, model), make_cfg(out, model, f"distributed.strategy={strategy}")
    single, s_single = models_for(cfg_single, model, world_one=True)
    everything, _ = rollout_of(single, s_single, cfg_single, list(range(B)))
    dist, s_dist = models_for(cfg_dist, model)
    mine, info = rollout_of(dist, s_dist, cfg_dist, list(range(B)))
    rank, W = D.rank(), D.world_size()
    turns = [int(x) for x in D.gather_object(sum(info.get("env/turns", 0.0) for _ in [0]) * len(mine))]
    for j, i in enumerate(range(rank, B, W)):  # this rank's prompts, in the single batch's order
        a, b = real(mine, j), real(everything, i)
        assert a[0] == b[0], f"episode of {PROMPTS[i]!r}: ids {a[0]} vs one process {b[0]}"
        assert a[1] == b[1] and a[2] == b[2], f"episode of {PROMPTS[i]!r}: masks or rewards differ"
        assert mine.scores[j] == everything.scores[i]
        lp_a = mine.old_log_probs[j][mine.response_mask[j]]
        lp_b = everything.old_log_probs[i][everything.response_mask[i]]
        torch.testing.assert_close(lp_a.cpu(), lp_b.cpu(), atol=1e-5, rtol=0)
    base_actor = C.params(single.actor)
    ppo.learn(single, s_single, cfg_single, everything)
    ppo.learn(dist, s_dist, cfg_dist, mine)
    err = C.rel_diff(C.params(dist.actor), C.params(single.actor), base_actor)
    assert err < 1e-3, f"{strategy} PPO update on episodes differs from 1 process: {err:.2e}"
    return f"turns per rank {turns} (rank 0 idles in step); episodes identical; rel. diff actor {err:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("SHIFU_THREADS", "1")))
    D.init(timeout_s=float(os.environ.get("SHIFU_DIST_TIMEOUT", "120")))
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    if D.is_main():
        ppo_task.build_char_model(model)
    D.barrier()
    for strategy in ("ddp", "fsdp2"):
        C.run_check(
            args.out,
            f"episodes_{strategy}_equals_single",
            lambda s=strategy: check_equals_single(args.out, model, s),
        )
    D.barrier()
    D.destroy()


if __name__ == "__main__":
    main()

"""Golden outputs for a refactor: short runs of every stage, then a bit-for-bit comparison of two trees' runs.

Record before a refactor, record again after, compare (CPU, one thread; a few minutes per record):

    python benchmarks/golden.py record runs/golden-before     # on the parent commit's checkout
    python benchmarks/golden.py record runs/golden-after      # on the refactored tree
    python benchmarks/golden.py compare runs/golden-before runs/golden-after

``record`` builds a tiny GPT-2 with a BPE tokenizer and small JSONL files (fixed seeds), then runs ``shifu sft``
(12 steps, evaluations and a checkpoint), ``shifu rm`` and ``shifu dpo`` (10 steps) from the SFT model, and
six ``shifu ppo`` variants of 4 iterations from it: (a) shared-trunk critic, adaptive KL, score
normalisation, ptx; (b) a critic from the reward model, fixed KL, score clipping, missing-EOS penalty,
``grad_accum=2``; (c) ``algo=reinforce``; (d) ``algo=ppo_penalty``; (e) GRPO with a k3 KL loss; (f) REINFORCE++
on dense rewards with GSPO's sequence-level ratio; then ``shifu quickstart`` of arith and arith_tool (episodes with an
environment) shortened to 4 PPO iterations, and GRPO on arith_tool's episodes. ``compare`` checks every
``metrics.jsonl`` value (``time/`` and ``perf/`` keys excluded), every tensor of ``final/``, ``best/`` and
``critic/`` ``samples.jsonl`` and a quickstart's ``samples_before/after.jsonl``; keys only one side has are listed, not failed (a refactor may add
metrics). Exit status 1 on any difference.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORED = ("time/", "perf/")
WORDS = "the movie was great and good film bad boring terrible plot story cat dog hello answer".split()


def _inputs(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_tokenizer, write_jsonl

    from shifu.models.loading import build_tiny_gpt2, load_tokenizer

    d = out / "inputs"
    tok = build_tiny_tokenizer(False)
    tok.save_pretrained(str(d / "model"))
    tok = load_tokenizer(d / "model")
    build_tiny_gpt2(tok, n_layer=2, n_embd=64, n_head=2, n_positions=256, seed=0).save_pretrained(
        str(d / "model")
    )
    rng = random.Random(0)

    def phrase(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    write_jsonl(
        d / "sft.jsonl", [{"prompt": phrase(4) + ":", "response": " " + phrase(5)} for _ in range(96)]
    )
    write_jsonl(
        d / "pairs.jsonl",
        [
            {
                "prompt": phrase(4) + ":",
                "chosen": " great good " + phrase(3),
                "rejected": " bad boring " + phrase(3),
            }
            for _ in range(96)
        ],
    )
    write_jsonl(d / "prompts.jsonl", [{"prompt": phrase(4) + ":"} for _ in range(96)])
    return d


def _shifu(*args: str) -> None:
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "shifu", *args], check=True, env=env, cwd=ROOT)


def record(out: Path) -> None:
    d = _inputs(out)
    quiet = ["seed=0", "progress=false", "tensorboard=false"]
    loop = ["batch_size=8", "log_every=2", "eval.batch_size=16"]
    _shifu(
        "sft",
        "--out",
        str(out / "sft"),
        f"model.path={d / 'model'}",
        f"data.train={d / 'sft.jsonl'}",
        "max_steps=12",
        "eval.every=4",
        "save_every=6",
        *loop,
        *quiet,
    )
    sft = out / "sft" / "final"
    for cmd in ("rm", "dpo"):
        _shifu(
            cmd,
            "--out",
            str(out / cmd),
            f"model.path={sft}",
            f"data.train={d / 'pairs.jsonl'}",
            "max_steps=10",
            "eval.every=5",
            *loop,
            *quiet,
        )
    ppo = [
        f"model.path={sft}",
        f"reward.model_path={out / 'rm' / 'final'}",
        f"data.train={d / 'prompts.jsonl'}",
        "iterations=4",
        "batch_size=8",
        "minibatch_size=4",
        "ppo_epochs=2",
        "generation.max_new_tokens=8",
        "eval.every=2",
        "eval.num_prompts=8",
        "save_every=2",
        *quiet,
    ]
    variants = {
        "ppo_a": [
            "critic.init=shared",
            "kl.controller=adaptive",
            "kl.target=1.0",
            "reward.normalize=true",
            "ptx_coef=0.2",
            f"data.ptx={d / 'sft.jsonl'}",
        ],
        "ppo_b": [
            "critic.init=reward",
            "kl.controller=fixed",
            "reward.clip=2.0",
            "reward.missing_eos_penalty=1.0",
            "grad_accum=2",
        ],
        "ppo_c": ["algo=reinforce", "critic.init=reward", "ppo_epochs=1"],
        "ppo_d": ["algo=ppo_penalty", "critic.init=sft"],
        "ppo_e": ["advantage_estimator=grpo", "group_size=4", "kl.penalty=loss", "kl.loss_estimator=k3"],
        "ppo_f": [
            "advantage_estimator=reinforce_pp",
            "group_size=2",
            "reward.dense=true",
            "algo=gspo",
            "clip_low=0.003",
            "clip_high=0.004",
        ],
        # LoRA on the actor (peft's default layers for GPT-2), the reference its adapters switched off
        "ppo_lora": ["lora.enabled=true", "lora.r=4", "critic.init=reward", "optim.lr=1e-3"],
    }
    for name, extra in variants.items():
        _shifu("ppo", "--out", str(out / name), *ppo, *extra)
    # the built-in tasks end to end, shortened: single-turn arith (a reward function) and arith_tool (episodes
    # with an environment, GAE across turns), then a critic-free run on arith_tool's SFT policy
    short = ["--seed", "0", "--threads", "1", "--set", "ppo.iterations=4", "--set", "ppo.eval.every=2"]
    for task in ("arith", "arith_tool"):
        _shifu("quickstart", "--task", task, "--out", str(out / f"quickstart_{task}"), *short)
    tool = out / "quickstart_arith_tool"
    _shifu(
        "ppo",
        "--config",
        str(tool / "ppo" / "config.yaml"),
        "--out",
        str(out / "env_grpo"),
        f"model.path={tool / 'sft' / 'final'}",
        "advantage_estimator=grpo",
        "group_size=4",
        "critic.init=sft",
        "iterations=3",
        "batch_size=32",
        "minibatch_size=16",
        "eval.every=3",
        "eval.num_prompts=16",
        *quiet,
    )


def _rows(path: Path) -> dict:
    out: dict = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        step = row.pop("step", None)
        out.setdefault(step, {}).update({k: v for k, v in row.items() if not k.startswith(IGNORED)})
    return out


def _same(x, y) -> bool:
    return x == y or (x != x and y != y)  # NaN equals NaN here


def compare(a: Path, b: Path) -> int:
    import torch
    from safetensors.torch import load_file

    bad = 0
    for run in sorted(str(p.parent.relative_to(a)) for p in a.rglob("metrics.jsonl")):
        ra, rb = _rows(a / run / "metrics.jsonl"), _rows(b / run / "metrics.jsonl")
        diffs, only = [], set()
        for step in set(ra) | set(rb):
            x, y = ra.get(step, {}), rb.get(step, {})
            only |= set(x) ^ set(y)
            diffs += [(step, k, x[k], y[k]) for k in set(x) & set(y) if not _same(x[k], y[k])]
        line = f"{run}: {len(diffs)} differing metric values"
        for sub in ("final", "best", "critic"):
            for f in sorted((a / run / sub).glob("*.safetensors")):
                ta, tb = load_file(str(f)), load_file(str(b / run / sub / f.name))
                n = sum(k not in tb or not torch.equal(ta[k], tb[k]) for k in ta)
                diffs += [(sub, f.name, n, None)] if n else []
                line += f"; {sub}/{f.name} {n} of {len(ta)} tensors differ"
        if (a / run / "samples.jsonl").exists():
            same = (a / run / "samples.jsonl").read_bytes() == (b / run / "samples.jsonl").read_bytes()
            diffs += [] if same else [("samples.jsonl", "", "", "")]
            line += f"; samples {'identical' if same else 'DIFFER'}"
        for name in ("samples_before.jsonl", "samples_after.jsonl"):  # a quickstart's final evaluation
            if (a / run / ".." / name).exists() and run.endswith("ppo"):
                same = (a / run / ".." / name).read_bytes() == (b / run / ".." / name).read_bytes()
                diffs += [] if same else [(name, "", "", "")]
                line += f"; {name} {'identical' if same else 'DIFFER'}"
        print(line + (f"; keys on one side only: {sorted(only)}" if only else ""))
        for d in diffs[:5]:
            print("   ", d)
        bad += bool(diffs)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "record":
        record(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

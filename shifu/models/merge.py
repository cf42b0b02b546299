"""``shifu merge --base SFT --out DIR POLICY...``: one policy from several RL runs that started at ``SFT``.

Each policy's *task vector* is what RL changed, ``theta_i - theta_base`` (Ilharco et al. 2023, "Editing
models with task arithmetic"). The merged policy is the base plus their mean, times ``scale``:

    theta = theta_base + scale * (1 / M) * sum_i (theta_i - theta_base)

With one policy, ``scale`` in (0, 1) moves it back along the straight line towards the base (the LITI step
of WARP, Rame et al. 2024); with M >= 2 runs of the same RL stage under different seeds it is the model soup
of Wortsman et al. (2022) in task-vector form, the mean that WARP takes before that step. What the runs
learned in common adds up; the parts of each run's change that the others do not share (the noise of its own
samples and minibatches) partly cancel, so the mean spends less KL to the base for the same reward
(docs/benchmarks/alignment.md measures it on the imdb quickstart: the mean of two PPO runs gains more gold than
either at lower KL; the single-run LITI line is below the RL curve there).

Every floating-point parameter is merged in float32 and stored in the base's dtype; tied parameters stay
tied (they are one parameter), buffers and the config are the base's, the tokenizer is the first policy's.
The runs must share the base's architecture: a parameter missing or of another shape in one of them is a
:class:`ShifuError` naming the directory and the parameter. ``--out`` must not exist or be empty, and is
never one of the inputs; it is written atomically, with ``merge.json`` saying what was merged.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from shifu.errors import ShifuError

MERGE_FILE = "merge.json"


def merge_policies(base: str | Path, policies: list[str | Path], out: str | Path, scale: float = 1.0) -> Path:
    """Write ``base + scale * mean_i(policy_i - base)`` to ``out`` (an HF causal-LM directory); returns it."""
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.runs.files import save_hf_dir

    base, out = Path(base), Path(out)
    policies = [Path(p) for p in policies]
    if not policies:
        raise ShifuError("merge: give at least one policy directory to merge into the base")
    if not math.isfinite(scale):
        raise ShifuError(f"merge: scale must be a finite number, got {scale}")
    inputs = {p.resolve() for p in [base, *policies]}
    if out.resolve() in inputs:
        raise ShifuError(f"merge: --out '{out}' is one of the inputs; choose another directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShifuError(f"merge: '{out}' already exists and is not empty; choose another --out or remove it")

    model = load_causal_lm(base, dropout=False)
    params = dict(model.named_parameters())  # tied weights appear once
    theta0 = {k: p.detach().float().clone() for k, p in params.items() if p.is_floating_point()}
    delta = {k: torch.zeros_like(v) for k, v in theta0.items()}
    for path in policies:
        other = dict(load_causal_lm(path, dropout=False).named_parameters())
        if extra := [k for k, p in other.items() if p.is_floating_point() and k not in theta0]:
            raise ShifuError(
                f"merge: {path} has parameters the base {base} has not (first: '{extra[0]}'): the policies "
                "must share the base's architecture"
            )
        for k, v in theta0.items():
            if k not in other:
                raise ShifuError(
                    f"merge: {path} has no parameter '{k}' that the base {base} has: every policy must be "
                    "a fine-tune of the base (same architecture, LoRA adapters folded in)"
                )
            if other[k].shape != v.shape:
                raise ShifuError(
                    f"merge: parameter '{k}' is {tuple(other[k].shape)} in {path} but {tuple(v.shape)} in "
                    f"the base {base}: the policies must share the base's architecture"
                )
            delta[k] += other[k].detach().float() - v
        del other
    with torch.no_grad():
        for k, v in theta0.items():
            params[k].copy_(v + delta[k] * (scale / len(policies)))
    save_hf_dir(model, load_tokenizer(policies[0]), out)
    info: dict[str, Any] = {
        "base": str(base),
        "policies": [str(p) for p in policies],
        "scale": scale,
        "formula": "base + scale * mean(policy - base)",
    }
    (out / MERGE_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shifu merge",
        description="Merge RL runs that started from one base policy: base + scale * mean(policy - base) "
        "(task arithmetic; a model soup of the runs' changes). POLICY: a trainer's run directory (its final/) "
        "or an HF causal-LM directory.",
    )
    p.add_argument("policies", nargs="+", metavar="POLICY")
    p.add_argument("--base", required=True, help="the policy every run started from (e.g. the SFT policy)")
    p.add_argument("--out", required=True, help="new directory for the merged policy")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the mean change (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    from shifu.runs.files import resolve_policy

    args = parser().parse_args(argv)
    base = resolve_policy(args.base)
    policies = [resolve_policy(p) for p in args.policies]
    out = merge_policies(base, policies, args.out, args.scale)
    print(
        f"shifu merge: {len(policies)} polic{'y' if len(policies) == 1 else 'ies'} onto {base} "
        f"(scale {args.scale}) -> {out}",
        file=sys.stderr,
    )
    return 0

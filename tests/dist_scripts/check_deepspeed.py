"""DeepSpeed ZeRO-2/3 checks of ``shifu.parallel.distributed.wrap_deepspeed``, launched by ``tests/test_deepspeed.py``::

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/check_deepspeed.py --out DIR

Same protocol as ``check_dist.py`` (``DIR/rank<r>.json``). Per stage: one SGD step on half the batch per
rank equals the 1-process step on the whole batch; AdamW steps from an ``OptimConfig`` lower the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import check_dist as C  # noqa: E402
import tiny  # noqa: E402

from shifu.config.sections import DistributedConfig, OptimConfig  # noqa: E402
from shifu.parallel import distributed as D  # noqa: E402
from shifu.parallel.strategy import DeepSpeedStrategy, Trained  # noqa: E402


def gathered(engine) -> dict[str, torch.Tensor]:
    """Full fp32 CPU copies of the parameters (ZeRO-3 keeps only shards: gather them first)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: p.detach().float().cpu().clone() for k, p in params.items()}


def check_equals_single(tok, full, stage: int) -> str:
    model = tiny.tiny_model(tok)
    base = {k: p.detach().clone() for k, p in model.named_parameters()}
    ref_model = tiny.tiny_model(tok)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    s, n = tiny.nll_sum_and_count(ref_model, full)
    (s / n).backward()
    ref_opt.step()
    ref = {k: p.detach().clone() for k, p in ref_model.named_parameters()}

    optim = OptimConfig(max_grad_norm=None)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, opt = D.wrap_deepspeed(model, optim, {"zero_optimization": {"stage": stage}}, optimizer=sgd)
    run = strategy_for(stage)
    trained = Trained(engine, opt, torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0), None, [])
    mine = C.local_rows(full)
    s, _ = tiny.nll_sum_and_count(engine, mine)
    run.backward([(trained, s / run.token_mean_divisor(mine["attention_mask"][:, 1:].sum()))])
    assert run.optimizer_step([trained])
    got = gathered(engine)
    err = C.rel_diff(got, ref, base)
    worst = sorted(got, key=lambda k: -(got[k] - ref[k]).abs().max().item())[:3]
    assert err < 2e-6, f"ZeRO-{stage} update differs from 1 process: {err:.2e} (worst: {worst})"
    return f"update rel. diff vs 1 process = {err:.2e}"


def strategy_for(stage: int) -> DeepSpeedStrategy:
    """The trainers' DeepSpeed strategy with a ZeRO-``stage`` config, in this torchrun job."""
    fd, path = tempfile.mkstemp(suffix=".json")  # this rank's own copy of the JSON config
    os.write(fd, json.dumps({"zero_optimization": {"stage": stage}}).encode())
    os.close(fd)
    run = DeepSpeedStrategy(DistributedConfig(strategy="deepspeed", deepspeed_config=path))
    run.device = D.local_device()
    return run


def check_learns(tok, full, stage: int) -> str:
    run = strategy_for(stage)
    model = run.wrap(tiny.tiny_model(tok))
    trained = run.optimize(
        model, model.parameters(), OptimConfig(lr=1e-2, max_grad_norm=1.0, schedule="constant"), 6
    )
    engine = trained.model
    mine = C.local_rows(full)
    divisor = run.token_mean_divisor(mine["attention_mask"][:, 1:].sum())
    losses = []
    for _ in range(6):
        s, _ = tiny.nll_sum_and_count(engine, mine)
        loss = s / divisor
        losses.append(D.reduce_metrics({"loss": loss})["loss"])
        run.backward([(trained, loss)])
        assert run.optimizer_step([trained])
    assert losses[-1] < losses[0] - 0.3, f"loss did not fall: {losses}"
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("SHIFU_THREADS", "1")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    D.init(timeout_s=float(os.environ.get("SHIFU_DIST_TIMEOUT", "60")))
    tok = tiny.char_tokenizer()
    full = tiny.batch(tok, tiny.TEXTS)
    for stage in (2, 3):
        C.run_check(out, f"zero{stage}_equals_single", lambda st=stage: check_equals_single(tok, full, st))
        C.run_check(out, f"zero{stage}_learns", lambda st=stage: check_learns(tok, full, st))
    D.barrier()
    D.destroy()
    failed = [k for k, v in C.RESULTS.items() if not v["ok"]]
    if failed:
        sys.exit(f"failed checks: {', '.join(failed)}")


if __name__ == "__main__":
    main()

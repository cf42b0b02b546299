"""DeepSpeed ZeRO-2/3 checks of ``shifu.parallel.deepspeed``, launched by ``tests/test_distributed.py``::

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/check_deepspeed.py --out DIR

Same protocol as ``check_dist.py`` (``DIR/rank<r>.json``). Per stage: one SGD step on half the batch per
rank equals the 1-process step on the whole batch; AdamW steps from an ``OptimConfig`` lower the loss; with
optimizer offload exactly one optimiser is built (the AdamW that ``Strategy.optimize`` builds, which the
engine steps and the schedule drives), it steps as without offload, and the checkpoint holds its state: an
engine resumed from it continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import argparse
import gc
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
from shifu.parallel.deepspeed import DeepSpeedStrategy, wrap_engine  # noqa: E402
from shifu.parallel.strategy import Trained  # noqa: E402


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

    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, opt = wrap_engine(model, sgd, {"zero_optimization": {"stage": stage}}, max_grad_norm=None)
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


def strategy_for(stage: int, offload: bool = False) -> DeepSpeedStrategy:
    """The trainers' DeepSpeed strategy with a ZeRO-``stage`` config (optimizer offload to the CPU with
    ``offload``), in this torchrun job."""
    zero: dict = {"stage": stage} | ({"offload_optimizer": {"device": "cpu"}} if offload else {})
    fd, path = tempfile.mkstemp(suffix=".json")  # this rank's own copy of the JSON config
    os.write(fd, json.dumps({"zero_optimization": zero}).encode())
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


OFFLOAD_OPTIM = OptimConfig(lr=1e-2, max_grad_norm=1.0, warmup_steps=2, schedule="linear")


def optimizers_built(fn):
    """``fn()`` and the torch optimisers created while it ran (still alive afterwards)."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)}
    out = fn()
    gc.collect()
    return out, [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer) and id(o) not in before]


def train_steps(run: DeepSpeedStrategy, trained: Trained, rows, n: int) -> None:
    divisor = run.token_mean_divisor(rows["attention_mask"][:, 1:].sum())
    for _ in range(n):
        s, _ = tiny.nll_sum_and_count(trained.model, rows)
        run.backward([(trained, s / divisor)])
        assert run.optimizer_step([trained])


def check_offload(tok, full, stage: int, out: Path) -> str:
    mine = C.local_rows(full)

    def build(offload: bool, seed: int = 0):
        run = strategy_for(stage, offload=offload)
        model = run.wrap(tiny.tiny_model(tok, seed=seed))
        return run, *optimizers_built(lambda: run.optimize(model, model.parameters(), OFFLOAD_OPTIM, 8))

    run, trained, built = build(offload=True)
    stepping = trained.model.basic_optimizer  # what the engine steps
    assert len(built) == 1, f"{len(built)} optimisers built with offload: {[type(o).__name__ for o in built]}"
    assert built[0] is stepping and trained.scheduler.optimizer is stepping, "the schedule drives another one"
    plain_run, plain, _ = build(offload=False)
    train_steps(run, trained, mine, 3)
    train_steps(plain_run, plain, mine, 3)
    offloaded, resident = gathered(trained.model), gathered(plain.model)
    err = max((offloaded[k] - resident[k]).abs().max().item() for k in resident)
    assert err <= 1e-6, f"3 AdamW steps with offload differ from without by {err:.2e}"
    lr = stepping.param_groups[0]["lr"]
    # step 3 of 8
    assert abs(lr - OFFLOAD_OPTIM.lr * (1 - 1 / 6)) < 1e-12, f"the engine's optimiser has lr {lr}"
    # the checkpoint holds the state of the optimiser that steps: a fresh engine resumed from it continues
    # exactly as the uninterrupted one
    run_dir = out / f"offload-zero{stage}"
    run.save_checkpoint(run_dir, 3, {"policy": trained}, {}, {"step": 3}, keep_last=1)
    run2, resumed, built2 = build(offload=True, seed=1)
    assert len(built2) == 1
    js = run2.load_checkpoint(run_dir / "checkpoints" / "step-00000003", {"policy": resumed}, {})
    assert js["step"] == 3
    a, b = stepping.state, resumed.model.basic_optimizer.state
    assert len(a) == len(b) > 0, (len(a), len(b))
    for pa, pb in zip(
        stepping.param_groups[0]["params"], resumed.model.basic_optimizer.param_groups[0]["params"]
    ):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[pa][key], b[pb][key]), f"loaded {key} differs from the stepping optimiser's"
        assert float(a[pa]["step"]) == float(b[pb]["step"]) == 3.0
    train_steps(run, trained, mine, 2)
    train_steps(run2, resumed, mine, 2)
    want, got = gathered(trained.model), gathered(resumed.model)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    assert diff == 0.0, f"resumed engine differs from the uninterrupted one by {diff:.2e}"
    return f"1 optimiser ({type(stepping).__name__}); offload vs resident {err:.1e}; resumed == uninterrupted"


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
        C.run_check(
            out, f"zero{stage}_offload_one_optimizer", lambda st=stage: check_offload(tok, full, st, out)
        )
    D.barrier()
    D.destroy()
    failed = [k for k, v in C.RESULTS.items() if not v["ok"]]
    if failed:
        sys.exit(f"failed checks: {', '.join(failed)}")


if __name__ == "__main__":
    main()

"""Multi-process checks of ``shifu.parallel.distributed`` and ``shifu.parallel.torchrun``, launched by ``tests/test_distributed.py`` (and by
``gpu_check.sh`` on CUDA machines) as::

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/check_dist.py --out DIR [--bf16]

Each rank writes ``DIR/rank<r>.json``: ``{check_name: {"ok": bool, "detail": str}}``, updated after every
check, so the test can report each check separately (and what was reached when a rank died). All checks
run in one launch because torchrun start-up costs seconds.

The 1-process reference of each "equals single" check is computed inside the same script: every rank
trains a plain, unwrapped copy of the model on the whole global batch and compares with the distributed
result, where each rank held only its half of the batch (rank 0 the long sequences, rank 1 the short).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tiny  # noqa: E402

from shifu.config.sections import DistributedConfig  # noqa: E402
from shifu.parallel import distributed as D  # noqa: E402
from shifu.parallel import torchrun as T  # noqa: E402
from shifu.parallel.strategy import Trained, offload_frozen  # noqa: E402
from shifu.parallel.torchrun import DistributedStrategy  # noqa: E402

RESULTS: dict[str, dict] = {}


def record(out: Path, name: str, ok: bool, detail: str) -> None:
    RESULTS[name] = {"ok": ok, "detail": detail}
    (out / f"rank{D.rank()}.json").write_text(json.dumps(RESULTS, indent=1))
    if D.is_main():
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)


ONLY: list[str] = []


def run_check(out: Path, name: str, fn) -> None:
    """A failed comparison is recorded and the run goes on (every collective of the check already ran);
    any other error is recorded and re-raised (torchrun then stops the other ranks)."""
    if ONLY and not any(o in name for o in ONLY):
        return
    try:
        detail = fn()
        ok = True
    except AssertionError as e:
        ok, detail = False, f"rank {D.rank()}: {e}"
    except Exception:
        record(out, name, False, f"rank {D.rank()} crashed:\n{traceback.format_exc()}")
        raise
    if not D.all_true(ok):  # every rank records a failure seen on any rank
        ok, detail = False, detail if not ok else "failed on another rank"
    record(out, name, ok, detail or "")


# ----------------------------------------------------------------------------------------------------------


def local_rows(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's contiguous share of the global batch (rank 0: rows 0-1, rank 1: rows 2-3)."""
    W, r = D.world_size(), D.rank()
    n = b["input_ids"].shape[0] // W
    return {k: v[r * n : (r + 1) * n] for k, v in b.items()}


def to_dev(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(D.local_device()) for k, v in b.items()}


def params(model) -> dict[str, torch.Tensor]:
    """Full (gathered) float32 CPU copies of every parameter/buffer, keyed by name."""
    sd = T.full_state_dict(model, rank0_only=False)
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    """max |(a - base) - (b - base)| / max |b - base|: the difference of two updates, relative to one."""
    keys = sorted(set(a) & set(b) & set(base))
    assert keys, "no common parameter names"
    num = max((a[k] - b[k]).abs().max().item() for k in keys)
    den = max((b[k] - base[k]).abs().max().item() for k in keys)
    assert den > 0, "the reference update is zero"
    return num / den


def reference_step(tok, full, opt_cls, lr, steps: int = 1):
    """1 process, whole global batch, token-mean loss: the update every distributed run must reproduce."""
    model = tiny.tiny_model(tok).to(D.local_device())
    opt = opt_cls(model.parameters(), lr=lr)
    for _ in range(steps):
        s, n = tiny.nll_sum_and_count(model, to_dev(full))
        (s / n).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


def dist_step(tok, full, strategy, opt_cls, lr, normalise="global", micro: int = 1, grad_ckpt=False):
    """The same step with ``strategy`` on W ranks, each holding half the batch.

    ``normalise="global"``: local sum / token_mean_divisor (the correct rule); ``"local"``: each rank's own
    token mean (the common mistake, a negative control). ``micro`` > 1 splits the local half into
    micro-batches accumulated under ``grad_sync``.
    """
    model = tiny.tiny_model(tok)
    if grad_ckpt:
        model.train()
    run = strategy_for(strategy, gradient_checkpointing=grad_ckpt)
    model = run.wrap(model)
    trained = constant_lr(model, opt_cls(model.parameters(), lr=lr))
    mine = to_dev(local_rows(full))
    parts = [{k: v[i::micro] for k, v in mine.items()} for i in range(micro)]
    divisor = run.token_mean_divisor(mine["attention_mask"][:, 1:].sum())
    for i, part in enumerate(parts):
        with run.accumulating([trained], sync=i == micro - 1):  # gradients reduced once, after the last
            s, n = tiny.nll_sum_and_count(model, part)
            run.backward([(trained, s / divisor if normalise == "global" else s / n)])
    assert run.optimizer_step([trained])
    return params(model)


def strategy_for(name: str, **cfg) -> DistributedStrategy:
    """The trainers' strategy for ``name`` (ddp, fsdp2) in this torchrun job."""
    run = DistributedStrategy(DistributedConfig(strategy=name, **cfg))
    run.device = D.local_device()
    return run


def constant_lr(model, opt, max_grad_norm: float | None = None) -> Trained:
    """A model and its optimiser as the strategy steps them (constant learning rate)."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return Trained(model, opt, sched, max_grad_norm, list(model.parameters()))


def check_collectives() -> str:
    W, r = D.world_size(), D.rank()
    m = D.reduce_metrics({"b/x": torch.tensor(2.0 * r), "a/y": float(r), "c/one": 1})
    mean_r = (W - 1) / 2
    assert m == {"a/y": mean_r, "b/x": 2 * mean_r, "c/one": 1.0}, m
    s = D.reduce_metrics({"n": r + 1}, op="sum")
    assert s["n"] == W * (W + 1) / 2, s
    n = D.all_reduce_sum(torch.tensor(10 + r))  # a global count
    assert n.item() == sum(10 + i for i in range(W)), n
    assert D.any_true(r == 0) is True and D.all_true(r == 0) is (W == 1)
    assert D.all_true(True) is True and D.any_true(False) is False
    obj = D.broadcast_object({"from": r, "seed": D.rank_seed(7)})
    assert obj == {"from": 0, "seed": 7}, obj
    seeds = D.gather_object({"seed": D.rank_seed(7)})
    assert seeds == [{"seed": 7 + 1000 * i} for i in range(W)], f"rank seeds: {seeds}"
    return f"world={W}"


def check_equals_single(tok, full, strategy: str, micro: int = 1, grad_ckpt: bool = False) -> str:
    base = params(tiny.tiny_model(tok).to(D.local_device()))
    ref = reference_step(tok, full, torch.optim.SGD, lr=0.5)
    got = dist_step(tok, full, strategy, torch.optim.SGD, lr=0.5, micro=micro, grad_ckpt=grad_ckpt)
    control = D.world_size() > 1 and micro == 1 and not grad_ckpt
    if control:  # every collective runs before the first assertion, so a failure cannot desync ranks
        wrong = dist_step(tok, full, strategy, torch.optim.SGD, lr=0.5, normalise="local")
    err = rel_diff(got, ref, base)
    detail = f"update rel. diff vs 1 process = {err:.2e}"
    if control:
        err_wrong = rel_diff(wrong, ref, base)
        detail += f"; per-rank token-mean (wrong) = {err_wrong:.2e}"
        assert err_wrong > 1e-2, f"negative control: per-rank normalisation should differ ({err_wrong:.2e})"
    # CPU: ~1e-7 (summation order); CUDA: cuBLAS picks other kernels for other batch shapes (~1e-6)
    assert err < (2e-6 if D.local_device().type == "cpu" else 1e-5), detail
    return detail


def check_resume(tok, full, strategy: str, out: Path) -> str:
    """AdamW step 1, save, step 2 == fresh (differently initialised) model, load, step 2."""
    ckpt = out / f"ckpt-{strategy}"

    def build(seed):
        model = T.wrap_trainable(tiny.tiny_model(tok, seed=seed), strategy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, columns):
        mine = to_dev(local_rows({k: v[:, columns] for k, v in full.items()}))
        s, _ = tiny.nll_sum_and_count(model, mine)
        (s / D.token_mean_divisor(mine["attention_mask"][:, 1:].sum())).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build(0)
    step(model, opt, slice(None))
    T.save_sharded(ckpt, model, opt)
    D.barrier()
    step(model, opt, slice(0, 12))
    uninterrupted = params(model)

    model2, opt2 = build(seed=1)
    T.load_sharded(ckpt, model2, opt2)
    step(model2, opt2, slice(0, 12))
    resumed = params(model2)
    err = max((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted)
    fresh = params(T.wrap_trainable(tiny.tiny_model(tok, seed=1), strategy))
    moved = max((uninterrupted[k] - fresh[k]).abs().max().item() for k in uninterrupted)
    assert moved > 1e-3, "the two initialisations should differ (the check would be vacuous)"
    assert err <= 1e-7, f"resumed weights differ from uninterrupted by {err:.2e}"
    return f"max |uninterrupted - resumed| = {err:.1e}"


def check_uneven_loop(tok) -> str:
    """Rank r needs 3 + 4r steps; all ranks keep running FSDP2 forwards until all are done."""
    model = T.prepare_frozen(tiny.tiny_model(tok), "fsdp2")
    need = 3 + 4 * D.rank()
    ids = torch.tensor([[3, 4, 5]], device=D.local_device())
    steps, done = 0, False
    with torch.no_grad():
        while not D.all_true(done):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
            steps += 1
            done = steps >= need
    longest = 3 + 4 * (D.world_size() - 1)
    assert steps == longest, f"rank {D.rank()} ran {steps} forwards, expected {longest}"
    return f"every rank ran {steps} forwards (own need: 3 and 7)"


def check_frozen_sharded(tok, full) -> str:
    b = to_dev(full)
    with torch.no_grad():
        rep = T.prepare_frozen(tiny.tiny_model(tok), "replicate")(**b).logits
        sh = T.prepare_frozen(tiny.tiny_model(tok), "fsdp2")(**b).logits
    err = (rep - sh).abs().max().item()
    assert err <= 1e-5, f"sharded frozen logits differ from replicated by {err:.2e}"
    return f"max |logits diff| = {err:.1e}"


def check_lora_fsdp2(tok, full) -> str:
    """LoRA actor sharded with FSDP2: after an adapter step, adapters-off log-probs == a frozen copy's."""
    from shifu.models import lora

    frozen = tiny.tiny_model(tok).eval().to(D.local_device())
    actor = lora.wrap_lora(tiny.tiny_model(tok).eval(), lora.LoraConfig(enabled=True, r=4, alpha=8.0))
    actor = T.wrap_trainable(actor, "fsdp2")
    opt = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=1.0)
    mine = to_dev(local_rows(full))
    for _ in range(2):
        s, _ = tiny.nll_sum_and_count(actor, mine)
        (s / D.token_mean_divisor(mine["attention_mask"][:, 1:].sum())).backward()
        opt.step()
        opt.zero_grad()
    b = to_dev(full)
    with torch.no_grad():
        trained = actor(**b).logits
        with lora.reference(actor, None) as ref:
            got = ref(**b).logits
        want = frozen(**b).logits
    moved = (trained - want).abs().max().item()
    err = (got - want).abs().max().item()
    assert moved > 1e-3, f"the adapters did not change the policy ({moved:.1e})"
    assert err <= 1e-6, f"adapters-off logits differ from the frozen copy by {err:.2e}"
    return f"adapters moved logits by {moved:.2e}; reference error {err:.1e}"


def check_bf16(tok, full) -> str:
    """FSDP2 with bf16 compute (fp32 reduce): a few AdamW steps lower the loss."""
    model = T.wrap_trainable(tiny.tiny_model(tok), "fsdp2", bf16=True)
    run = strategy_for("fsdp2")
    trained = constant_lr(model, torch.optim.AdamW(model.parameters(), lr=1e-2), max_grad_norm=1.0)
    mine = to_dev(local_rows(full))
    divisor = run.token_mean_divisor(mine["attention_mask"][:, 1:].sum())
    losses = []
    for _ in range(8):
        s, _ = tiny.nll_sum_and_count(model, mine)
        loss = s / divisor
        losses.append(D.reduce_metrics({"loss": loss})["loss"])
        run.backward([(trained, loss)])
        assert run.optimizer_step([trained])  # clips over all ranks' DTensor shards
        norm = run.grad_norm
        assert isinstance(norm, float) and norm > 0, norm
    assert losses[-1] < losses[0] - 0.3, f"bf16 loss did not fall: {losses}"
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, last grad norm {norm:.3f}"


def check_offload(tok, full) -> str:
    """A frozen model kept on the CPU gives, inside offload_frozen, the logits of a resident copy."""
    dev = D.local_device()
    ref = tiny.tiny_model(tok).eval()
    resident = copy.deepcopy(ref).to(dev)
    b = to_dev(full)
    with torch.no_grad(), offload_frozen(ref, dev) as m:
        assert next(m.parameters()).device == dev
        got = m(**b).logits
    assert next(ref.parameters()).device.type == "cpu", "offloaded model did not go back to the CPU"
    with torch.no_grad():
        want = resident(**b).logits
    err = (got - want).abs().max().item()
    assert err == 0.0, f"offloaded logits differ by {err}"
    return f"on {dev}, back on cpu after"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true", help="also run the bf16 check (GPU)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only matching checks")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("SHIFU_THREADS", "1")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    ONLY.extend(o for o in args.only.split(",") if o)
    out.mkdir(parents=True, exist_ok=True)
    D.init(timeout_s=float(os.environ.get("SHIFU_DIST_TIMEOUT", "60")))
    tok = tiny.char_tokenizer()
    full = tiny.batch(tok, tiny.TEXTS)

    run_check(out, "collectives", check_collectives)
    for strategy in ("ddp", "fsdp2"):
        run_check(out, f"{strategy}_equals_single", lambda s=strategy: check_equals_single(tok, full, s))
        run_check(
            out,
            f"{strategy}_accumulate_equals_single",
            lambda s=strategy: check_equals_single(tok, full, s, micro=2),
        )
        run_check(out, f"{strategy}_resume", lambda s=strategy: check_resume(tok, full, s, out))
    run_check(
        out, "fsdp2_grad_ckpt_equals_single", lambda: check_equals_single(tok, full, "fsdp2", grad_ckpt=True)
    )
    run_check(out, "lora_fsdp2_reference", lambda: check_lora_fsdp2(tok, full))
    run_check(out, "uneven_synced_loop", lambda: check_uneven_loop(tok))
    run_check(out, "frozen_fsdp2_equals_replicate", lambda: check_frozen_sharded(tok, full))
    if args.bf16:
        run_check(out, "fsdp2_bf16_learns", lambda: check_bf16(tok, full))
    if D.local_device().type == "cuda":
        run_check(out, "offload_frozen", lambda: check_offload(tok, full))
    D.barrier()
    D.destroy()
    failed = [k for k, v in RESULTS.items() if not v["ok"]]
    if failed:
        sys.exit(f"failed checks: {', '.join(failed)}")


if __name__ == "__main__":
    main()

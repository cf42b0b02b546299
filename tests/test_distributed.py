"""shifu.parallel.distributed and the torchrun backend (shifu.parallel.torchrun): single-process behaviour here, 2-process behaviour through torchrun (gloo, CPU).

The 2-process checks live in ``tests/dist_scripts/check_dist.py`` and run in ONE torchrun launch (start-up
costs seconds); each check is reported here as its own test. Process groups get a 60 s timeout, so a
deadlock fails the run instead of hanging it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shifu.errors import ShifuError
from shifu.parallel import distributed as D
from shifu.parallel import torchrun as T
from shifu.parallel.strategy import enable_gradient_checkpointing
from shifu.trainers.common import autocast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dist_scripts"))

import tiny  # noqa: E402

torch.set_num_threads(1)

CHECKS = [
    "collectives",
    "ddp_equals_single",
    "ddp_accumulate_equals_single",
    "ddp_resume",
    "fsdp2_equals_single",
    "fsdp2_accumulate_equals_single",
    "fsdp2_resume",
    "fsdp2_grad_ckpt_equals_single",
    "lora_fsdp2_reference",
    "uneven_synced_loop",
    "frozen_fsdp2_equals_replicate",
    "fsdp2_bf16_learns",
]


def launch(script: str, out: Path, *args: str, timeout: float = 240) -> tuple[dict[str, dict], str]:
    """torchrun 2 CPU ranks of ``dist_scripts/<script>``; merge the ranks' per-check results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1", "SHIFU_DIST_TIMEOUT": "60"}
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "dist_scripts" / script),
        "--out",
        str(out),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout[-3000:] + proc.stderr[-3000:]
    except subprocess.TimeoutExpired as e:
        log = f"torchrun timed out: {e}"
    results: dict[str, dict] = {}
    for r in (0, 1):
        f = out / f"rank{r}.json"
        for name, res in (json.loads(f.read_text()) if f.exists() else {}).items():
            prev = results.get(name, {"ok": True, "detail": ""})
            results[name] = {
                "ok": prev["ok"] and res["ok"],
                "detail": f"{prev['detail']} | r{r}: {res['detail']}",
            }
    return results, log


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> tuple[dict[str, dict], str]:
    return launch("check_dist.py", tmp_path_factory.mktemp("dist"), "--bf16")


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory) -> tuple[dict[str, dict], str]:
    pytest.importorskip("deepspeed", reason="optional: pip install 'shifu-rlhf[deepspeed]'")
    return launch("check_deepspeed.py", tmp_path_factory.mktemp("ds"), timeout=400)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks(two_rank_results, check):
    """DDP/FSDP2 update == 1-process update on the same global batch; resume == uninterrupted; etc."""
    results, log = two_rank_results
    assert check in results, f"check '{check}' never ran; torchrun output:\n{log}"
    assert results[check]["ok"], results[check]["detail"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "check",
    [
        "zero2_equals_single",
        "zero2_learns",
        "zero2_offload_one_optimizer",
        "zero3_equals_single",
        "zero3_learns",
        "zero3_offload_one_optimizer",
    ],
)
def test_deepspeed_two_ranks(deepspeed_results, check):
    """ZeRO-2/3 (gloo, CPU): the update equals 1 process on the same global batch; AdamW lowers the loss;
    with optimizer offload one optimiser is built, and the checkpoint holds the state of the one that steps."""
    results, log = deepspeed_results
    assert check in results, f"check '{check}' never ran; torchrun output:\n{log}"
    assert results[check]["ok"], results[check]["detail"]


# ------------------------------------------------------------------------------------------------ 1 process


@pytest.mark.unit
def test_single_process_is_a_no_op():
    assert "WORLD_SIZE" not in os.environ
    assert D.init().type in ("cpu", "cuda")
    assert (D.rank(), D.world_size(), D.is_main()) == (0, 1, True)
    t = torch.tensor([1.5, 2.0])
    assert torch.equal(D.all_reduce_sum(t), t) and D.all_reduce_sum(t) is not t
    assert D.reduce_metrics({"b": torch.tensor(2.0), "a": 1}) == {"a": 1.0, "b": 2.0}
    assert D.token_mean_divisor(torch.tensor(7)).item() == 7.0
    assert D.token_mean_divisor(torch.tensor(0)).item() == 1.0  # empty batch: zero loss, not NaN
    assert D.any_true(True) and not D.all_true(False)
    assert D.broadcast_object({"x": 1}) == {"x": 1} and D.gather_object(3) == [3]
    assert D.rank_seed(5) == 5
    model = torch.nn.Linear(2, 2)
    assert T.wrap_trainable(model, "fsdp2") is model  # nothing to shard across one process


@pytest.mark.unit
def test_bad_strategy_and_bad_checkpoint_are_clear_errors(tmp_path):
    with pytest.raises(ShifuError, match="use none, ddp or fsdp2"):
        T.wrap_trainable(torch.nn.Linear(2, 2), "zero9")
    with pytest.raises(ShifuError, match="use replicate or fsdp2"):
        T.prepare_frozen(torch.nn.Linear(2, 2), "sharded")
    with pytest.raises(ShifuError, match="not a sharded checkpoint"):
        T.load_sharded(tmp_path, torch.nn.Linear(2, 2))


@pytest.mark.unit
def test_sharded_checkpoint_round_trip_single_process(tmp_path):
    """save_sharded/load_sharded also work without a process group (model and AdamW state)."""
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.1)
    a(torch.randn(5, 4)).square().sum().backward()
    opt_a.step()
    opt_a.zero_grad()
    T.save_sharded(tmp_path / "ck", a, opt_a)
    b = torch.nn.Linear(4, 3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1)
    T.load_sharded(tmp_path / "ck", b, opt_b)
    x = torch.randn(5, 4)
    for m, o in ((a, opt_a), (b, opt_b)):
        m(x).square().sum().backward()
        o.step()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


@pytest.mark.unit
def test_gradient_checkpointing_gives_the_same_gradients():
    tok = tiny.char_tokenizer()
    b = tiny.batch(tok, tiny.TEXTS)
    plain = tiny.tiny_model(tok).train()
    ckpt = enable_gradient_checkpointing(copy.deepcopy(plain).train())
    assert ckpt.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    grads = []
    for m in (plain, ckpt):
        s, n = tiny.nll_sum_and_count(m, b)
        (s / n).backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.unit
def test_gradient_checkpointing_under_cpu_bf16_autocast_gives_the_same_gradients():
    """The trainers' bf16 autocast picks SDPA's math backend for its forward; the backward runs after the block,
    and the recomputation must run the attention the forward ran (else torch refuses the recomputed tensors)."""
    tok = tiny.char_tokenizer()
    b = tiny.batch(tok, tiny.TEXTS)
    plain = tiny.tiny_model(tok).train()
    ckpt = enable_gradient_checkpointing(copy.deepcopy(plain).train())
    grads = []
    for m in (plain, ckpt):
        with autocast(True, "cpu"):
            s, n = tiny.nll_sum_and_count(m, b)
        (s / n).backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=0, atol=0, msg=k)


@pytest.mark.unit
def test_gradient_checkpointing_refuses_a_plain_module():
    with pytest.raises(ShifuError, match="gradient_checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.unit
def test_a_build_lock_left_by_a_killed_deepspeed_op_build_is_named(tmp_path, monkeypatch):
    """A build of a DeepSpeed op killed midway leaves its lock, and every later launch waits on it without a
    word: shifu names an old lock (and leaves one young enough to be a build in progress alone)."""
    from shifu.parallel.deepspeed import STALE_LOCK_S, stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old, young = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (old, young):
        lock.parent.mkdir()
        lock.touch()
    now = young.stat().st_mtime + 5
    os.utime(old, (now - STALE_LOCK_S - 60, now - STALE_LOCK_S - 60))
    warnings = stale_build_locks(now)
    assert len(warnings) == 1 and str(old) in warnings[0] and "delete the file" in warnings[0]
    old.unlink()
    assert stale_build_locks(now) == []

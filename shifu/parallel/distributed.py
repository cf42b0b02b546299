"""The process group and its collectives: the layer of the parallel wing that talks to other processes.

Every function works unchanged in a plain single process (``WORLD_SIZE`` unset): collectives return their
input, ``rank() == 0``. Under ``torchrun`` call :func:`init` once at start-up (the strategies' ``launch``
does). Model wrapping and sharded checkpoints are the backends' (:mod:`shifu.parallel.torchrun`,
:mod:`shifu.parallel.deepspeed`); they build on these functions.

Conventions pinned here (and tested in ``tests/test_distributed.py`` on 2 CPU processes over gloo):

- **Global token-mean.** A token-mean loss over a global batch split across ranks is
  ``sum_r sum_t l_rt / N`` with ``N`` the number of real tokens on *all* ranks. DDP, FSDP2 and ZeRO
  *average* gradients over the ``W`` ranks, so each rank must back-propagate ``sum_t l_rt / (N / W)``:
  divide the local masked *sum* by :func:`token_mean_divisor` of the local count. The update then equals
  a 1-process update on the whole batch (to float rounding), whatever the number of tokens on each rank.
  With gradient accumulation, the count is that of every micro-batch of the optimiser step.
- **Synced loops.** A loop whose length differs across ranks (generation until EOS) must run the same
  number of collectives everywhere: loop ``while not all_true(local_done)``; finished ranks keep
  running (wasted) forwards until every rank is done, so FSDP all-gathers never deadlock.
- **Seeds.** Model initialisation and data shuffling use the *same* seed on every rank; sampling uses
  :func:`rank_seed` so that ranks draw different responses.
- **Main rank.** Only rank 0 (:func:`is_main`) writes logs and the run directory's files; every rank takes
  part in writing and reading sharded checkpoints and in gathering full weights.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from shifu.errors import ShifuError

_device: torch.device | None = None


def planned_world_size() -> int:
    """The number of processes ``torchrun`` started (``WORLD_SIZE``), known before :func:`init`."""
    if is_distributed():
        return world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ShifuError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


# --------------------------------------------------------------------------------------------------------
# process group


def init(backend: str | None = None, timeout_s: float = 600) -> torch.device:
    """Join the process group that ``torchrun`` describes in the environment; return this rank's device.

    ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``. ``timeout_s`` bounds every
    collective: a rank stuck waiting (a deadlock) fails after it instead of hanging. Without
    ``WORLD_SIZE`` in the environment this is a single process: nothing is initialised.
    """
    global _device
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        _device = _default_device()
        return _device
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ShifuError(f"WORLD_SIZE is set but {key} is not: launch with `torchrun`, not by hand")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    _device = _default_device()
    if _device.type == "cuda":
        torch.cuda.set_device(_device)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = _device  # binds the communicator to this GPU up front
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return _device


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def destroy() -> None:
    """Leave the process group (call at the end of a torchrun program; a no-op otherwise), once every rank is
    done with it. The ranks meet on the rendezvous store, not in a collective: a gloo collective returns on a
    rank once it has received, while its own last message to a peer may still be queued, and destroying the
    group closes that connection, so the peer's collective can fail ("Connection closed by peer"; gloo issue
    155): a race in every run that ended with a barrier right before the group went. A rank that reached the
    store is done with every collective it made, so once all have, no message is in flight."""
    if dist.is_initialized():
        _meet_on_store()
        dist.destroy_process_group()


_meetings = 0  # destroy()s in this process (each meets on keys of its own)


def _meet_on_store() -> None:
    """Every rank waits until all have arrived (the default store's timeout bounds it); rank 0, which may host
    the store, leaves last."""
    global _meetings
    _meetings += 1
    store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    key = f"shifu/leave/{_meetings}"
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])
    store.add(f"{key}/left", 1)
    if dist.get_rank() == 0:
        deadline = time.monotonic() + store.timeout.total_seconds()
        while store.add(f"{key}/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)


# what a collective's error says when another process of the job died or stopped answering (gloo, NCCL)
_PEER_SIGNS = (
    "gloo",
    "NCCL",
    "Connection reset",
    "Connection closed",
    "Connection refused",
    "Broken pipe",
    "timed out",
    "Timed out",
    "Socket Timeout",
)


def lost_peer(error: BaseException) -> str | None:
    """Why a collective failed, when ``error`` says another process of this torchrun job died or stopped
    answering within ``distributed.timeout_s`` (its first line, without the backend's source location);
    None for any other error, and always in a single process."""
    if not is_distributed() or not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    text = str(error).strip()
    if not isinstance(error, dist.DistError) and not any(sign in text for sign in _PEER_SIGNS):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    first = first.split("] ", 1)[1] if first.startswith("[") and "] " in first else first
    return first.split(". This is typically caused", 1)[0]


def launched_by_torchrun() -> bool:
    """Whether torchrun's launcher started this process (it then forwards the stop signals it gets)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on rank 0 (and in a single process): the rank that logs and writes files."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def local_device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` when CUDA is available, else CPU."""
    return _device if _device is not None else _default_device()


def rank_seed(seed: int) -> int:
    """``seed + 1000 * rank``: a different sampling stream per rank (rank 0 keeps ``seed``).

    Use it for sampling only; model initialisation and data order use the shared ``seed``.
    """
    return seed + 1000 * rank()


def _comm_device() -> torch.device:
    """Where collective buffers live: the GPU for NCCL, the CPU for gloo."""
    if is_distributed() and dist.get_backend() == "nccl":
        return local_device()
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------------
# collectives (no gradient flows through any of them)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks, as a new tensor on ``t``'s device (``t`` itself is left unchanged)."""
    out = t.detach().clone()
    if is_distributed():
        buf = out.to(_comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        out = buf.to(t.device)
    return out


def token_mean_divisor(n_local: torch.Tensor) -> torch.Tensor:
    """``N_global / W``: divide the local masked loss *sum* by this to get a global token-mean update.

    DDP/FSDP2 average gradients over ``W`` ranks, so ``sum_local / (N_global / W)`` averaged over ranks
    is ``sum_global / N_global``. Clamped at 1 token so an all-padding batch gives a zero loss, not NaN.
    """
    n = all_reduce_sum(n_local.detach().to(torch.float64)).clamp(min=1.0)  # real tokens on every rank
    return (n / world_size()).to(torch.float32)


def reduce_metrics(
    metrics: dict[str, float | torch.Tensor], op: Literal["mean", "sum"] = "mean"
) -> dict[str, float]:
    """Mean (or sum) over ranks of scalar metrics, in ONE collective; returns plain floats.

    Every rank must pass the same keys (order does not matter). Values are stacked into one float64
    vector, all-reduced, and read back with a single device-to-host copy.
    """
    keys = sorted(metrics)
    if not keys:
        return {}
    vals = torch.stack([_float64(metrics[k]) for k in keys])
    total = all_reduce_sum(vals.to(_comm_device())).cpu()
    if op == "mean":
        total = total / world_size()
    return dict(zip(keys, total.tolist()))


def _float64(v: float | torch.Tensor) -> torch.Tensor:
    """A 0-dim float64 CPU tensor of a scalar (a Python float keeps all its digits)."""
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", torch.float64).reshape(())
    return torch.tensor(float(v), dtype=torch.float64)


def _reduce_flag(flag: bool, op: dist.ReduceOp) -> bool:
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(t, op=op)
    return bool(t.item())


def any_true(flag: bool) -> bool:
    """True if ``flag`` is true on any rank (one collective; every rank must call it)."""
    return _reduce_flag(flag, dist.ReduceOp.MAX)


def all_true(flag: bool) -> bool:
    """True if ``flag`` is true on every rank: the ``all_done`` hook of synced generation."""
    return _reduce_flag(flag, dist.ReduceOp.MIN)


def largest(n: int) -> int:
    """The largest of every rank's ``n`` (one collective; every rank must call it)."""
    if not is_distributed():
        return n
    t = torch.tensor([int(n)], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (the others' argument is ignored)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, as a list indexed by rank, on every rank (e.g. per-rank RNG states
    for a checkpoint that rank 0 writes)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_module(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into ``model`` on every rank (an identical start before a
    model is sharded); a no-op in one process."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            buf = t.data.to(_comm_device())
            dist.broadcast(buf, src=0)
            t.data.copy_(buf.to(t.device))

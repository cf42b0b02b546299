"""The only module that touches ``torch.distributed``: process groups, collectives, DDP/FSDP2 wrapping,
sharded checkpoints, per-rank seeds and the memory helpers (gradient checkpointing, frozen-model offload).

Every function works unchanged in a plain single process (``WORLD_SIZE`` unset): collectives return their
input, wrappers return the model, ``rank() == 0``. Under ``torchrun`` call :func:`init` once at start-up.

Conventions pinned here (and tested in ``tests/test_distributed.py`` on 2 CPU processes over gloo):

- **Global token-mean.** A token-mean loss over a global batch split across ranks is
  ``sum_r sum_t l_rt / N`` with ``N`` the number of real tokens on *all* ranks. DDP and FSDP2 *average*
  gradients over the ``W`` ranks, so each rank must back-propagate ``sum_t l_rt / (N / W)``:
  divide the local masked *sum* by :func:`token_mean_divisor` of the local count. The update then equals
  a 1-process update on the whole batch (to float rounding), whatever the number of tokens on each rank.
  With gradient accumulation, the count is that of every micro-batch of the optimiser step.
- **Synced loops.** A loop whose length differs across ranks (generation until EOS) must run the same
  number of collectives everywhere: loop ``while not all_true(local_done)``; finished ranks keep
  running (wasted) forwards until every rank is done, so FSDP all-gathers never deadlock.
- **Seeds.** Model initialisation and data shuffling use the *same* seed on every rank; sampling uses
  :func:`rank_seed` so that ranks draw different responses.
- **Main rank.** Only rank 0 (:func:`is_main`) writes logs and the non-sharded parts of checkpoints; all
  ranks take part in :func:`save_sharded` / :func:`load_sharded` and :func:`full_state_dict`.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from shifu.errors import ShifuError

TrainStrategy = Literal["none", "ddp", "fsdp2"]
FrozenStrategy = Literal["replicate", "fsdp2"]

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
    """Leave the process group (call at the end of a torchrun program; a no-op otherwise). Every rank waits
    for the others first: a rank tearing gloo down while another still talks to it can abort the process."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# what a collective's error says when another process of the job died or stopped answering (gloo, NCCL)
_PEER_SIGNS = ("gloo", "NCCL", "Connection reset", "Connection closed", "Connection refused", "Broken pipe",
               "timed out", "Timed out", "Socket Timeout")  # fmt: skip


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


# --------------------------------------------------------------------------------------------------------
# wrapping models


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (classes named in ``_no_split_modules``), outermost first.

    Falls back to the children of every ``nn.ModuleList`` when no model declares its blocks.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        blocks = [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]
    # never shard a block inside another block: keep the outermost ones
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


def _broadcast_from_main(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank (identical start before sharding)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            buf = t.data.to(_comm_device())
            dist.broadcast(buf, src=0)
            t.data.copy_(buf.to(t.device))


def _fully_shard(model: nn.Module, bf16: bool, cpu_offload: bool, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if bf16:
        # compute in bf16, reduce gradients in fp32 (the sharded master weights stay fp32)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs["offload_policy"] = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)  # the root: embeddings, final norm, (tied) head, scalar head
    return model


def wrap_trainable(
    model: nn.Module, strategy: TrainStrategy, bf16: bool = False, cpu_offload: bool = False
) -> nn.Module:
    """Prepare a trained model (actor, critic, SFT policy, reward model) on this rank's device.

    - ``none``: moved to :func:`local_device`, nothing else.
    - ``ddp``: ``DistributedDataParallel`` (rank 0's weights broadcast at construction). Call the trained
      model through the wrapper; reach HF methods (``generate``) through ``wrapped.module``.
    - ``fsdp2``: ``fully_shard`` on each transformer block, then on the root. The model keeps its class
      and methods (``generate`` works; each block all-gathers its weights in its forward). Rank 0's
      weights are broadcast first. ``bf16`` computes in bf16 with fp32 gradient reduction;
      ``cpu_offload`` keeps the sharded parameters, gradients and optimiser state on the CPU (GPU runs).

    Build the optimiser *after* wrapping (FSDP2 replaces parameters by sharded DTensors).
    """
    device = local_device()
    if strategy == "none" or not is_distributed():
        if strategy not in ("none", "ddp", "fsdp2"):
            raise ShifuError(f"unknown distributed strategy '{strategy}' (use none, ddp or fsdp2)")
        return model.to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(device)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp2":
        model = model.to(device)
        _broadcast_from_main(model)
        return _fully_shard(model, bf16=bf16, cpu_offload=cpu_offload, reshard_after_forward=True)
    raise ShifuError(f"unknown distributed strategy '{strategy}' (use none, ddp or fsdp2)")


def prepare_frozen(model: nn.Module, strategy: FrozenStrategy = "replicate", bf16: bool = False) -> nn.Module:
    """A frozen model (reference, reward model) in eval mode with ``requires_grad=False``.

    ``replicate``: a full copy on every rank's device (each rank loads the same directory).
    ``fsdp2``: sharded like a trained model (1/W of its memory per rank; every forward all-gathers, so
    all ranks must call its forward the same number of times).
    """
    model.eval().requires_grad_(False)
    if strategy == "replicate" or not is_distributed():
        if strategy not in ("replicate", "fsdp2"):
            raise ShifuError(f"unknown frozen-model strategy '{strategy}' (use replicate or fsdp2)")
        return model.to(local_device())
    if strategy == "fsdp2":
        model = model.to(local_device())
        _broadcast_from_main(model)
        return _fully_shard(model, bf16=bf16, cpu_offload=False, reshard_after_forward=True)
    raise ShifuError(f"unknown frozen-model strategy '{strategy}' (use replicate or fsdp2)")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP wrapper or DeepSpeed engine (FSDP2 models are not wrapped: returned
    as is)."""
    if isinstance(model, nn.parallel.DistributedDataParallel) or _is_deepspeed(model):
        return model.module
    return model


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a complete (unsharded) state dict, present on every rank, into a plain, DDP or FSDP2 model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(unwrap(model), state_dict, options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce inside the block when ``enabled`` is False.

    For gradient accumulation: run every micro-batch but the last with ``grad_sync(model, False)``.
    Works for DDP (``no_sync``) and FSDP2 (``set_requires_gradient_sync``); a no-op otherwise.
    """
    from torch.distributed.fsdp import FSDPModule

    if enabled:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


# --------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO (optional: pip install 'shifu-rlhf[deepspeed]')


def _deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: DeepSpeed picks its backend then
    try:
        import deepspeed
    except ImportError:
        raise ShifuError("DeepSpeed is not installed: pip install 'shifu-rlhf[deepspeed]'") from None
    return deepspeed


def load_deepspeed_config(ds_config: str | Path | dict, optim: Any = None) -> dict[str, Any]:
    """A DeepSpeed config dict from a JSON file (or a dict), with shifu's defaults filled in.

    shifu's loop owns batching and accumulation, so ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` default to 1. From ``optim`` (a ``shifu.config.schema.OptimConfig``):
    ``gradient_clipping`` and, when the ZeRO section offloads the optimiser and the file names no
    optimiser, an ``AdamW`` section (DeepSpeed then uses its CPU Adam, compiled on first use).
    """
    import json

    if isinstance(ds_config, dict):
        cfg = copy.deepcopy(ds_config)
    else:
        path = Path(ds_config)
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ShifuError(f"DeepSpeed config '{path}' does not exist") from None
        except json.JSONDecodeError as e:
            raise ShifuError(
                f"DeepSpeed config '{path}', line {e.lineno}: not valid JSON ({e.msg})"
            ) from None
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.setdefault("steps_per_print", 10**9)  # shifu's tracker logs; keep DeepSpeed quiet
    zero = cfg.get("zero_optimization", {})
    if optim is not None:
        # 0 disables clipping (DeepSpeed's own default is not "off")
        cfg.setdefault("gradient_clipping", optim.max_grad_norm if optim.max_grad_norm is not None else 0.0)
        if "offload_optimizer" in zero and "optimizer" not in cfg:
            cfg["optimizer"] = {
                "type": "AdamW",
                "params": {"lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps,
                           "weight_decay": optim.weight_decay},
            }  # fmt: skip
    return cfg


def wrap_deepspeed(
    model: nn.Module, optim: Any, ds_config: str | Path | dict, optimizer: torch.optim.Optimizer | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(engine, optimizer)`` for a trained model under DeepSpeed ZeRO (stage, offload from the config).

    ``optim`` is an ``OptimConfig``; without an ``optimizer`` section in the config and without
    ``optimizer``, a torch ``AdamW`` is built from it. Call the engine like the model; train with
    :func:`backward` and :func:`optimizer_step` (they call ``engine.backward``/``engine.step``).
    Gradients are averaged over ranks as with DDP, so :func:`token_mean_divisor` applies unchanged.
    For ZeRO-3, build HF models inside :func:`deepspeed_zero3_init` so weights load straight into shards.
    """
    deepspeed = _deepspeed()
    cfg = load_deepspeed_config(ds_config, optim)
    if optimizer is None and "optimizer" not in cfg:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
        )
    if optimizer is not None and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        cfg.setdefault("zero_allow_untested_optimizer", True)
    if not is_distributed():
        init()
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine, ds_optimizer


def deepspeed_zero3_init(ds_config: str | Path | dict) -> Any:
    """Keep the returned object alive while calling ``from_pretrained``: under ZeRO-3 transformers then
    creates each weight directly as a shard (no full copy per rank) and loads the checkpoint into it."""
    _deepspeed()
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(load_deepspeed_config(ds_config))


def _is_deepspeed(model: nn.Module) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


# --------------------------------------------------------------------------------------------------------
# checkpoints


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Model (+ optimiser) state with ``torch.distributed.checkpoint``: each rank writes its own shard.

    Call on every rank, with the same ``path`` (a shared filesystem). Works for plain, DDP and FSDP2
    models and in a single process. The caller (``shifu.runs.checkpoint``) makes it atomic by saving into a
    temporary directory and renaming it on rank 0 after a :func:`barrier`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    Path(path).mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what :func:`save_sharded` wrote into an already wrapped ``model`` (and ``optimizer``) in place.

    The world size may differ from the one that saved (DCP reshards on load).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (Path(path) / ".metadata").exists():
        raise ShifuError(
            f"'{path}' is not a sharded checkpoint (no .metadata): was it written by save_sharded?"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The complete (unsharded) model state on CPU, gathered from all ranks (call on every rank).

    With ``rank0_only`` (the default) the other ranks get an empty dict and never hold the full model;
    otherwise every rank gets a copy. For writing a ``save_pretrained`` directory on rank 0, and for tests.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if _is_deepspeed(model):
        if model.zero_optimization_partition_weights():  # ZeRO-3: gather the 16-bit shards on rank 0
            sd = model._zero3_consolidated_16bit_state_dict()
            sd = {k: v.detach().float().cpu() for k, v in (sd or {}).items()}
        else:
            sd = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
        return sd if (is_main() or not rank0_only) else {}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = get_model_state_dict(model, options=opts)
    return sd if rank0_only else {k: v.detach().cpu() for k, v in sd.items()}


# --------------------------------------------------------------------------------------------------------
# memory features


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in the backward pass instead of storing them.

    Uses the HF API with non-reentrant checkpoints (correct with frozen inputs, e.g. LoRA, and with
    FSDP2). Works on an HF model, a ``ScalarModel`` (its backbone) and a peft model. Gradients are equal
    to those without it (tested); HF checkpoints only in ``train()`` mode.
    """
    target = unwrap(model)
    for m in (target, getattr(target, "backbone", None), getattr(target, "base_model", None)):
        if m is not None and hasattr(m, "gradient_checkpointing_enable"):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model
    raise ShifuError(
        f"gradient checkpointing: {type(target).__name__} has no gradient_checkpointing_enable(); "
        "use a Hugging Face model or set gradient_checkpointing=false"
    )


@contextlib.contextmanager
def offload_frozen(model: nn.Module, device: torch.device | str | None = None) -> Iterator[nn.Module]:
    """Keep a frozen model on the CPU; move it to ``device`` (default :func:`local_device`) for the block.

    ``with offload_frozen(ref) as m: ref_logits = m(...)`` — the model goes back to the CPU on exit, so
    between its forwards it costs no accelerator memory (at the price of two host-device copies). A no-op
    when the device is the CPU.
    """
    device = torch.device(device) if device is not None else local_device()
    if device.type == "cpu":
        yield model
        return
    model.to(device, non_blocking=True)
    try:
        yield model
    finally:
        model.to("cpu")

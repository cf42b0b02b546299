"""DDP and FSDP2 under ``torchrun`` (gloo on CPU, NCCL on GPU): the multi-process Strategy and its checkpoint
format.

:class:`DistributedStrategy` overrides what differs from one process: the collectives run over the process
group (:mod:`shifu.parallel.distributed`), trained models are wrapped (``ddp``: a
``DistributedDataParallel`` wrapper; ``fsdp2``: ``fully_shard`` on each transformer block, then on the
root), frozen models replicated or sharded, and the checkpoints of sharded models hold every rank's shards.
:class:`shifu.parallel.deepspeed.DeepSpeedStrategy` builds on it.

**Checkpoint format** (owned here; ``shifu.runs.checkpoint`` writes the run directory around it):

- ``ddp``: the plain checkpoint of one process (every rank holds whole models), written by rank 0, plus
  every rank's RNG states (``rng_ranks`` in ``state.json``);
- ``fsdp2``: ``sharded/<name>/`` per optimiser, a ``torch.distributed.checkpoint`` directory of the model
  and optimiser state (:func:`save_sharded`) that every rank writes its part of; the schedules and the JSON
  state as in one process. DCP reshards on load, so a sharded checkpoint may be read by another world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

import shifu.parallel.distributed as D
from shifu import core
from shifu.errors import ShifuError
from shifu.parallel.strategy import Strategy, T, Trained
from shifu.runs import checkpoint as ckpt
from shifu.runs import rng

TrainStrategy = Literal["none", "ddp", "fsdp2"]
FrozenStrategy = Literal["replicate", "fsdp2"]


class DistributedStrategy(Strategy):
    """DDP (``strategy=ddp``) or FSDP2 (``fsdp2``) under torchrun, gloo on CPU, NCCL on GPU."""

    # ------------------------------------------------------------------------------------ processes
    @property
    def world(self) -> int:
        return D.world_size()

    @property
    def rank(self) -> int:
        return D.rank()

    @property
    def is_main(self) -> bool:
        return D.is_main()

    def launch(self, device: str) -> torch.device:
        self.device = D.init(timeout_s=self.cfg.timeout_s)
        return self.device

    def rank_seed(self, seed: int) -> int:
        return D.rank_seed(seed)

    def on_main(self, fn):
        answer: Any = None
        if self.is_main:
            try:
                answer = fn()
            except ShifuError as e:
                answer = e
        answer = self.broadcast(answer)
        if isinstance(answer, ShifuError):
            raise answer
        return answer

    def seed_per_rank(self, seed: int) -> None:
        torch.manual_seed(D.rank_seed(seed))

    def close(self) -> None:
        D.destroy()

    # ------------------------------------------------------------------------------------ models
    def _place_trained(self, model: nn.Module) -> nn.Module:
        return wrap_trainable(model, self.cfg.strategy)

    def _place_frozen(self, model: nn.Module) -> nn.Module:
        return prepare_frozen(model, self.cfg.frozen)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def whole(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = self.unwrap(model)
        if not isinstance(model, FSDPModule):
            return model
        # FSDP2: every rank all-gathers the full state into a plain copy of the model's own class
        base = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        return self._whole_copy(model, base, full_state_dict(model, rank0_only=False))

    def _whole_copy(self, model: nn.Module, base: type, state: dict[str, torch.Tensor]) -> nn.Module:
        """A plain ``base(model.config)`` holding ``state``, kept per model and refreshed on each call."""
        copies = self.__dict__.setdefault("_whole_copies", {})
        clone = copies.get(id(model))
        if clone is None:
            dtype = next(v.dtype for v in state.values() if v.is_floating_point())
            clone = base(model.config).to(dtype).eval().requires_grad_(False)
            copies[id(model)] = clone
        return load_whole(clone, state).to(self.device)

    def generation_kwargs(self) -> dict[str, Any]:
        # ranks keep stepping until every rank's responses ended (sharded forwards never deadlock); the
        # fast decoder reads whole weights, so sharded models generate through HF forwards
        return {"all_done": D.all_true, "engine": "hf" if self.sharded else "auto"}

    @property
    def sharded(self) -> bool:
        return self.cfg.strategy != "ddp"

    # ------------------------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def accumulating(self, trained: list[Trained], sync: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if not sync:
                for t in trained:
                    stack.enter_context(grad_sync(t.model, False))
            yield

    def clip_grad_norm(self, t: Trained) -> torch.Tensor:
        # clip_grad_norm_ reduces the norm of sharded / replicated gradients over the ranks itself
        params = [p for p in t.params if p.grad is not None]
        limit = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)

    # ------------------------------------------------------------------------------------ numbers
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return D.all_reduce_sum(t.double())

    def any_true(self, flag: bool) -> bool:
        return D.any_true(flag)

    def largest(self, n: int) -> int:
        return D.largest(n)

    def barrier(self) -> None:
        D.barrier()

    def gather(self, obj: Any) -> list[Any]:
        return D.gather_object(obj)

    def broadcast(self, obj: Any) -> Any:
        return D.broadcast_object(obj)

    def token_mean_divisor(self, n_local: torch.Tensor) -> torch.Tensor:
        # N_global / W: DDP, FSDP2 and ZeRO average gradients over the W ranks (shifu.parallel.distributed)
        return D.token_mean_divisor(n_local)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        s = D.all_reduce_sum(torch.stack([x.sum().double(), torch.tensor(x.numel(), dtype=torch.float64)]))
        return (s[0] / s[1]).to(x.dtype)

    def batch_means(self, terms: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, float]:
        sums: dict[str, float | torch.Tensor] = {}
        for k, (x, m) in terms.items():
            sums[k] = x.sum() if m is None else core.masked_sum(x, m)
            sums[k + "#n"] = float(x.numel()) if m is None else m.sum()
        total = D.reduce_metrics(sums, op="sum")
        return {k: total[k] / max(total[k + "#n"], 1.0) for k in terms}

    def mean_over_ranks(self, values: dict[str, float | torch.Tensor]) -> dict[str, float]:
        return D.reduce_metrics(values, op="mean")

    def batch_sums(self, terms: dict[str, float | torch.Tensor]) -> dict[str, float]:
        return D.reduce_metrics(terms, op="sum")

    def share(self, items: list[T]) -> tuple[list[T], bool]:
        # the strided slice items[rank::W]; a rank left without items (a short last batch) runs the
        # first item with weight 0, so every rank runs the same forwards and collectives
        mine = items[self.rank :: self.world]
        return (mine, True) if mine else (items[:1], False)

    # ------------------------------------------------------------------------------------ files
    def save_checkpoint(self, run_dir, step, trained, modules, json_state, keep_last) -> None:
        json_state = {**json_state, "rng_ranks": self.gather(rng.rng_state())}
        if not self.sharded:  # every rank holds whole models: rank 0 writes the one-process checkpoint
            if self.is_main:
                super().save_checkpoint(run_dir, step, trained, modules, json_state, keep_last)
            self.barrier()
            return
        # every rank writes its shards of weights and optimiser state; rank 0 adopts them as sharded/
        shards = ckpt.shards_staging_dir(run_dir, step)
        for name, t in trained.items():
            self._save_shards(shards / name, t)
        self.barrier()
        if self.is_main:
            tensors = {name: {"scheduler": t.scheduler.state_dict()} for name, t in trained.items()}
            json_state = {**json_state, "rng": rng.rng_state()}
            ckpt.save_checkpoint(run_dir, step, {}, tensors, json_state, keep_last=keep_last, shards=shards)
        self.barrier()

    def load_checkpoint(self, path, trained, modules) -> dict[str, Any]:
        if not self.sharded:
            js = super().load_checkpoint(path, trained, {k: self.unwrap(m) for k, m in modules.items()})
        else:
            tensors, js = ckpt.load_checkpoint(path, {})
            for name, t in trained.items():
                shards = Path(path) / ckpt.SHARDED_DIR / name
                if not shards.is_dir():
                    raise ShifuError(
                        f"checkpoint '{path}' has no sharded weights for '{name}': it was written with another "
                        f"distributed.strategy than {self.cfg.strategy}; resume it with the strategy it was "
                        "written with"
                    )
                self._load_shards(shards, t)
                t.scheduler.load_state_dict(tensors[name]["scheduler"])
        ranks = js.get("rng_ranks")
        rng.set_rng_state(ranks[self.rank] if ranks and len(ranks) == self.world else js["rng"])
        return js

    def _save_shards(self, path: Path, t: Trained) -> None:
        """This rank's part of one optimiser's model and optimiser state, into ``path`` (every rank)."""
        save_sharded(path, t.model, t.optimizer)

    def _load_shards(self, path: Path, t: Trained) -> None:
        """Read what :meth:`_save_shards` wrote into the wrapped model and its optimiser, in place."""
        load_sharded(path, t.model, t.optimizer)

    def full_model(self, model, fresh, everywhere=False):
        if not self.sharded:
            return self.unwrap(model)
        sd = self._full_state_dict(model, rank0_only=not everywhere)
        if not (everywhere or self.is_main):
            return None
        plain = fresh()
        plain.load_state_dict(sd)
        return plain

    def _full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        """The complete weights of a sharded trained model on CPU (every rank calls it)."""
        return full_state_dict(model, rank0_only)

    def load_full_state_dict(self, model, state_dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.unwrap(model), state_dict, options=opts)


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


def _fully_shard(model: nn.Module, bf16: bool, cpu_offload: bool) -> nn.Module:
    """``fully_shard`` each block, then the root (embeddings, final norm, (tied) head, scalar head), after
    copying rank 0's weights to every rank; blocks re-shard after their forward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    model = model.to(D.local_device())
    D.broadcast_module(model)
    kwargs: dict[str, Any] = {"reshard_after_forward": True}
    if bf16:
        # compute in bf16, reduce gradients in fp32 (the sharded master weights stay fp32)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs["offload_policy"] = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_trainable(
    model: nn.Module, strategy: TrainStrategy, bf16: bool = False, cpu_offload: bool = False
) -> nn.Module:
    """Prepare a trained model (actor, critic, SFT policy, reward model) on this rank's device.

    - ``none``: moved to the local device, nothing else.
    - ``ddp``: ``DistributedDataParallel`` (rank 0's weights broadcast at construction). Call the trained
      model through the wrapper; reach HF methods (``generate``) through ``wrapped.module``.
    - ``fsdp2``: ``fully_shard`` on each transformer block, then on the root. The model keeps its class
      and methods (``generate`` works; each block all-gathers its weights in its forward). Rank 0's
      weights are broadcast first. ``bf16`` computes in bf16 with fp32 gradient reduction;
      ``cpu_offload`` keeps the sharded parameters, gradients and optimiser state on the CPU (GPU runs).

    Build the optimiser *after* wrapping (FSDP2 replaces parameters by sharded DTensors).
    """
    if strategy not in ("none", "ddp", "fsdp2"):
        raise ShifuError(f"unknown distributed strategy '{strategy}' (use none, ddp or fsdp2)")
    device = D.local_device()
    if strategy == "none" or not D.is_distributed():
        return model.to(device)
    if strategy == "ddp":
        model = model.to(device)
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return _fully_shard(model, bf16=bf16, cpu_offload=cpu_offload)


def prepare_frozen(model: nn.Module, strategy: FrozenStrategy = "replicate") -> nn.Module:
    """A frozen model (reference, reward model) in eval mode with ``requires_grad=False``.

    ``replicate``: a full copy on every rank's device (each rank loads the same directory).
    ``fsdp2``: sharded like a trained model (1/W of its memory per rank; every forward all-gathers, so
    all ranks must call its forward the same number of times).
    """
    if strategy not in ("replicate", "fsdp2"):
        raise ShifuError(f"unknown frozen-model strategy '{strategy}' (use replicate or fsdp2)")
    model.eval().requires_grad_(False)
    if strategy == "replicate" or not D.is_distributed():
        return model.to(D.local_device())
    return _fully_shard(model, bf16=False, cpu_offload=False)


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
# the sharded checkpoint format (torch.distributed.checkpoint)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: the (sharded) state dicts DCP saves and loads in place."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    return {"model": model_sd} | ({"optim": optim_sd} if optimizer is not None else {})


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Model (+ optimiser) state with ``torch.distributed.checkpoint``: each rank writes its own shard.

    Call on every rank, with the same ``path`` (a shared filesystem). Works for plain, DDP and FSDP2
    models and in a single process. :meth:`DistributedStrategy.save_checkpoint` writes into the staging
    directory that ``shifu.runs.checkpoint`` then moves in atomically.
    """
    import torch.distributed.checkpoint as dcp

    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what :func:`save_sharded` wrote into an already wrapped ``model`` (and ``optimizer``) in place.

    The world size may differ from the one that saved (DCP reshards on load).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not (Path(path) / ".metadata").exists():
        raise ShifuError(
            f"'{path}' is not a sharded checkpoint (no .metadata): was it written by save_sharded?"
        )
    state = _state(model, optimizer)
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

    opts = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = get_model_state_dict(model, options=opts)
    return sd if rank0_only else {k: v.detach().cpu() for k, v in sd.items()}


@torch.no_grad()
def load_whole(clone: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """``state`` (whole weights) into ``clone``; a weight tied to another (an LM head to its embedding) may be
    absent from it, any other missing one is an error."""
    missing, _ = clone.load_state_dict(state, strict=False)
    if getattr(clone, "tie_weights", None) is not None:
        clone.tie_weights()
    kept = dict(clone.named_parameters())  # (a tied weight is named once)
    lost = [k for k in missing if k in kept]
    if lost:
        raise ShifuError(
            f"the gathered weights lack {lost[:3]}: cannot sample from a whole copy of the actor"
        )
    return clone

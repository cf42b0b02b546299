"""The Strategy interface, and its one-process backend: what a trainer asks of the processes it runs on.

The trainers never branch on the number of processes or the backend; they ask the strategy (built once by
:func:`shifu.parallel.build_strategy`) for every step that differs between backends:

- **models**: :meth:`Strategy.wrap` a trained model (DDP wrapper, ``fully_shard``, or as is),
  :meth:`~Strategy.frozen` a reference / reward model (replicated or sharded, optionally kept on the CPU),
  :meth:`~Strategy.optimize` builds the optimiser and schedule of trained models: for every backend with
  :func:`build_optimizer` (a DeepSpeed engine then wraps that one optimiser);
- **the step**: :meth:`~Strategy.backward` (gradient sync suppressed on all but the last micro-batch),
  :meth:`~Strategy.optimizer_step` (clip, skip a non-finite step on every rank alike, schedule);
- **numbers**: global sums, means and token counts (:meth:`~Strategy.token_mean_divisor`,
  :meth:`~Strategy.batch_means`, ``reduce`` for :func:`shifu.core.masked_whiten`), flags agreed by every
  rank, this rank's share of a batch;
- **files**: complete checkpoints (plain weights, or every rank's shards) and the full weights of a
  trained model for ``final/``.

:class:`Strategy` is one process: models stay as they are and every collective returns its input (also
inside a torchrun job, as the one-process reference of a test). The torchrun backends override what
differs (:mod:`shifu.parallel.torchrun` for DDP/FSDP2, :mod:`shifu.parallel.deepspeed` for ZeRO) through
the hooks ``_place_trained``, ``_place_frozen`` and ``_attach``; the rest of each public method is shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shifu import core
from shifu.config.sections import DistributedConfig, OptimConfig
from shifu.errors import ConfigError, ShifuError
from shifu.runs import checkpoint as ckpt
from shifu.runs import rng

T = TypeVar("T")


@dataclasses.dataclass
class Trained:
    """One optimiser and what it moves: ``model`` is what training forwards call (a DDP wrapper, an FSDP2
    module, a DeepSpeed engine, or the model itself); ``params`` every parameter the optimiser steps (also
    other modules': a value head, a jointly optimised critic), in the order their gradient norm is summed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_grad_norm: float | None
    params: list[nn.Parameter]


class Strategy:
    """One process: models stay as they are, every collective returns its input."""

    def __init__(self, cfg: DistributedConfig):
        self.cfg = cfg
        self.device = torch.device("cpu")
        # the gradient norm (before clipping) of the last step's first optimiser
        self.grad_norm = float("nan")

    # ------------------------------------------------------------------------------------ processes
    def launch(self, device: str) -> torch.device:
        """This process's device (``auto``: CUDA when available)."""
        self.device = resolve_device(device)
        return self.device

    world, rank, is_main = 1, 0, True  # (also inside a torchrun job: a one-process reference computation)

    def free_memory(self) -> int | None:
        """Bytes free for new tensors on this process's device: CUDA's free memory, or the kernel's
        MemAvailable on CPU (Linux); None where neither can be read."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None

    def rank_seed(self, seed: int) -> int:
        """A sampling seed of this rank's own (``seed`` on rank 0)."""
        return seed

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 only; its result (or its ShifuError) reaches every rank."""
        return fn()

    def seed_per_rank(self, seed: int) -> None:
        """Reseed the global RNG with this rank's own stream (dropout differs per rank); one process keeps
        its stream as it is."""

    def close(self) -> None:
        """Leave the process group (a no-op in one process)."""

    # ------------------------------------------------------------------------------------ models
    def wrap(self, model: nn.Module) -> nn.Module:
        """A trained model ready for training forwards on this rank's device (call before :meth:`optimize`),
        with gradient checkpointing when the config asks for it."""
        if self.cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return self._place_trained(model)

    def _place_trained(self, model: nn.Module) -> nn.Module:
        """The backend's placement of a trained model: here moved to this device."""
        return model.to(self.device)

    def frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model (reference, reward model): eval mode, no gradients, placed by the backend (on the
        CPU between forwards with ``offload_frozen``: see :meth:`offloaded`)."""
        model.eval().requires_grad_(False)
        if self.cfg.offload_frozen:  # (always a whole copy: the config refuses it with frozen=fsdp2)
            return model.to("cpu")
        return self._place_frozen(model)

    def _place_frozen(self, model: nn.Module) -> nn.Module:
        """The backend's placement of a frozen model: here moved to this device."""
        return model.to(self.device)

    @contextlib.contextmanager
    def offloaded(self, model: nn.Module | None) -> Iterator[nn.Module | None]:
        """``model`` on this device for the block (moved in from the CPU with ``offload_frozen``)."""
        if model is None or not self.cfg.offload_frozen:
            yield model
            return
        with offload_frozen(model, self.device) as m:
            yield m

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside a backend's wrapper (for no-grad forwards, generation and plain weights);
        one process wraps nothing."""
        return model

    def whole(self, model: nn.Module) -> nn.Module:
        """``model`` with whole weights on this rank, to sample from off-step (an agent's gateway answers its
        calls as they come, never in lockstep with the other ranks): the unwrapped model where every rank holds
        whole weights; a sharded backend's gathered copy (call on every rank, at the same point)."""
        return self.unwrap(model)

    def optimize(self, model: nn.Module, params, optim: OptimConfig, total_steps: int) -> Trained:
        """AdamW over ``params`` (the wrapped ``model``'s and any extra module's) and its schedule: the one
        place an optimiser is built, for every backend (:meth:`_attach` hands it to the backend)."""
        params = [p for p in params if p.requires_grad]
        optimizer = build_optimizer(params, optim)
        scheduler = build_scheduler(optimizer, optim, total_steps)
        return self._attach(Trained(model, optimizer, scheduler, optim.max_grad_norm, params))

    def _attach(self, trained: Trained) -> Trained:
        """What the backend makes of a model and its optimiser (a DeepSpeed engine); here nothing."""
        return trained

    def generation_kwargs(self) -> dict[str, Any]:
        """Extra arguments of :func:`shifu.generation.rollout.sample` (synced loops under torchrun)."""
        return {}

    @property
    def sharded(self) -> bool:
        """True when no rank holds whole trained models: checkpoints then hold every rank's shards."""
        return False

    # ------------------------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def accumulating(self, trained: list[Trained], sync: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: ``sync=False`` (every micro-batch of a step but
        the last) keeps its gradients local; the last micro-batch's backward reduces them over ranks.
        One process has nothing to reduce."""
        yield

    def backward(self, parts: list[tuple[Trained, torch.Tensor]]) -> None:
        """Back-propagate one micro-batch's losses: ``parts`` = (optimiser, the loss of what it trains),
        summed in order (a DeepSpeed engine back-propagates its own part)."""
        loss = parts[0][1]
        for _, more in parts[1:]:
            loss = loss + more
        loss.backward()

    def optimizer_step(self, trained: list[Trained], finite: bool = True) -> bool:
        """Clip each optimiser's gradient norm, then step every optimiser, or none: a NaN/Inf loss
        (``finite=False`` on any rank) or gradient norm skips the step everywhere (weights and Adam moments
        untouched). The schedules advance and the gradients are cleared either way. Returns whether the
        step was taken."""
        norms = [self.clip_grad_norm(t) for t in trained]
        self.grad_norm = float(_full(norms[0]))
        finite = finite and bool(torch.isfinite(torch.stack([_local(n).float() for n in norms])).all())
        finite = not self.any_true(not finite)  # every rank takes the same decision
        for t in trained:
            if finite:
                t.optimizer.step()
            t.scheduler.step()
            t.optimizer.zero_grad(set_to_none=True)
        return finite

    def clip_grad_norm(self, t: Trained) -> torch.Tensor:
        """The gradient norm of one optimiser's parameters, scaled down to ``max_grad_norm`` when over it.
        One fused norm per optimiser decides both the clipping and whether the step is finite."""
        params = [p for p in t.params if p.grad is not None]
        limit = t.max_grad_norm if t.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if float(norm) > limit:
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm, foreach=True)
        return norm

    # ------------------------------------------------------------------------------------ numbers
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over ranks (float64 across ranks); ``t`` itself in one process."""
        return t

    def any_true(self, flag: bool) -> bool:
        """True if ``flag`` is true on any rank (every rank must call it)."""
        return bool(flag)

    def largest(self, n: int) -> int:
        """The largest of every rank's ``n`` (every rank must call it): one process, ``n``."""
        return n

    def barrier(self) -> None:
        """Wait for every rank."""

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def token_mean_divisor(self, n_local: torch.Tensor) -> torch.Tensor:
        """Divide a local loss *sum* by this for the global mean: the local count here (at least 1)."""
        return n_local.clamp(min=1)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of every element of ``x`` on every rank (a 0-dim tensor of ``x``'s dtype)."""
        return x.mean()

    def batch_means(self, terms: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, float]:
        """``{name: (x, mask)}`` -> the mean of each ``x`` over its real elements (``mask`` None: all of
        them) on every rank, as floats; one collective for all of them under torchrun."""
        return {k: float(x.mean() if m is None else core.masked_mean(x, m)) for k, (x, m) in terms.items()}

    def mean_over_ranks(self, values: dict[str, float | torch.Tensor]) -> dict[str, float]:
        """The mean over ranks of each scalar, as floats (one collective under torchrun)."""
        return {k: float(v) for k, v in values.items()}

    def batch_sums(self, terms: dict[str, float | torch.Tensor]) -> dict[str, float]:
        """Sums of scalars over ranks, as floats (one collective under torchrun)."""
        return {k: float(v) for k, v in terms.items()}

    def share(self, items: list[T]) -> tuple[list[T], bool]:
        """This rank's share of a global micro-batch and whether it is real (all of it, in one process)."""
        return items, True

    # ------------------------------------------------------------------------------------ files
    def save_checkpoint(
        self,
        run_dir: Path,
        step: int,
        trained: dict[str, Trained],
        modules: dict[str, nn.Module],
        json_state: dict[str, Any],
        keep_last: int,
    ) -> None:
        """A complete checkpoint (call on every rank): the plain weights of ``modules``, each optimiser's
        and schedule's state (``trained``), ``json_state`` plus every RNG state; rank 0 writes."""
        tensors = {
            name: {"optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict()}
            for name, t in trained.items()
        }
        json_state = {**json_state, "rng": rng.rng_state()}
        ckpt.save_checkpoint(run_dir, step, modules, tensors, json_state, keep_last=keep_last)

    def load_checkpoint(
        self, path: Path, trained: dict[str, Trained], modules: dict[str, nn.Module]
    ) -> dict[str, Any]:
        """Load a :meth:`save_checkpoint` into the models and optimisers in place, restore this rank's RNG
        states; returns the JSON state."""
        tensors, js = ckpt.load_checkpoint(path, modules)
        for name, t in trained.items():
            t.optimizer.load_state_dict(tensors[name]["optimizer"])
            t.scheduler.load_state_dict(tensors[name]["scheduler"])
        rng.set_rng_state(js["rng"])
        return js

    def full_model(self, model: nn.Module, fresh: Callable[[], nn.Module], everywhere: bool = False):
        """A plain module with the complete trained weights of ``model``: the model itself when this rank
        holds all of it, else the gathered weights loaded into ``fresh()``; None on ranks that need none
        (every rank but 0, unless ``everywhere``). Call on every rank."""
        return self.unwrap(model)

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Load complete weights (present on every rank) into a trained model."""
        self.unwrap(model).load_state_dict(state_dict)


# ------------------------------------------------------------------------------------------------ optimiser


def decay_groups(params: list) -> tuple[list, list]:
    """(matrices, vectors): weight decay applies to the first group only (biases, norms are not decayed).
    A ZeRO-3 parameter is an empty placeholder for its shard: its own shape is ``ds_shape``."""
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    return [p for p, m in zip(params, matrix) if m], [p for p, m in zip(params, matrix) if not m]


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (:func:`decay_groups`): the optimiser of every backend.

    Under DeepSpeed the engine wraps this optimiser (its partitions become the parameters it steps); with
    ZeRO's optimiser offload it steps the partitions' CPU copies, fused on the CPU."""
    params = [p for p in params if p.requires_grad]
    decay, no_decay = decay_groups(params)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused (one kernel for the whole update) where torch has it: plain float tensors on CPU/CUDA; else
    # foreach. The per-parameter loop dominated small models' optimiser time in the PPO benchmark.
    fused = all(
        not hasattr(p, "to_local")
        and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16)
        for p in params
    )
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kind)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up to lr, then constant / linear / cosine decay to ``min_lr_ratio * lr``."""
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        if cfg.schedule == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ------------------------------------------------------------------------------------------------ memory


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in the backward pass instead of storing them.

    Uses the HF API with non-reentrant checkpoints (correct with frozen inputs, e.g. LoRA, and with
    FSDP2). Works on an HF model, a ``ScalarModel`` (its backbone) and a peft model, before any backend
    wraps it (:meth:`Strategy.wrap` calls it first). Gradients are equal to those without it (tested); HF
    checkpoints only in ``train()`` mode.
    """
    kwargs = {"use_reentrant": False, "context_fn": _recompute_as_forward}
    for m in (model, getattr(model, "backbone", None), getattr(model, "base_model", None)):
        if m is not None and hasattr(m, "gradient_checkpointing_enable"):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            return model
    raise ShifuError(
        f"gradient checkpointing: {type(model).__name__} has no gradient_checkpointing_enable(); "
        "use a Hugging Face model or set gradient_checkpointing=false"
    )


def _recompute_as_forward() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A checkpoint's ``context_fn``, called in the forward: the recomputation in the backward pass runs with the
    attention backends the forward had. The trainers' CPU bf16 autocast selects SDPA's math backend inside its
    block (:func:`shifu.trainers.common.autocast`) and the backward runs after it; recomputed with another
    backend, attention saves other tensors and torch refuses the recomputation."""
    flags = (
        (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
        (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled()),
    )
    return contextlib.nullcontext(), sdpa_kernel([backend for backend, on in flags if on])


@contextlib.contextmanager
def offload_frozen(model: nn.Module, device: torch.device | str) -> Iterator[nn.Module]:
    """Keep a frozen model on the CPU; move it to ``device`` for the block.

    ``with offload_frozen(ref, device) as m: ref_logits = m(...)`` — the model goes back to the CPU on
    exit, so between its forwards it costs no accelerator memory (at the price of two host-device copies).
    A no-op when the device is the CPU.
    """
    device = torch.device(device)
    if device.type == "cpu":
        yield model
        return
    model.to(device, non_blocking=True)
    try:
        yield model
    finally:
        model.to("cpu")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; a named CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but no CUDA device is available; use device=cpu or auto")
    return torch.device(name)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of an FSDP2 DTensor (the tensor itself otherwise)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

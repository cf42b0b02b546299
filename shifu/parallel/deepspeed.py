"""DeepSpeed ZeRO-2/3 under ``torchrun`` (``distributed.strategy=deepspeed``; optional:
``pip install 'shifu-rlhf[deepspeed]'``): the Strategy whose engines do the backward and the step, its JSON
config, ZeRO-3's sharded model construction and its checkpoint format.

**One optimiser.** The engine wraps the AdamW that :meth:`Strategy.optimize` builds for every backend
(:func:`shifu.parallel.strategy.build_optimizer`) and steps it; the schedule stays shifu's, on that same
optimiser. A config's own ``optimizer`` or ``scheduler`` section is refused (it would be a second one).
With ``offload_optimizer`` the engine steps that AdamW on the CPU copies of its fp32 partitions
(``zero_force_ds_cpu_optimizer`` false): exactly one optimiser is built, and the state checkpointed is the
state that steps.

**Checkpoint format** (owned here; ``shifu.runs.checkpoint`` writes the run directory around it):
``sharded/<name>/`` per optimiser is the engine's own checkpoint directory (``save_checkpoint`` with tag
``shards``: every rank's partition of the weights and optimiser state), read back by the engine's
``load_checkpoint``; the schedules, RNG states and JSON state as under DDP/FSDP2. Resume with the same
number of processes.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shifu.parallel.distributed as D
from shifu.errors import ConfigError, ShifuError
from shifu.parallel.strategy import Trained
from shifu.parallel.torchrun import DistributedStrategy

SHARDS_TAG = "shards"  # the engine's checkpoint tag inside sharded/<name>/


class DeepSpeedStrategy(DistributedStrategy):
    """DeepSpeed ZeRO-2/3 (``strategy=deepspeed``): engines own the partitioned optimiser states and do the
    backward and the step; frozen models, collectives and the run directory are as under DDP."""

    def zero3_init(self):
        """Keep the returned object alive while trained HF models are built: under ZeRO-3 their weights are
        created directly as shards."""
        return zero3_init(self.cfg.deepspeed_config)

    def _place_trained(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)  # the engine is built around it with its optimiser (_attach)

    def _attach(self, trained: Trained) -> Trained:
        engine, ds_optimizer = wrap_engine(
            trained.model, trained.optimizer, self.cfg.deepspeed_config, trained.max_grad_norm
        )
        return Trained(engine, ds_optimizer, trained.scheduler, trained.max_grad_norm, trained.params)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if is_engine(model) else model

    @property
    def sharded(self) -> bool:
        return True

    def whole(self, model: nn.Module) -> nn.Module:
        model = self.unwrap(model)
        if not any(hasattr(p, "ds_id") for p in model.parameters()):
            return model  # ZeRO-2: every rank holds whole weights
        # ZeRO-3: every rank gathers the partitioned weights into a plain copy
        with _deepspeed().zero.GatheredParameters(list(model.parameters())):
            state = {k: v.detach().clone().cpu() for k, v in model.named_parameters()}
        state |= {k: v.detach().clone().cpu() for k, v in model.named_buffers()}
        return self._whole_copy(model, type(model), state)

    def backward(self, parts) -> None:
        for trained, loss in parts:  # each engine back-propagates its own (disjoint) part
            trained.model.backward(loss)

    def optimizer_step(self, trained, finite=True) -> bool:
        # the engines clip (gradient_clipping from optim.max_grad_norm) and step; a NaN/Inf loss on any
        # rank drops the accumulated gradients instead
        finite = not self.any_true(not finite)
        for t in trained:
            if finite:
                t.model.step()
                self.grad_norm = float(trained[0].model.get_global_grad_norm() or float("nan"))
            else:
                t.optimizer.zero_grad()
            t.scheduler.step()
        return finite

    def _save_shards(self, path: Path, t: Trained) -> None:
        t.model.save_checkpoint(str(path), tag=SHARDS_TAG)

    def _load_shards(self, path: Path, t: Trained) -> None:
        t.model.load_checkpoint(str(path), tag=SHARDS_TAG)

    def _full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        if model.zero_optimization_partition_weights():  # ZeRO-3: gather the 16-bit shards on rank 0
            sd = model._zero3_consolidated_16bit_state_dict()
            sd = {k: v.detach().float().cpu() for k, v in (sd or {}).items()}
        else:
            sd = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
        return sd if (self.is_main or not rank0_only) else {}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        if not is_engine(model):
            return super().load_full_state_dict(model, state_dict)
        if model.zero_optimization_partition_weights():
            load_partitioned(self.unwrap(model), state_dict, self.is_main)
        else:
            self.unwrap(model).load_state_dict(state_dict)
        # the optimiser steps fp32 master copies of the weights: without this its next step (and the
        # checkpoint, which holds them) would bring the old weights back
        model.optimizer.refresh_fp32_params()


def _deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: DeepSpeed picks its backend then
    try:
        import deepspeed
    except ImportError:
        raise ShifuError("DeepSpeed is not installed: pip install 'shifu-rlhf[deepspeed]'") from None
    if D.is_main():
        for line in stale_build_locks():
            print(line, file=sys.stderr, flush=True)
    return deepspeed


STALE_LOCK_S = 600  # a build of one of DeepSpeed's ops takes a minute or two


def stale_build_locks(now: float | None = None) -> list[str]:
    """A warning per build lock older than :data:`STALE_LOCK_S` in torch's extensions folders
    (``TORCH_EXTENSIONS_DIR``, else torch's default build root). DeepSpeed builds some of its ops there on first
    use (on CPU its shared-memory collectives), and a build killed midway leaves its ``lock`` behind: every later
    launch then waits on it forever, without a word."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    out = []
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # built and released meanwhile
            continue
        if age > STALE_LOCK_S:
            out.append(
                f"shifu: warning: {lock} is a build lock left {age / 60:.0f} min ago; DeepSpeed waits on it "
                "forever. If no other process is building that op now (a build killed midway leaves its lock), "
                "delete the file."
            )
    return out


def load_config(ds_config: str | Path | dict, max_grad_norm: float | None = None) -> dict[str, Any]:
    """A DeepSpeed config dict from a JSON file (or a dict), with shifu's settings filled in.

    shifu's loop owns batching and accumulation, so ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` default to 1; ``gradient_clipping`` defaults to ``max_grad_norm``
    (``optim.max_grad_norm``; None: 0, no clipping). The optimiser and its schedule are shifu's for every
    backend: an ``optimizer`` or ``scheduler`` section is refused, and with ``offload_optimizer`` the
    engine is told to step shifu's AdamW on the CPU (``zero_force_ds_cpu_optimizer: false``).
    """
    where = "a DeepSpeed config given as a dict"
    if isinstance(ds_config, dict):
        cfg = copy.deepcopy(ds_config)
    else:
        path = Path(ds_config)
        where = f"DeepSpeed config '{path}'"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ShifuError(f"DeepSpeed config '{path}' does not exist") from None
        except json.JSONDecodeError as e:
            raise ShifuError(f"{where}, line {e.lineno}: not valid JSON ({e.msg})") from None
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ConfigError(
                f'{where} has a "{section}" section, but shifu builds the optimiser and its schedule '
                "for every backend from optim.* (AdamW: lr, betas, eps, weight_decay; warmup_steps, "
                f'schedule): remove the "{section}" section and set those keys instead'
            )
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.setdefault("steps_per_print", 10**9)  # shifu's tracker logs; keep DeepSpeed quiet
    cfg.setdefault("gradient_clipping", max_grad_norm if max_grad_norm is not None else 0.0)  # 0: off
    if "offload_optimizer" in cfg.get("zero_optimization", {}):
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)  # shifu's AdamW steps the CPU partitions
    return cfg


def wrap_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ds_config: str | Path | dict,
    max_grad_norm: float | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(engine, its optimizer)`` for a trained model and the optimiser built for it, under DeepSpeed ZeRO
    (stage, offload from the config; see :func:`load_config`).

    Call the engine like the model; the strategy trains with ``engine.backward`` / ``engine.step``.
    Gradients are averaged over ranks as with DDP, so ``token_mean_divisor`` applies unchanged. For
    ZeRO-3, build HF models inside :func:`zero3_init` so weights load straight into shards.
    """
    deepspeed = _deepspeed()
    cfg = load_config(ds_config, max_grad_norm)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        cfg.setdefault("zero_allow_untested_optimizer", True)  # (the tests step SGD through an engine)
    if not D.is_distributed():
        D.init()
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine, ds_optimizer


def zero3_init(ds_config: str | Path | dict) -> Any:
    """Keep the returned object alive while calling ``from_pretrained``: under ZeRO-3 transformers then
    creates each weight directly as a shard (no full copy per rank) and loads the checkpoint into it."""
    _deepspeed()
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(load_config(ds_config))


def load_partitioned(module: nn.Module, state_dict: dict[str, torch.Tensor], main: bool) -> None:
    """Load complete weights into a ZeRO-3 module (call on every rank; rank 0's ``state_dict`` is the one
    read): each weight is gathered, overwritten and partitioned again, one at a time, so no rank ever holds
    the whole model. Keys must match as for ``load_state_dict(strict=True)``."""
    deepspeed = _deepspeed()
    params = dict(module.named_parameters())  # a tied weight once, under its first name
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ShifuError(
            f"the weights to load do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, p in params.items():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if main:
                p.copy_(state_dict[name])
    with torch.no_grad():
        for name, b in module.named_buffers():  # buffers are whole on every rank
            if name in state_dict:
                b.copy_(state_dict[name])


def is_engine(model: nn.Module) -> bool:
    """Whether ``model`` is a DeepSpeed engine (tested by name: DeepSpeed stays unimported until used)."""
    return type(model).__name__ == "DeepSpeedEngine"

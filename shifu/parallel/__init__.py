"""Where a run executes: one Strategy per backend, chosen by :func:`build_strategy` — one process
(``strategy.py``, also the interface), DDP/FSDP2 under torchrun (``torchrun.py``) and DeepSpeed ZeRO
(``deepspeed.py``) — each placing models, building the optimiser through the one ``build_optimizer`` and
owning its own checkpoint format; the process group and its collectives (``distributed.py``); ``shifu
launch``, torchrun with the exit status of a signal (``launch.py``); the bf16 precision probe, CPU
threads, and independent work side by side in forked processes (``forked.py``). Only this wing imports
torch.distributed. Checkpoints flow downward: the strategy decides what state there is and writes its
backend's shards into a staging directory that ``shifu.runs.checkpoint`` names, then hands everything to
``runs.checkpoint``, the one writer of the run directory (atomic rename, manifest, ``latest``,
``keep_last``), which moves the shards in as ``sharded/`` without reading them. The other direction would
need the lower ``runs`` wing to know every backend, or to call back into this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shifu.config.sections import DistributedConfig
    from shifu.parallel.strategy import Strategy


def build_strategy(cfg: DistributedConfig) -> Strategy:
    """The strategy for ``cfg`` and the processes ``torchrun`` started (one process: ``Strategy``)."""
    from shifu.parallel import distributed
    from shifu.parallel.strategy import Strategy

    if cfg.strategy == "deepspeed":
        from shifu.parallel.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(cfg)
    if distributed.planned_world_size() > 1:
        from shifu.parallel.torchrun import DistributedStrategy

        return DistributedStrategy(cfg)
    return Strategy(cfg)

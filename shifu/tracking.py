"""The only module that knows metric sinks: JSONL, TensorBoard, and the console progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep them visible as strings
    return v


class Tracker:
    """Writes one JSON object per ``log`` call to ``metrics.jsonl`` and scalars to TensorBoard.

    ``enabled=False`` (non-zero ranks) makes every call a no-op. ``tensorboard=False`` skips TB.
    When resuming, pass ``resume_step``: lines with ``step > resume_step`` are dropped from the
    JSONL so the resumed run's log equals the uninterrupted one.
    """

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
        filename: str = "metrics.jsonl",
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / filename
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step)
            except ImportError:  # tensorboard not installed: JSONL only
                self._tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0) -> tqdm:
    """A progress bar on stderr; silent when not a rank-0 process or when disabled."""
    return tqdm(
        total=total,
        desc=desc,
        initial=initial,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=True,
    )


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file (for reports and tests)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]

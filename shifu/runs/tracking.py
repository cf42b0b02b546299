"""The only module that knows metric sinks: JSONL, TensorBoard, Weights & Biases, MLflow, the progress bar.

``metrics.jsonl`` is always written; TensorBoard by its flag; ``wandb`` and ``mlflow`` when named in
``trackers`` (optional extras: ``pip install 'shifu-rlhf[wandb]'`` / ``'shifu-rlhf[mlflow]'``). Several
sinks at once receive the same numeric values of every ``log`` call, and the run's config.

Where the external trackers write, by default inside the run directory:

- W&B: ``RUN/wandb/`` (``wandb.init(dir=RUN)``). The mode, project and entity come from W&B's own
  environment variables (``WANDB_MODE=offline`` keeps everything on disk; ``wandb sync RUN/wandb/offline-*``
  uploads later; ``WANDB_PROJECT`` defaults to ``shifu``). The console is not captured.
- MLflow: a local file store ``file:RUN/mlruns`` unless ``tracking_uri`` (or ``MLFLOW_TRACKING_URI``)
  names another store or server; experiment ``MLFLOW_EXPERIMENT_NAME`` or ``shifu``. MLflow 3 keeps its
  file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; shifu sets it (unless the user set it)
  when the store is a ``file:`` URI, because that store needs no database packages.

One run directory is one tracker run: the ids are kept in ``RUN/.trackers.json`` and every later Tracker
on the same directory (``--resume``, or a trainer's final-report Tracker) continues those runs instead of
starting new ones. A fresh run starts in an emptied directory (``shifu.runs.checkpoint.prepare_run_dir``), so
it gets new ids. Unlike the JSONL, W&B and MLflow cannot forget points: after a resume, the steps logged
between the last checkpoint and the kill appear twice there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from shifu.errors import ConfigError
from shifu.runs import jsonfile
from shifu.runs.metrics import is_defined

IDS_FILE = ".trackers.json"
# name -> (module to import, the extra that installs it); "jsonl" is always on, "tensorboard" = the flag
EXTERNAL_TRACKERS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
TRACKERS = ("jsonl", "tensorboard", *EXTERNAL_TRACKERS)
DEFAULT_PROJECT = "shifu"


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep them visible as strings
    return v


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics row as floats (NaN/Inf kept, booleans, text and ``step`` dropped):
    what TensorBoard, W&B and MLflow receive."""
    out = {}
    for k, v in row.items():
        if hasattr(v, "item"):
            v = v.item()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 0.001}}`` -> ``{"optim.lr": "0.001"}``: nested keys joined by dots, leaves as
    text (lists and None as JSON), the shape MLflow params take."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_config(v, key + "."))
        elif isinstance(v, str):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


def validate_trackers(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The tracker names, lowercased and deduplicated in order; a :class:`ConfigError` for an unknown name
    or an uninstalled extra, naming the ``pip install`` to run. Checks imports without importing (cheap),
    so config validation and every rank under torchrun can call it and fail alike."""
    out: list[str] = []
    for name in names:
        n = str(name).strip().lower()
        if n not in TRACKERS:
            raise ConfigError(
                f"trackers: unknown tracker '{name}'; choose from {', '.join(TRACKERS)} "
                "(metrics.jsonl is always written; TensorBoard also follows the `tensorboard` key)"
            )
        if n in EXTERNAL_TRACKERS and importlib.util.find_spec(EXTERNAL_TRACKERS[n][0]) is None:
            raise ConfigError(missing_extra(n))
        if n not in out:
            out.append(n)
    return tuple(out)


def missing_extra(name: str) -> str:
    """The message for a tracker whose package is not installed."""
    module, extra = EXTERNAL_TRACKERS[name]
    return (
        f"trackers: '{name}' needs the `{module}` package, which is not installed: "
        f"pip install 'shifu-rlhf[{extra}]' (or drop '{name}' from trackers)"
    )


def _import(name: str):
    try:
        return importlib.import_module(EXTERNAL_TRACKERS[name][0])
    except ImportError as e:
        raise ConfigError(f"{missing_extra(name)} [{e}]") from None


def read_ids(run_dir: str | Path) -> dict[str, Any]:
    """The tracker run ids stored in ``RUN/.trackers.json`` (empty when none)."""
    p = Path(run_dir) / IDS_FILE
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_ids(run_dir: Path, ids: dict[str, Any]) -> None:
    tmp = run_dir / (IDS_FILE + ".tmp")
    tmp.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / IDS_FILE)


class _Wandb:
    """One W&B run under ``RUN/wandb``, continued by id when ``run_id`` is given."""

    def __init__(self, run_dir: Path, config: dict[str, Any] | None, run_name: str, run_id: str | None):
        wandb = _import("wandb")
        resumed = run_id is not None
        try:
            self.run = wandb.init(
                dir=str(run_dir),
                project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=run_name,
                id=run_id,
                resume="allow",
                config=config or {},
                reinit="create_new",
                settings=wandb.Settings(console="off", save_code=False),
            )
        except Exception as e:  # no API key online, a bad WANDB_MODE, ...: say how to run without a server
            raise ConfigError(
                f"trackers: wandb.init failed ({type(e).__name__}: {e}); run `wandb login`, or set "
                "WANDB_MODE=offline to keep the W&B run on disk under the run directory"
            ) from None
        if resumed and config:  # a resumed run may have changed keys (e.g. a larger max_steps)
            self.run.config.update(config, allow_val_change=True)
        self.id = self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    """One MLflow run, through ``MlflowClient`` (no global active-run state), continued by id."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any] | None,
        run_name: str,
        run_id: str | None,
        tracking_uri: str | None,
    ):
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see the module docstring
        _import("mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            if run_id is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
                run = self.client.create_run(exp_id, run_name=run_name, tags={"shifu.run_dir": str(run_dir)})
                old: dict[str, str] = {}
            else:
                run = self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
                old = dict(run.data.params)
        except Exception as e:
            raise ConfigError(
                f"trackers: MLflow at {uri} failed ({type(e).__name__}: {e}); check the tracking URI "
                "(tracking_uri / MLFLOW_TRACKING_URI) or drop 'mlflow' from trackers"
            ) from None
        self.id = run.info.run_id
        params = flatten_config(config or {})
        # MLflow refuses to change a logged param: a resumed run logs new keys, changed ones as tags
        new = [Param(k, v) for k, v in params.items() if k not in old]
        for i in range(0, len(new), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.id, params=new[i : i + 100])
        for k, v in params.items():
            if k in old and old[k] != v:
                self.client.set_tag(self.id, f"resumed.{k}", v)
        if config:
            self.client.log_dict(self.id, config, "config.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.id, status="FINISHED")


class Tracker:
    """Writes one JSON object per ``log`` call to ``metrics.jsonl`` and its numeric values to the other
    sinks: TensorBoard (``tensorboard=True``), W&B and MLflow (named in ``trackers``).

    ``enabled=False`` (non-zero ranks) makes every call a no-op; tracker names are still validated, so
    every rank fails alike on a typo or a missing extra. When resuming, pass ``resume_step``: lines with
    ``step > resume_step`` are dropped from the JSONL so the resumed run's log equals the uninterrupted
    one. ``config`` (the run's resolved config as a nested dict) becomes W&B's config and MLflow's params
    (flattened to ``optim.lr``; a resume records changed keys as ``resumed.KEY`` tags, since MLflow never
    changes a param) plus a ``config.json`` artifact (the latest start's config). ``run_name`` defaults to the run
    directory's name. See the module docstring for where each tracker writes and how runs are continued.
    """

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
        filename: str = "metrics.jsonl",
        trackers: list[str] | tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
    ):
        names = validate_trackers(trackers)
        self.enabled = enabled
        self.path = Path(run_dir) / filename
        self._tb = None
        self._sinks: dict[str, Any] = {}
        if not enabled:
            return
        run = self.path.parent
        run.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            jsonfile.keep_rows(self.path, lambda row: row.get("step", 0) <= resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard or "tensorboard" in names:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # TensorBoard purges steps >= purge_step; the JSONL keeps step == resume_step
                purge = None if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(str(run / "tb"), purge_step=purge)
            except ImportError:  # tensorboard not installed: JSONL only
                self._tb = None
        if "wandb" in names or "mlflow" in names:
            self._start_external(names, run, config, run_name or run.resolve().name, tracking_uri)

    def _start_external(
        self, names: tuple[str, ...], run: Path, config: dict | None, run_name: str, tracking_uri: str | None
    ) -> None:
        ids = read_ids(run)
        try:
            if "wandb" in names:
                sink = _Wandb(run, config, run_name, ids.get("wandb", {}).get("id"))
                self._sinks["wandb"] = sink
                ids["wandb"] = {"id": sink.id}
            if "mlflow" in names:
                old = ids.get("mlflow", {})
                same_store = tracking_uri is None or old.get("tracking_uri") == tracking_uri
                run_id = old.get("run_id") if same_store else None
                sink = _Mlflow(run, config, run_name, run_id, tracking_uri or old.get("tracking_uri"))
                self._sinks["mlflow"] = sink
                ids["mlflow"] = {"run_id": sink.id, "tracking_uri": sink.uri}
        except BaseException:
            self.close()  # a sink that started is finished, the JSONL file closed
            raise
        _write_ids(run, ids)

    @property
    def run_ids(self) -> dict[str, str]:
        """The external trackers' run ids (``{"wandb": ..., "mlflow": ...}``) of this Tracker."""
        return {name: sink.id for name, sink in self._sinks.items()}

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        undefined = [k for k in metrics if not is_defined(k)]
        if undefined:  # every key a trainer writes is defined once, with its meaning, in shifu.runs.metrics
            raise ValueError(
                f"metric keys {undefined} are not in shifu/runs/metrics.py's table: define them there"
            )
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(jsonfile.dumps(row) + "\n")
        self._file.flush()
        if self._tb is None and not self._sinks:
            return
        values = scalars(metrics)
        if self._tb is not None:
            for k, v in values.items():
                if math.isfinite(v):  # as the JSONL's "nan" strings: gaps, not points
                    self._tb.add_scalar(k, v, step)
        for sink in self._sinks.values():
            sink.log(step, values)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks.values():
            sink.close()
        self._sinks = {}


_bar_lock_pid: int | None = None  # the process whose own lock the bars are drawn under


def own_bar_lock() -> None:
    """Draw this process's bars under a lock of its own. tqdm's default lock holds a semaphore that every
    process forked after it was made shares: one killed while drawing a bar (SIGKILL, the OOM killer) leaves it
    taken, and each process sharing it then waits forever at its next bar. shifu's bars are drawn by one
    process (rank 0), so a thread lock is all they need."""
    global _bar_lock_pid
    if _bar_lock_pid != os.getpid():
        tqdm.set_lock(threading.RLock())
        _bar_lock_pid = os.getpid()


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0, leave: bool = True) -> tqdm:
    """A progress bar on stderr; silent when not a rank-0 process or when disabled. ``leave=False``: cleared
    when closed (a bar shown below another one that goes on)."""
    own_bar_lock()
    return tqdm(
        total=total,
        desc=desc,
        initial=initial,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=leave,
    )


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file (for reports and tests)."""
    return jsonfile.read_jsonl(path) if Path(path).exists() else []

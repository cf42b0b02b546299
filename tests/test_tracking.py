"""Tracker sinks: every metric of docs/reference/metrics.md and the run's config reach JSONL, TensorBoard,
W&B (offline, files under the run directory) and MLflow (a local file store), read back from what each one
wrote; a resumed Tracker continues the same tracker runs; disabled ranks write nothing; missing extras are
named."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from shifu.errors import ConfigError
from shifu.runs.metrics import METRICS
from shifu.runs.tracking import IDS_FILE, Tracker, flatten_config, read_ids, read_metrics, scalars

CONFIG = {
    "seed": 3,
    "optim": {"lr": 0.001, "betas": [0.9, 0.95]},
    "kl": {"controller": "adaptive", "target": 6.0},
    "reward": {"function": None},
}


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """W&B offline with its config/cache/data dirs in tmp (never a server, nothing in $HOME); MLflow from
    the Tracker's own defaults."""
    for k, v in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(k, v)
    for k in (
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(k, raising=False)
    pytest.importorskip("wandb", reason="pip install 'shifu-rlhf[wandb]'")
    pytest.importorskip("mlflow", reason="pip install 'shifu-rlhf[mlflow]'")


def every_metric(step: int) -> dict[str, float]:
    """One value for every key of the metrics table ("sizes/*" as "sizes/world_size"), distinct per key."""
    row = {}
    for i, key in enumerate(METRICS):
        row[key.replace("/*", "/world_size")] = step + i / 100
    return row


# ------------------------------------------------------------------------------ W&B's offline file


def wandb_records(path: Path) -> list:
    """The protobuf records of a ``run-ID.wandb`` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing (32 KiB blocks; each chunk: crc32 u32, length u16, type u8 = full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B data file"
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block tail too short for a header is zero padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:  # zeroed rest of the block
            pos += left
            continue
        data, pos = raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 2):
            chunks = data
        else:
            chunks += data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            out.append(record)
    return out


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline run directory under RUN/wandb, in order: its run id, config and history by step."""
    runs = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        (data_file,) = d.glob("run-*.wandb")
        run = {"id": None, "config": {}, "history": {}}
        for r in wandb_records(data_file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"] = r.run.run_id
                run["config"] |= {u.key: json.loads(u.value_json) for u in r.run.config.update}
            elif kind == "config":
                run["config"] |= {u.key: json.loads(u.value_json) for u in r.config.update}
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item}
                run["history"][r.history.step.num] = {
                    k: float(v) for k, v in items.items() if not k.startswith("_")
                }
        runs.append(run)
    return runs


# ----------------------------------------------------------------------------------------- tests


@pytest.mark.unit
def test_flatten_config_and_scalars():
    assert flatten_config(CONFIG) == {
        "seed": "3",
        "optim.lr": "0.001",
        "optim.betas": "[0.9, 0.95]",
        "kl.controller": "adaptive",
        "kl.target": "6.0",
        "reward.function": "null",
    }
    row = {"step": 4, "a": 1, "b": float("nan"), "c": True, "d": "text"}
    assert list(scalars(row)) == ["a", "b"] and math.isnan(scalars(row)["b"])


@pytest.mark.integration
def test_every_sink_at_once_then_resume_continues_the_same_runs(tmp_path, offline_env):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    t = Tracker(run, trackers=["wandb", "mlflow"], config=CONFIG, run_name="exp-a")
    for step in (1, 2, 3):
        t.log(step, every_metric(step) | ({"loss/value": float("nan")} if step == 2 else {}))
    ids = t.run_ids
    t.close()
    assert read_ids(run) == {
        "wandb": {"id": ids["wandb"]},
        "mlflow": {"run_id": ids["mlflow"], "tracking_uri": (run / "mlruns").resolve().as_uri()},
    }

    # "killed" after step 3 with its last checkpoint at step 2: the resumed Tracker continues both runs
    t = Tracker(run, trackers=["mlflow", "wandb"], config=CONFIG | {"seed": 4}, resume_step=2)
    assert t.run_ids == ids
    for step in (3, 4):
        t.log(step, every_metric(step))
    t.close()
    keys = list(every_metric(0))

    # JSONL: the resumed log equals an uninterrupted one; the NaN is kept visible
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[1]["loss/value"] == "nan"

    # TensorBoard: every key, steps 1..4 (purged at the resume step), the NaN left out
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(keys)
    assert [e.step for e in events.Scalars("objective/kl")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("loss/value")] == [1, 3, 4]

    # W&B, offline under RUN/wandb: two offline runs with the same id, history and config from the files
    first, second = wandb_runs(run)
    assert first["id"] == second["id"] == ids["wandb"]
    assert sorted(first["history"]) == [1, 2, 3] and sorted(second["history"]) == [3, 4]
    for step, row in first["history"].items():
        expected = every_metric(step)
        if step == 2:
            assert math.isnan(row.pop("loss/value"))
            expected.pop("loss/value")
        assert row == pytest.approx(expected)
    assert second["history"][4] == pytest.approx(every_metric(4))
    assert {k: first["config"][k] for k in CONFIG} == CONFIG
    assert second["config"]["seed"] == 4  # the resumed run's config wins

    # MLflow, a local file store under RUN/mlruns: every key with its history, the config as params
    assert (run / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    mrun = client.get_run(ids["mlflow"])
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "exp-a"
    assert sorted(mrun.data.metrics) == sorted(keys)
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], key))
        # step 3 twice: logged before the kill and again after the resume (MLflow cannot drop points)
        assert [s for s, _ in history] == [1, 2, 3, 3, 4], key
        expected = [every_metric(s)[key] for s, _ in history]
        if key == "loss/value":
            assert math.isnan(history[1][1])
            history, expected = history[:1] + history[2:], expected[:1] + expected[2:]
        assert [v for _, v in history] == pytest.approx(expected), key
    assert mrun.data.params == flatten_config(CONFIG)  # the first run's params are kept
    assert mrun.data.tags["resumed.seed"] == "4"  # a changed key is recorded as a tag
    config_file = Path(client.download_artifacts(ids["mlflow"], "config.json", str(tmp_path)))
    assert json.loads(config_file.read_text()) == CONFIG | {"seed": 4}  # the latest start's config


@pytest.mark.unit
def test_disabled_rank_writes_nothing(tmp_path, offline_env):
    run = tmp_path / "rank1"
    t = Tracker(run, enabled=False, trackers=["wandb", "mlflow"], config=CONFIG)
    t.log(1, every_metric(1))
    t.close()
    assert t.run_ids == {} and not run.exists()


@pytest.mark.unit
def test_missing_extra_names_the_pip_install(tmp_path, monkeypatch):
    for name in ("wandb", "mlflow"):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, name, None)  # import wandb -> ImportError, find_spec -> None
            with pytest.raises(ConfigError, match=rf"pip install 'shifu-rlhf\[{name}\]'"):
                Tracker(tmp_path / "run", trackers=[name])
            with pytest.raises(ConfigError, match=rf"pip install 'shifu-rlhf\[{name}\]'"):
                Tracker(tmp_path / "run", enabled=False, trackers=[name])  # every rank fails alike
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="unknown tracker 'wandbb'; choose from jsonl, tensorboard, wandb"):
        Tracker(tmp_path / "run", trackers=["wandbb"])


@pytest.mark.integration
def test_mlflow_tracking_uri_and_new_run_after_overwrite(tmp_path, offline_env):
    """An explicit store (here another local directory) is used and remembered; an emptied run directory
    (what --overwrite does) starts a new tracker run."""
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "shared-store").resolve().as_uri()
    run = tmp_path / "run"
    t = Tracker(run, tensorboard=False, trackers=["mlflow"], tracking_uri=store)
    t.log(1, {"objective/score": 0.5})
    first = t.run_ids["mlflow"]
    t.close()
    assert not (run / "mlruns").exists() and read_ids(run)["mlflow"]["tracking_uri"] == store
    t = Tracker(run, tensorboard=False, trackers=["mlflow"], resume_step=1)  # the stored store is reused
    t.log(2, {"objective/score": 0.75})
    assert t.run_ids["mlflow"] == first
    t.close()
    history = MlflowClient(tracking_uri=store).get_metric_history(first, "objective/score")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.75)]

    (run / IDS_FILE).unlink()
    t = Tracker(run, tensorboard=False, trackers=["mlflow"], tracking_uri=store)
    assert t.run_ids["mlflow"] != first
    t.close()


@pytest.mark.integration
def test_a_trainer_sends_its_metrics_and_config_to_the_trackers_of_its_config(
    tmp_path, offline_env, tiny_model_dir
):
    """`shifu sft ... trackers=[wandb,mlflow]`: every logged row reaches W&B and MLflow with the run's config,
    and the trained model gets its model card."""
    from mlflow.tracking import MlflowClient

    from shifu.cli import main as cli
    from shifu.reporting.modelcard import read_card_metadata

    rows = [{"prompt": f"say {i}:", "response": " the movie was good"} for i in range(24)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    argv = ["sft", "--out", str(run), f"model.path={tiny_model_dir}", f"data.train={data}", "max_steps=4"]
    argv += ["log_every=2", "progress=false", "tensorboard=false", "trackers=[wandb,mlflow]", "optim.lr=1e-3"]
    assert cli.main(argv) == 0
    logged = [r for r in read_metrics(run / "metrics.jsonl") if "sft/loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    (wb,) = wandb_runs(run)
    assert wb["history"][4]["sft/loss"] == pytest.approx(logged[-1]["sft/loss"])
    assert wb["config"]["max_steps"] == 4 and wb["config"]["model"]["path"] == str(tiny_model_dir)
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    mrun = client.get_run(read_ids(run)["mlflow"]["run_id"])
    history = client.get_metric_history(mrun.info.run_id, "sft/loss")
    assert sorted(m.step for m in history) == [2, 4] and mrun.data.params["optim.lr"] == "0.001"
    # the base model by its own name (its directory's), never the absolute path the config holds
    assert read_card_metadata(run / "final" / "README.md")["base_model"] == tiny_model_dir.name


@pytest.mark.integration
def test_an_unknown_tracker_in_the_config_is_named_before_anything_is_written(tmp_path):
    from shifu.cli import main as cli

    argv = ["sft", "--out", str(tmp_path / "run"), "model.path=m", "data.train=d.jsonl", "trackers=[neptune]"]
    assert cli.main(argv) == 2 and not (tmp_path / "run").exists()


def _forked(body, deadline_s: float = 60.0) -> str:
    """Run ``body()`` in a forked child (stderr to /dev/null); "exited", "killed" or "hung" (killed after
    ``deadline_s``)."""
    import os
    import signal
    import time

    pid = os.fork()
    if pid == 0:  # never returns into pytest
        try:
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115
            body()
        finally:
            os._exit(0)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "killed" if os.WIFSIGNALED(status) else "exited"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


@pytest.mark.unit
def test_a_process_killed_while_drawing_a_bar_does_not_freeze_the_next_forked_one():
    """Two runs forked from one Python process (a test harness, a job runner, a notebook): the first is SIGKILLed
    while it draws its progress bar. tqdm's default lock is a semaphore shared by every process forked after it
    was made, so the second run would wait forever at its first bar; shifu's bars take a lock of their own."""
    import os
    import signal

    from tqdm.auto import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    from shifu.runs.tracking import progress

    before = tqdm.__dict__.get("_lock")
    tqdm.set_lock(TqdmDefaultWriteLock())  # this process drew a bar before it forked (tqdm's lock)
    try:

        def killed_mid_draw():
            bar = progress(3, "first run")
            bar.get_lock().acquire()  # as while drawing
            os.kill(os.getpid(), signal.SIGKILL)

        def draws():
            bar = progress(3, "second run")
            bar.update(3)
            bar.close()

        assert _forked(killed_mid_draw) == "killed"
        assert _forked(draws, deadline_s=30) == "exited"
    finally:
        if before is None:
            del tqdm._lock
        else:
            tqdm.set_lock(before)

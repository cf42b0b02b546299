"""``shifu sft``, ``shifu rm`` and ``shifu dpo`` under torchrun (2 CPU processes, gloo): a step on 2 ranks
equals a 1-process step on the same global batch, with DDP and FSDP2; an FSDP2 run resumed from its sharded
checkpoint equals an uninterrupted one; the real CLI runs end to end and only rank 0 writes.

Two launches (torchrun start-up costs seconds): ``dist_scripts/run_trainers.py`` runs every DDP/FSDP2
training in one, and ``torchrun -m shifu sft`` is the other. The 1-process references run in this
process. The data are chosen so that ranks hold different numbers of real tokens (``batch[rank::2]`` of
sequences of very different lengths) and so that some global micro-batches are smaller than 2 ranks
(7 examples in micro-batches of 4: the last has 3; 5 preference pairs: one micro-batch has 1 pair and
rank 1 runs a weight-0 stand-in). Process groups time out after 60 s, so a deadlock fails fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl
from safetensors.torch import load_file

from shifu.config.loader import load_config
from shifu.config.sections import TextDataConfig as DataConfig
from shifu.data.batches import BatchStream, encode_sft
from shifu.models.loading import load_tokenizer
from shifu.models.scalar import ScalarModel
from shifu.trainers import dpo, reward, sft

HERE = Path(__file__).resolve().parent
torch.set_num_threads(1)

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]
# 2 ranks share each global micro-batch; the tolerance is on max |w_2rank - w_1proc| / max |w_1proc - w_0|
REL_TOL = 1e-4


def sft_rows(n: int, offset: int) -> list[dict]:
    """Responses of 1 to 25 words: the ranks' shares of a batch hold very different token counts."""
    return [
        {
            "prompt": f"say {i}:",
            "response": " " + " ".join(WORDS[(i + j) % 7] for j in range(1 + (7 * i) % 25)),
        }
        for i in range(offset, offset + n)
    ]


def pref_rows(n: int, offset: int) -> list[dict]:
    return [
        {
            "prompt": f"rate {i}:",
            "chosen": " great " + " ".join(WORDS[: 1 + (3 * i) % 7]),
            "rejected": " " + " ".join(WORDS[(i % 3) : 2 + (5 * i) % 7]),
        }
        for i in range(offset, offset + n)
    ]


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("dist_sft_rm")
    files = {
        "model": tiny_model_dir,
        "sft_train": write_jsonl(d / "sft_train.jsonl", sft_rows(7, 0)),
        "sft_eval": write_jsonl(d / "sft_eval.jsonl", sft_rows(5, 100)),
        "rm_train": write_jsonl(d / "rm_train.jsonl", pref_rows(5, 0)),
        "rm_eval": write_jsonl(d / "rm_eval.jsonl", pref_rows(5, 100)),
        "dir": d,
    }
    return files


def sft_args(task, out: Path, *extra: str) -> list[str]:
    return [
        f"out_dir={out}",
        f"model.path={task['model']}",
        f"data.train={task['sft_train']}",
        f"data.eval={task['sft_eval']}",
        "batch_size=4",
        "grad_accum=2",
        "eval.batch_size=4",
        "optim.lr=1e-3",
        "optim.eps=1.0",
        "optim.schedule=constant",
        "progress=false",
        "tensorboard=false",
        "log_every=1",
        *extra,
    ]


def rm_args(task, out: Path, *extra: str) -> list[str]:
    return [
        f"out_dir={out}",
        f"model.path={task['model']}",
        f"data.train={task['rm_train']}",
        f"data.eval={task['rm_eval']}",
        "batch_size=4",
        "grad_accum=2",
        "eval.batch_size=4",
        "optim.lr=1e-3",
        "optim.eps=1.0",
        "optim.schedule=constant",
        "progress=false",
        "tensorboard=false",
        "log_every=1",
        *extra,
    ]


def dpo_args(task, out: Path, *extra: str) -> list[str]:
    return [
        f"out_dir={out}",
        f"model.path={task['model']}",
        f"data.train={task['rm_train']}",
        f"data.eval={task['rm_eval']}",
        "batch_size=4",
        "grad_accum=2",
        "eval.batch_size=4",
        "optim.lr=1e-3",
        "optim.eps=1.0",
        "optim.schedule=constant",
        "progress=false",
        "tensorboard=false",
        "log_every=1",
        *extra,
    ]


def env() -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1"}
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), e.get("PYTHONPATH", "")])
    e.pop("WORLD_SIZE", None)
    return e


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def one_process(module, args: list[str]) -> Path:
    cfg = load_config(module.Config, overrides=args)
    module.train(cfg)
    return Path(cfg.out_dir)


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> float:
    """max |a - b| over every weight, relative to the largest change the 1-process step made (b - init)."""
    assert a.keys() == b.keys()
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    step = max(float((b[k].float() - init[k].float()).abs().max()) for k in a)
    assert step > 0, "the reference step changed nothing"
    return diff / step


def lm_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def rm_weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ScalarModel.from_pretrained(path).state_dict().items()}


@pytest.fixture(scope="module")
def two_rank_runs(task):
    """Every DDP/FSDP2 training of this file in one torchrun launch; returns the run directories."""
    d = task["dir"]
    runs = [
        {"cmd": "sft", "overrides": sft_args(task, d / "sft_ddp", "max_steps=1", "distributed.strategy=ddp")},
        {
            "cmd": "sft",
            "overrides": sft_args(
                task, d / "sft_fsdp2", "max_steps=1", "save_every=1", "distributed.strategy=fsdp2"
            ),
            "copy_final": str(d / "sft_fsdp2_step1"),
        },
        {
            "cmd": "sft",
            "overrides": sft_args(
                task, d / "sft_fsdp2", "max_steps=2", "save_every=1", "distributed.strategy=fsdp2"
            ),
            "resume": True,
        },
        {"cmd": "rm", "overrides": rm_args(task, d / "rm_ddp", "max_steps=1", "distributed.strategy=ddp")},
        {
            "cmd": "rm",
            "overrides": rm_args(task, d / "rm_fsdp2", "max_steps=1", "distributed.strategy=fsdp2"),
        },
        {"cmd": "dpo", "overrides": dpo_args(task, d / "dpo_ddp", "max_steps=1", "distributed.strategy=ddp")},
        {
            "cmd": "dpo",
            "overrides": dpo_args(task, d / "dpo_fsdp2", "max_steps=1", "distributed.strategy=fsdp2"),
        },
    ]
    for r in runs:
        r["overrides"].append("distributed.timeout_s=60")
    (d / "runs.json").write_text(json.dumps(runs))
    torchrun(str(HERE / "dist_scripts" / "run_trainers.py"), "--runs", str(d / "runs.json"))
    return d


@pytest.mark.unit
def test_ranks_hold_different_token_counts(task):
    """The premise of the equality tests: the 2 ranks' shares of the first micro-batches differ in size."""
    tok = load_tokenizer(task["model"])
    rows = [json.loads(x) for x in Path(task["sft_train"]).read_text().splitlines()]
    d = DataConfig()
    ex, _ = encode_sft(tok, rows, d.max_prompt_len, d.max_len, d.prompt_policy)
    stream = BatchStream(len(ex), 4, 0)
    for _ in range(2):  # the two micro-batches of step 1
        idx = stream.next()
        counts = [sum(len(ex[i]["response_ids"]) for i in idx[r::2]) for r in (0, 1)]
        print(f"response tokens per rank: {counts}")
        assert counts[0] != counts[1]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_sft_step_on_two_ranks_equals_one_process(task, two_rank_runs, tmp_path, strategy):
    ref = one_process(sft, sft_args(task, tmp_path / "ref", "max_steps=1"))
    init = load_file(str(Path(task["model"]) / "model.safetensors"))
    got = two_rank_runs / ("sft_ddp/final" if strategy == "ddp" else "sft_fsdp2_step1")
    rel = rel_diff(load_file(str(got / "model.safetensors")), lm_weights(ref), init)
    print(f"sft {strategy}: 2 ranks vs 1 process, relative weight difference {rel:.2e}")
    assert rel < REL_TOL
    if strategy == "ddp":  # the training and held-out losses, reduced over ranks, equal the 1-process ones
        one, two = (json.loads((r / "summary.json").read_text()) for r in (ref, two_rank_runs / "sft_ddp"))
        assert two["eval/sft/loss"] == pytest.approx(one["eval/sft/loss"], rel=1e-5)
        assert two["sft/loss"] == pytest.approx(one["sft/loss"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_sft_fsdp2_resume_from_shards_equals_uninterrupted(task, two_rank_runs, tmp_path):
    """1 FSDP2 step, sharded checkpoint (DCP), --resume to 2 steps == 2 uninterrupted 1-process steps."""
    run = two_rank_runs / "sft_fsdp2"
    ckpt_dir = run / "checkpoints" / "step-00000001"
    assert (ckpt_dir / "sharded" / "policy" / ".metadata").exists()
    assert not list((run / "checkpoints").glob(".shards-*"))  # adopted into the checkpoint, not left over
    ref = one_process(sft, sft_args(task, tmp_path / "ref2", "max_steps=2"))
    init = load_file(str(Path(task["model"]) / "model.safetensors"))
    rel = rel_diff(lm_weights(run), lm_weights(ref), init)
    print(f"sft fsdp2 resumed: relative weight difference {rel:.2e}")
    assert rel < REL_TOL
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "sft/loss" in r]
    assert steps == [1, 2]  # each step logged once, by rank 0, across the resume


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_rm_step_on_two_ranks_equals_one_process(task, two_rank_runs, tmp_path, strategy):
    ref = one_process(reward, rm_args(task, tmp_path / "ref", "max_steps=1"))
    init = {
        k: v.clone() for k, v in ScalarModel.from_backbone(str(task["model"]), seed=0).state_dict().items()
    }
    got = two_rank_runs / f"rm_{strategy}"
    rel = rel_diff(rm_weights(got / "final"), rm_weights(ref / "final"), init)
    print(f"rm {strategy}: 2 ranks vs 1 process, relative weight difference {rel:.2e}")
    assert rel < REL_TOL
    one, two = (json.loads((r / "summary.json").read_text()) for r in (ref, got))
    for key in ("rm/loss", "rm/accuracy", "eval/rm/accuracy", "eval/rm/margin", "eval/rm/len_corr"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_dpo_step_on_two_ranks_equals_one_process(task, two_rank_runs, tmp_path, strategy):
    """DPO under torchrun: the pair-mean loss over the global batch (5 pairs: one micro-batch leaves rank 1
    a weight-0 stand-in), so 2 ranks take the 1-process step; held-out metrics reduced over ranks."""
    ref = one_process(dpo, dpo_args(task, tmp_path / "ref", "max_steps=1"))
    init = load_file(str(Path(task["model"]) / "model.safetensors"))
    got = two_rank_runs / f"dpo_{strategy}"
    rel = rel_diff(lm_weights(got), lm_weights(ref), init)
    print(f"dpo {strategy}: 2 ranks vs 1 process, relative weight difference {rel:.2e}")
    assert rel < REL_TOL
    one, two = (json.loads((r / "summary.json").read_text()) for r in (ref, got))
    for key in ("dpo/loss", "eval/dpo/loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    # after one step the margins are of the size of the update, so they carry its relative difference
    for key in ("dpo/margin", "eval/dpo/margin"):
        assert two[key] == pytest.approx(one[key], abs=1e-5), key


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_sft_ddp_end_to_end_rank0_writes_once(task, tmp_path):
    """torchrun -m shifu sft: 4 steps with evaluation and checkpoints; every record written once, and
    the same losses and weights as the 1-process CLI-equivalent run."""
    out = tmp_path / "cli"
    args = sft_args(
        task,
        out,
        "max_steps=4",
        "eval.every=2",
        "save_every=2",
        "distributed.strategy=ddp",
        "distributed.timeout_s=60",
    )
    proc = torchrun("-m", "shifu", "sft", *args)
    assert proc.stderr.count("shifu sft: 4 steps") == 1  # the final report comes from rank 0 only
    ref = one_process(sft, sft_args(task, tmp_path / "ref4", "max_steps=4", "eval.every=2", "save_every=2"))
    got_rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    # the same records, each once (a second writer would duplicate lines); the derived sizes at step 0
    assert [sorted(r) for r in got_rows] == [sorted(r) for r in ref_rows]
    sizes = [
        {k: v for k, v in r.items() if k.startswith("sizes/")} for r in got_rows if "sizes/processes" in r
    ]
    assert sizes == [{"sizes/processes": 2, "sizes/batch_per_process": 2, "sizes/total_optimizer_steps": 4}]
    assert next(r for r in ref_rows if "sizes/processes" in r)["sizes/processes"] == 1
    for g, r in zip(got_rows, ref_rows):
        for key in ("sft/loss", "eval/sft/loss"):
            if key in r:
                assert g[key] == pytest.approx(r[key], rel=1e-4), (key, g["step"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000004",
    ]
    assert "batch_size: 4" in (out / "config.yaml").read_text()  # the global size, never rewritten
    init = load_file(str(Path(task["model"]) / "model.safetensors"))
    rel = rel_diff(lm_weights(out), lm_weights(ref), init)
    print(f"sft CLI ddp 4 steps: relative weight difference {rel:.2e}")
    assert rel < REL_TOL

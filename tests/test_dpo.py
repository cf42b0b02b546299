"""``shifu dpo``: learns a clear preference (held-out implicit-reward accuracy), keeps the reference
frozen, rejects bad pairs with file/line/field (exit 2), and resumes exactly."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from shifu.cli.main import main as cli_main
from shifu.config.loader import load_config
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.trainers import dpo

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

GOOD = ["the movie was great", "the acting was good", "a great film, good story", "good and great"]
BAD = ["the movie was bad", "a terrible plot", "boring and bad film", "terrible, bad, boring"]
PROMPTS = ["review:", "tell me:", "hello there,", "what is it?", "the film", "user: hi", "question:"]


def preference_rows(n: int, seed: int) -> list[dict]:
    """Chosen responses praise, rejected ones pan: learnable from the words alone, any prompt."""
    rng = random.Random(seed)
    return [
        {"prompt": rng.choice(PROMPTS) + f" {i}", "chosen": rng.choice(GOOD), "rejected": rng.choice(BAD)}
        for i in range(n)
    ]


def config(tmp_path: Path, model_dir: Path, out: str, **over) -> dpo.Config:
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(96, 0))
    held = write_jsonl(tmp_path / "eval.jsonl", preference_rows(32, 1))
    base = {
        "out_dir": str(tmp_path / out),
        "model": {"path": str(model_dir)},
        "beta": 0.1,
        "data": {"train": str(train), "eval": str(held), "max_len": 48, "max_prompt_len": 16},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "batch_size": 16,
        "max_steps": 25,
        "log_every": 5,
        "progress": False,
        "tensorboard": False,
        "device": "cpu",
    }
    return load_config(dpo.Config, None, {**base, **over})


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(directory.iterdir()):
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def test_dpo_learns_preference_and_reference_stays_frozen(tmp_path, tiny_model_dir):
    before = _digest(tiny_model_dir)
    cfg = config(tmp_path, tiny_model_dir, "run")
    summary = dpo.train(cfg)
    rows = [json.loads(x) for x in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in rows if r["step"] == 0)
    # policy == reference before the first step: implicit rewards 0, loss log 2, accuracy 0 (no r_c > r_r)
    assert start["eval/dpo/loss"] == pytest.approx(0.6931, abs=1e-4)
    assert start["eval/dpo/margin"] == pytest.approx(0.0, abs=1e-5)
    # measured (25 steps): held-out accuracy 0.0 -> 1.0, margin 0 -> 4.2, loss 0.693 -> 0.03
    assert summary["eval/dpo/accuracy"] >= 0.9
    assert summary["eval/dpo/margin"] > 0.5
    assert summary["eval/dpo/loss"] < 0.45
    assert summary["eval/dpo/chosen_reward"] > summary["eval/dpo/rejected_reward"]

    # the reference is the untouched starting model: its files did not change, and the reported implicit
    # rewards are beta * (log pi_final - log pi_start) recomputed here from the two directories
    assert _digest(tiny_model_dir) == before
    tok = load_tokenizer(tiny_model_dir)
    held = dpo.encode_pairs(tok, preference_rows(32, 1), cfg.data)[0]
    start_model = load_causal_lm(tiny_model_dir, dropout=False).eval()
    final = load_causal_lm(Path(cfg.out_dir) / "final", dropout=False).eval()
    with torch.no_grad():
        batch = dpo.collate_pairs(held, tok.pad_token_id)
        diff = dpo.sequence_log_probs(final, batch, "cpu", False) - dpo.sequence_log_probs(
            start_model, batch, "cpu", False
        )
    assert float(cfg.beta * diff[:32].mean()) == pytest.approx(summary["eval/dpo/chosen_reward"], abs=1e-4)
    assert float(cfg.beta * diff[32:].mean()) == pytest.approx(summary["eval/dpo/rejected_reward"], abs=1e-4)


def test_bad_preference_data_exits_2_naming_file_line_field(tmp_path, tiny_model_dir, capsys):
    rows = preference_rows(5, 0)
    del rows[2]["rejected"]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    code = cli_main(
        ["dpo", "--out", str(tmp_path / "out"), f"model.path={tiny_model_dir}", f"data.train={bad}"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.jsonl, line 3, field 'rejected'" in err
    assert not (tmp_path / "out").exists()  # validation happens before the run directory is made


def _logged(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock throughput (the only thing a resume may change)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_resume_equals_uninterrupted(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, "run", max_steps=6, save_every=3, keep_last=3, log_every=1)
    dpo.train(cfg)
    run = Path(cfg.out_dir)
    full = load_causal_lm(run / "final").state_dict()
    full_metrics = _logged(run)
    # simulate a crash right after the step-3 checkpoint: later state is gone
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step-00000006")
    (ckpts / "latest").write_text("step-00000003")
    dpo.train(cfg, resume=True)
    resumed = load_causal_lm(run / "final").state_dict()
    for k, v in full.items():
        assert torch.equal(v, resumed[k]), k
    assert _logged(run) == full_metrics

"""shifu sft: learning on a tiny corpus, response-only loss, HF output, exact resume, CLI errors."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from shifu.config.loader import load_config
from shifu.data.batches import collate_sft, encode_sft
from shifu.errors import ConfigError
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.runs.checkpoint import CKPT_DIR
from shifu.runs.tracking import read_metrics
from shifu.trainers import sft

ANIMALS = ["cat", "dog", "bird", "fish", "cow"]


def corpus(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.choice(ANIMALS)
        rows.append({"prompt": f"tell me about the {a}:", "response": f" the {a} is a good {a}."})
    return rows


def make_cfg(model_dir, tmp_path: Path, **over) -> sft.Config:
    write_jsonl(tmp_path / "train.jsonl", corpus(120))
    write_jsonl(tmp_path / "eval.jsonl", corpus(20, seed=1))
    base = {
        "out_dir": str(tmp_path / "run"),
        "model": {"path": str(model_dir)},
        "data": {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "batch_size": 8,
        "max_steps": 30,
        "log_every": 5,
        "progress": False,
        "tensorboard": False,
    }
    return load_config(sft.Config, overrides={**base, **over})


@pytest.mark.integration
def test_sft_lowers_held_out_loss_and_saves_an_hf_dir(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(tiny_model_dir, tmp_path, grad_accum=2)
    summary = sft.train(cfg)
    evals = [
        r["eval/sft/loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/sft/loss" in r
    ]
    print(f"sft held-out loss {evals[0]:.3f} -> {evals[-1]:.3f}")
    assert evals[-1] < 0.5 * evals[0]
    assert summary["eval/sft/loss"] == evals[-1]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "final"), local_files_only=True)
    tok = load_tokenizer(tmp_path / "run" / "final")
    ids = tok("tell me about the dog:", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1] :])
    assert " is a good " in text and text.endswith(".<|endoftext|>")  # learned the format and to stop


@pytest.mark.unit
def test_gradients_on_prompt_and_padding_positions_are_exactly_zero(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    rows = [
        {"prompt": "tell me about the cat:", "response": " the cat"},
        {"prompt": "hi", "response": " a b c d e f"},
    ]
    examples, _ = encode_sft(tok, rows, 64, 128)
    batch = collate_sft(examples, tok.pad_token_id)
    seen = {}

    def keep(_module, args):  # what the output layer reads: the final hidden states it is given
        args[0].retain_grad()
        seen["hidden"] = args[0]

    handle = model.lm_head.register_forward_pre_hook(keep)
    nll_sum, n = sft.sft_nll_sum(model, batch, "cpu", bf16=False)
    (nll_sum / n).backward()
    handle.remove()
    grad = seen["hidden"].grad  # (B, T, d): position t predicts token t+1
    predicts_response = torch.zeros(batch["loss_mask"].shape, dtype=torch.bool)
    predicts_response[:, :-1] = batch["loss_mask"][:, 1:]
    assert (grad[~predicts_response] == 0).all()  # prompt, padding, and the last position: exactly zero
    assert (grad[predicts_response].abs().sum(-1) > 0).all()
    assert n == sum(len(e["response_ids"]) for e in examples)


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_causal_lm(path).state_dict()


@pytest.mark.integration
def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, max_steps=8, save_every=4, keep_last=3, grad_accum=2, epochs=1.0)
    sft.train(cfg)
    full = tmp_path / "run"
    # simulate a crash right after the step-4 checkpoint: copy the run, forget everything after it
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "final")
    (cut / "summary.json").unlink()
    shutil.rmtree(cut / CKPT_DIR / "step-00000008")
    (cut / CKPT_DIR / "latest").write_text("step-00000004")
    resumed_cfg = make_cfg(tiny_model_dir, tmp_path, max_steps=8, save_every=4, keep_last=3, grad_accum=2)
    resumed_cfg = dataclasses.replace(resumed_cfg, out_dir=str(cut))
    sft.train(resumed_cfg, resume=True)
    a, b = _state(full / "final"), _state(cut / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def drop_perf(rows):
        return [{k: v for k, v in r.items() if k != "perf/tokens_per_s"} for r in rows]

    assert drop_perf(read_metrics(cut / "metrics.jsonl")) == drop_perf(read_metrics(full / "metrics.jsonl"))
    # a changed learning rate is refused by name; changing max_steps is allowed
    changed = make_cfg(tiny_model_dir, tmp_path, max_steps=8, save_every=4, grad_accum=2, optim={"lr": 1e-2})
    changed = dataclasses.replace(changed, out_dir=str(cut))
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        sft.train(changed, resume=True)


@pytest.mark.unit
def test_config_errors_name_the_key(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate'"):
        make_cfg(tiny_model_dir, tmp_path, optim={"learning_rate": 1.0})
    with pytest.raises(ConfigError, match="data.max_len"):
        make_cfg(tiny_model_dir, tmp_path, data={"train": "x", "max_len": 8, "max_prompt_len": 8})
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        make_cfg(tiny_model_dir, tmp_path, batch_size=0)


@pytest.mark.integration
def test_cli_sft_bad_data_exits_2_and_writes_nothing(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n" + json.dumps({"prompt": "p"}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shifu",
            "sft",
            "--out",
            str(out),
            f"model.path={tiny_model_dir}",
            f"data.train={bad}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        env={"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", "PATH": ""},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}, line 2, field 'response': missing field" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.integration
def test_sft_with_lora_trains_only_adapters_and_saves_them_merged(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    lora = {"enabled": True, "r": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]}
    cfg = make_cfg(tiny_model_dir, tmp_path, lora=lora, optim={"lr": 1e-2})
    summary = sft.train(cfg)
    evals = [
        r["eval/sft/loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/sft/loss" in r
    ]
    print(f"sft (LoRA) held-out loss {evals[0]:.3f} -> {evals[-1]:.3f}")
    assert evals[-1] < 0.9 * evals[0] and summary["eval/sft/loss"] == evals[-1]
    final = tmp_path / "run" / "final"
    with safe_open(str(final / "model.safetensors"), "pt") as st:
        assert not any("lora_" in k for k in st.keys())  # a plain model: the adapters merged in
    base, tuned = load_causal_lm(tiny_model_dir), load_causal_lm(final)
    changed = {n for n, p in tuned.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])}
    assert changed and all(n.endswith(".weight") and ("attn" in n or "mlp" in n) for n in changed)
    assert not any("wte" in n or "wpe" in n or "ln_" in n for n in changed)  # frozen: never adapted


@pytest.mark.unit
def test_sft_lora_settings_that_cannot_work_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="lora.critic is a setting of shifu ppo"):
        make_cfg(tiny_model_dir, tmp_path, lora={"critic": True})
    with pytest.raises(
        ConfigError, match="lora.enabled=true with distributed.strategy=fsdp2 is not supported"
    ):
        make_cfg(tiny_model_dir, tmp_path, lora={"enabled": True}, distributed={"strategy": "fsdp2"})


@pytest.mark.integration
def test_sft_with_lora_resumes_bit_identically_from_a_checkpoint_of_adapters(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    lora = {"enabled": True, "r": 4, "target_modules": ["c_attn", "c_fc"]}
    kw = {"max_steps": 6, "save_every": 3, "keep_last": 3, "lora": lora, "optim": {"lr": 1e-2}}
    sft.train(make_cfg(tiny_model_dir, tmp_path, **kw))
    full, cut = tmp_path / "run", tmp_path / "cut"
    step = full / CKPT_DIR / "step-00000003"
    weights = [f for f in step.iterdir() if f.name.endswith(".safetensors") and "policy" in f.name]
    with safe_open(str(weights[0]), "pt") as st:
        assert st.keys() and all("lora_" in k for k in st.keys())  # only what trains, never the frozen base
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "final")
    (cut / "summary.json").unlink()
    shutil.rmtree(cut / CKPT_DIR / "step-00000006")
    (cut / CKPT_DIR / "latest").write_text("step-00000003")
    sft.train(dataclasses.replace(make_cfg(tiny_model_dir, tmp_path, **kw), out_dir=str(cut)), resume=True)
    a, b = _state(full / "final"), _state(cut / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

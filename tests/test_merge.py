"""`shifu merge`: base + scale * mean(policy - base) on real HF directories, and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shifu.cli.main import main as cli_main
from shifu.errors import ShifuError
from shifu.models.loading import build_tiny_gpt2, load_causal_lm, load_tokenizer
from shifu.models.merge import merge_policies

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def _moved(src, dst, seed: int, shared: dict | None = None, noise: float = 0.02):
    """A copy of the model in ``src`` whose every parameter moved by ``shared`` (if given) plus its own
    seeded noise, saved with the tokenizer in ``dst``."""
    model = load_causal_lm(src, dropout=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.add_(noise * torch.randn(p.shape, generator=g) + (shared[k] if shared else 0.0))
    model.save_pretrained(str(dst))
    load_tokenizer(src).save_pretrained(str(dst))
    return dst


def _params(path) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in load_causal_lm(path, dropout=False).named_parameters()}


def test_merge_is_the_base_plus_the_scaled_mean_change(tiny_model_dir, tmp_path):
    a, b = _moved(tiny_model_dir, tmp_path / "a", 1), _moved(tiny_model_dir, tmp_path / "b", 2)
    base, pa, pb = _params(tiny_model_dir), _params(a), _params(b)
    for scale in (1.0, 0.7, 1.3):
        out = merge_policies(tiny_model_dir, [a, b], tmp_path / f"m{scale}", scale)
        merged = load_causal_lm(out, dropout=False)
        got = dict(merged.named_parameters())
        assert got.keys() == base.keys()
        for k in base:
            want = base[k] + scale * ((pa[k] - base[k]) + (pb[k] - base[k])) / 2
            assert torch.allclose(got[k], want, atol=1e-6), k
        # GPT-2 ties the LM head to the token embedding: the merge keeps them one tensor
        assert merged.lm_head.weight.data_ptr() == merged.transformer.wte.weight.data_ptr()
        info = json.loads((out / "merge.json").read_text())
        assert info["scale"] == scale and info["policies"] == [str(a), str(b)]
        assert load_tokenizer(out).get_vocab() == load_tokenizer(a).get_vocab()
    # scale 0 is the base itself; one policy at scale 1 is that policy
    zero = _params(merge_policies(tiny_model_dir, [a, b], tmp_path / "zero", 0.0))
    assert all(torch.equal(zero[k], base[k]) for k in base)
    one = _params(merge_policies(tiny_model_dir, [a], tmp_path / "one", 1.0))
    assert all(torch.allclose(one[k], pa[k], atol=1e-7) for k in base)


def _kl_to(policy, base, ids) -> float:
    """KL(policy || base) per position on fixed token ids (exact over the vocabulary)."""
    with torch.no_grad():
        lp = torch.log_softmax(policy(ids).logits, -1)
        lq = torch.log_softmax(base(ids).logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_the_mean_of_runs_that_share_a_change_is_closer_to_the_base_than_each_run(tiny_model_dir, tmp_path):
    # two "runs" = one shared change + independent changes twice its size: the mean keeps the shared part
    # and halves the variance of the rest, so it is nearer the base (the reason a soup spends less KL)
    g = torch.Generator().manual_seed(0)
    shared = {k: 0.02 * torch.randn(p.shape, generator=g) for k, p in _params(tiny_model_dir).items()}
    runs = [_moved(tiny_model_dir, tmp_path / f"r{i}", 10 + i, shared, noise=0.04) for i in range(2)]
    out = merge_policies(tiny_model_dir, runs, tmp_path / "soup")
    base = load_causal_lm(tiny_model_dir, dropout=False).eval()
    ids = torch.randint(0, base.config.vocab_size, (4, 16), generator=g)
    kl_runs = [_kl_to(load_causal_lm(r, dropout=False).eval(), base, ids) for r in runs]
    kl_soup = _kl_to(load_causal_lm(out, dropout=False).eval(), base, ids)
    assert 0 < kl_soup < 0.8 * min(kl_runs), (kl_soup, kl_runs)


def test_merge_refuses_what_it_cannot_merge_and_never_touches_existing_outputs(tiny_model_dir, tmp_path):
    a = _moved(tiny_model_dir, tmp_path / "a", 1)
    tok = load_tokenizer(tiny_model_dir)
    other = tmp_path / "other"  # another architecture: 3 blocks instead of 2
    build_tiny_gpt2(tok, n_layer=3, n_embd=64, n_head=2, n_positions=256, seed=0).save_pretrained(str(other))
    tok.save_pretrained(str(other))
    with pytest.raises(ShifuError, match=r"a/? has no parameter 'transformer\.h\.2\."):
        merge_policies(other, [a], tmp_path / "x")
    with pytest.raises(
        ShifuError, match="has parameters the base .* has not .*share the base's architecture"
    ):
        merge_policies(tiny_model_dir, [other], tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ShifuError, match="one of the inputs"):
        merge_policies(tiny_model_dir, [a], a)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ShifuError, match="not empty"):
        merge_policies(tiny_model_dir, [a], busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    with pytest.raises(ShifuError, match="finite"):
        merge_policies(tiny_model_dir, [a], tmp_path / "y", float("nan"))
    with pytest.raises(ShifuError, match="at least one"):
        merge_policies(tiny_model_dir, [], tmp_path / "y")


def test_shifu_merge_command(tiny_model_dir, tmp_path, capsys):
    a, b = _moved(tiny_model_dir, tmp_path / "a", 1), _moved(tiny_model_dir, tmp_path / "b", 2)
    run = tmp_path / "run"  # a trainer's run directory: its final/ is the policy
    shutil.copytree(b, run / "final")
    out = tmp_path / "merged"
    assert (
        cli_main(
            ["merge", "--base", str(tiny_model_dir), "--out", str(out), "--scale", "0.5", str(a), str(run)]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert "2 policies" in printed.err and printed.out == ""  # a line of shifu's own: stderr
    assert json.loads((out / "merge.json").read_text())["policies"] == [str(a), str(run / "final")]
    assert cli_main(["merge", "--base", str(tiny_model_dir), "--out", str(out), str(a)]) == 2  # exists
    assert "not empty" in capsys.readouterr().err
    assert cli_main(["merge", "--base", str(tmp_path / "nope"), "--out", str(tmp_path / "z"), str(a)]) == 2
    assert "not a directory" in capsys.readouterr().err

"""bf16 decided by measurement (shifu.parallel.precision): the probe's cache, the decisions it drives, and what
``bf16=true`` then holds in bf16 (frozen copies, the decode copy) and in fp32 (master weights, optimiser).

No test depends on how fast the CPU's bf16 is: the decisions are driven through ``measure`` (the one
function that reads a clock), and the fallback path is the same code on a CPU without native bf16."""

from __future__ import annotations

import json

import pytest
import torch
from ppo_task import build_char_model, write_prompts
from safetensors.torch import load_file
from test_ppo import built

from shifu.config.loader import load_config
from shifu.models.loading import load_causal_lm
from shifu.models.padding import pad_left
from shifu.models.scalar import ScalarModel
from shifu.parallel import precision
from shifu.rollout.batch import PromptBatch
from shifu.trainers import ppo, ppo_rollout


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision_task")
    model = build_char_model(d / "model")
    rm = ScalarModel.from_backbone(model, seed=3)  # a reward model on the policy's tokenizer
    rm.save_pretrained(d / "rm")
    return {"model": model, "rm": d / "rm", "prompts": write_prompts(d / "prompts.jsonl")}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIFU_CACHE", str(tmp_path / "cache"))


def fake_timings(infer: float, train: float):
    """A ``measure`` whose bf16 takes ``infer`` / ``train`` x fp32's time, fp32 linear in the GEMM's size."""

    def measure(kind, m, k, n, device, repeats=3):
        t32 = m * k * n * 1e-12
        return t32, t32 * (infer if kind == "infer" else train)

    return measure


WORK = precision.Workload(
    trunk=((16, 48, 2), (16, 16, 2)), head=(16, 100), decode_rows=8, score_rows=8, train_rows=4, T=20, R=10
)


# two real /proc/cpuinfo heads of this project's VMs (trimmed): the same model name, one with AVX-512 and
# native bf16 (bf16 measured ~2x faster there), one with AVX2 only (bf16 emulated, ~10x slower)
CPUINFO_BF16 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512_vnni avx512_bf16 rdpid
"""
CPUINFO_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 rdpid
"""


@pytest.mark.unit
def test_probe_key_tells_apart_cpus_of_one_name_by_their_isa():
    """A cached decision from the bf16 VM must not be reused on the AVX2 VM of the same model name."""
    with_bf16, avx2 = precision.cpu_name_and_isa(CPUINFO_BF16), precision.cpu_name_and_isa(CPUINFO_AVX2)
    assert with_bf16 == "AMD EPYC|avx2+fma+avx512f+avx512_vnni+avx512_bf16"
    assert avx2 == "AMD EPYC|avx2+fma"
    assert precision.cpu_name_and_isa("model name\t: X\n") == "X|no isa flags"
    # Arm: no "model name" on most kernels, the ISA under "Features" (a Graviton 3 head, bf16 in hardware)
    arm = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm sve i8mm bf16 rng\n"
    assert precision.cpu_name_and_isa(arm).endswith("|asimd+sve+bf16+i8mm")
    # x86's "sme" (AMD memory encryption) is not Arm's matrix extension
    assert precision.cpu_name_and_isa("model name\t: E\nflags\t: fpu sme avx2 fma\n") == "E|avx2+fma"
    key = precision.machine_key(torch.device("cpu"))
    assert key.startswith("cpu|") and key.count("|") == 4  # cpu | name | isa | torch | threads


@pytest.mark.unit
def test_probe_measures_each_shape_once_then_reads_the_cache(tmp_path):
    probe = precision.Probe(torch.device("cpu"))
    first = probe.time("infer", 8, 16, 48)
    probe.time("train", 4, 16, 48)
    assert (probe.measured, probe.cached) == (2, 0) and all(t > 0 for t in first)
    probe.save()
    table = json.loads((tmp_path / "cache" / "bf16_probe.json").read_text())
    (key,) = table
    assert (
        torch.__version__ in key
        and "threads 1" in key
        and set(table[key]) == {"infer 8x16x48", "train 4x16x48"}
    )
    again = precision.Probe(torch.device("cpu"))
    assert again.time("infer", 8, 16, 48) == first and (again.measured, again.cached) == (0, 1)
    # rows past PROBE_ROWS are timed at PROBE_ROWS and scaled (linear in rows)
    big = again.time("infer", 4 * precision.PROBE_ROWS, 16, 48)
    base = again.time("infer", precision.PROBE_ROWS, 16, 48)
    assert big == pytest.approx((4 * base[0], 4 * base[1]))


@pytest.mark.unit
def test_linear_shapes_of_a_gpt2_keep_the_output_embedding_apart(task):
    from shifu.models.loading import load_causal_lm

    model = load_causal_lm(task["model"])
    trunk, head = precision.linear_shapes(model)
    d, V, L = model.config.n_embd, model.config.vocab_size, model.config.n_layer
    assert head == (d, V)
    assert dict(((k, n), c) for k, n, c in trunk) == {(d, 3 * d): L, (d, d): L, (d, 4 * d): L, (4 * d, d): L}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("infer", "train", "reuse", "expected"),
    [
        (0.5, 0.5, True, (True, True, True)),  # bf16 twice as fast everywhere
        (2.0, 2.0, True, (False, False, False)),  # emulated bf16 (no avx512_bf16/AMX): fp32 everywhere
        (0.95, 0.95, False, (False, False, False)),  # within the margin: fp32 (exact) wins
        # bf16 GEMMs faster, but the fp32 update: a bf16 decode would cost the free old log-probs' forward,
        # which is worth more than the decode time it saves at these shapes
        (0.5, 1.5, True, (False, True, False)),
        (0.5, 1.5, False, (True, True, False)),  # no reuse (e.g. tis_cap): nothing to lose
    ],
)
def test_choice_follows_the_measurement(monkeypatch, infer, train, reuse, expected):
    monkeypatch.setattr(precision, "measure", fake_timings(infer, train))
    chosen = precision.choose(WORK, precision.Probe(torch.device("cpu")), reuse)
    assert (chosen.decode, chosen.frozen, chosen.update) == expected
    assert "bf16 probe" in chosen.reason and "measured now" in chosen.reason
    assert not precision.choose(
        WORK, precision.Probe(torch.device("cpu")), reuse, decode_possible=False
    ).decode


@pytest.mark.unit
def test_the_reward_model_is_decided_at_its_own_shapes(monkeypatch):
    """A wide reward model (a MiniLM's 384 x 1536 GEMMs) can gain from bf16 where a narrow policy loses:
    each frozen model gets the decision its own shapes measure."""

    def measure(kind, m, k, n, device, repeats=3):  # bf16 2x faster from width 64 on, 2x slower below
        t32 = m * k * n * 1e-12
        return t32, t32 * (0.5 if k >= 64 else 2.0)

    monkeypatch.setattr(precision, "measure", measure)
    wide = precision.Workload(
        trunk=((64, 256, 6), (256, 64, 6)), head=None, decode_rows=8, score_rows=8, train_rows=4, T=20, R=10
    )
    chosen = precision.choose(WORK, precision.Probe(torch.device("cpu")), True, reward=wide)
    assert (chosen.frozen, chosen.reward, chosen.update, chosen.decode) == (False, True, False, False)
    assert "reward model scoring forward" in chosen.reason and chosen.reason.endswith("-> bf16")
    assert chosen.any and chosen.metrics()["precision/bf16_reward"] == 1.0
    narrow = precision.choose(WORK, precision.Probe(torch.device("cpu")), True, reward=WORK)
    assert not narrow.reward and not narrow.any
    assert "reward model" not in precision.choose(WORK, precision.Probe(torch.device("cpu")), True).reason


@pytest.mark.unit
def test_bf16_autocast_on_cpu_keeps_attention_off_the_fused_flash_kernel(task):
    """torch 2.13's CPU flash-attention backward in bf16 measured 7x its fp32 time (common.autocast): under
    shifu's bf16 autocast attention runs as matmuls + softmax; fp32 keeps the fused kernel it always ran."""
    from torch.profiler import profile

    from shifu.models.loading import load_causal_lm
    from shifu.trainers.common import autocast

    model = load_causal_lm(task["model"])
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

    def ops(bf16: bool) -> set[str]:
        with profile() as prof:
            with autocast(bf16, "cpu"):
                logits = model(input_ids=ids).logits
            logits.float().logsumexp(-1).sum().backward()
        return {e.key for e in prof.key_averages()}

    fp32, bf16 = ops(False), ops(True)
    assert any("flash_attention" in k for k in fp32)
    assert not any("flash_attention" in k for k in bf16) and "aten::_softmax" in bf16


def make_run(task, tmp_path, *extra):
    cfg = load_config(
        ppo.Config,
        None,
        [
            f"out_dir={tmp_path / 'x'}",
            f"model.path={task['model']}",
            f"data.train={task['prompts']}",
            f"reward.model_path={task['rm']}",
            "critic.init=sft",
            "batch_size=8",
            "minibatch_size=4",
            "generation.max_new_tokens=6",
            "optim.lr=1e-2",
            "critic.optim.lr=1e-2",
            *extra,
        ],
    )
    tok, m, s = built(cfg)
    rows = [{"prompt": p} for p in ["abc", "defgh", "kl", "mnop"] * 2]
    b = pad_left([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows], tok.pad_token_id)
    return cfg, m, s, rows, b


def dtypes(module):
    return {p.dtype for p in module.parameters()}


@pytest.mark.integration
def test_bf16_where_faster_casts_frozen_models_once_and_keeps_fp32_masters(
    task, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(precision, "measure", fake_timings(0.5, 0.5))
    cfg, m, s, rows, b = make_run(task, tmp_path, "bf16=true")
    assert (m.precision.decode, m.precision.frozen, m.precision.update, m.precision.reward) == (True,) * 4
    assert "shifu ppo: bf16 probe" in capsys.readouterr().err  # the choice and why, said once
    reward = m.reward_model
    assert dtypes(m.ref) == {torch.bfloat16} and dtypes(reward) == {torch.bfloat16}
    assert reward.gain.dtype == torch.float32  # buffers (the normalisation) untouched
    assert dtypes(m.actor) == {torch.float32} and dtypes(m.critic) == {torch.float32}
    assert dtypes(m.decode_copy) == {torch.bfloat16}
    metrics = ppo.iteration(
        m, s, cfg, PromptBatch(b["input_ids"], b["attention_mask"], rows), ppo.sampling_params(cfg)
    )
    # master weights and optimiser state stay fp32; the frozen copies were not cast back or again
    assert dtypes(m.actor) == {torch.float32} and dtypes(m.ref) == {torch.bfloat16}
    opt_state = m.optimizers["actor"].optimizer.state
    assert opt_state and all(
        v.dtype == torch.float32
        for st in opt_state.values()
        for k, v in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    assert metrics["precision/bf16_decode"] == 1.0 and metrics["precision/bf16_update"] == 1.0
    # the decode copy and the trainer disagree by bf16 rounding only, and it is logged without tis_cap
    assert 0.0 < metrics["rollout/mismatch_abs_log_ratio"] < 0.1, metrics
    assert metrics["rollout/mismatch_k3"] >= 0.0
    # the decode copy is refreshed from the updated actor at the next rollout: equal to its bf16 cast
    stale = [p.clone() for p in m.decode_copy.parameters()]
    fresh = m.decoder()
    assert any(not torch.equal(a, b_) for a, b_ in zip(stale, fresh.parameters()))
    for a, b_ in zip(fresh.parameters(), m.actor_module.parameters(), strict=True):
        assert torch.equal(a, b_.detach().to(torch.bfloat16))


@pytest.mark.integration
def test_bf16_that_measures_slower_falls_back_to_the_fp32_path(task, tmp_path, monkeypatch):
    """Where bf16 is emulated (no avx512_bf16/AMX) the probe measures it slower: ``bf16=true`` then runs
    exactly the fp32 code, so the rollout equals a ``bf16=false`` run's bit for bit."""
    monkeypatch.setattr(precision, "measure", fake_timings(2.0, 2.0))
    out = {}
    for flag in ("true", "false"):
        cfg, m, s, rows, b = make_run(task, tmp_path / flag, f"bf16={flag}")
        assert dtypes(m.ref) == {torch.float32} and m.decode_copy is None and not m.precision.any
        batch = PromptBatch(b["input_ids"], b["attention_mask"], rows)
        out[flag] = ppo_rollout.collect_rollout(m, cfg, batch, ppo.sampling_params(cfg), s.sample_gen)
    (a, info), (c, _) = out["true"], out["false"]
    assert info["precision/bf16_decode"] == 0.0 and "rollout/mismatch_k3" not in info
    for name in ("input_ids", "old_log_probs", "ref_log_probs", "values", "scores"):
        assert torch.equal(getattr(a, name), getattr(c, name)), name


@pytest.mark.unit
@pytest.mark.parametrize(("ratio", "expected"), [(0.5, True), (2.0, False), (0.95, False)])
def test_training_steps_take_bf16_only_where_it_measures_faster(monkeypatch, task, ratio, expected):
    """``shifu sft`` / ``rm`` / ``dpo`` with ``bf16=true``: forward + backward at the model's shapes decide."""
    monkeypatch.setattr(precision, "measure", fake_timings(1.0, ratio))
    model = load_causal_lm(task["model"])
    use, reason = precision.training(model, 8, 40, precision.Probe(torch.device("cpu")))
    assert use is expected
    assert "training forward+backward" in reason and reason.endswith("bf16 autocast" if expected else "fp32")


@pytest.mark.integration
@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo"])
def test_sft_rm_and_dpo_with_bf16_that_measures_slower_run_the_fp32_steps(
    trainer, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Where bf16 is emulated, ``bf16=true`` must cost nothing: the run equals ``bf16=false``'s bit for bit,
    says why on stderr and logs ``precision/bf16_update`` 0; where it measures faster, autocast runs (the
    weights then differ from the fp32 run's) and the metric is 1. ``config.yaml`` keeps ``bf16: true``."""
    import test_dpo
    import test_rm
    import test_sft

    from shifu.trainers import dpo, reward, sft

    def dpo_cfg(model_dir, d, **over):
        return test_dpo.config(d, model_dir, "run", **over)

    module, make = {"sft": (sft, test_sft.make_cfg), "rm": (reward, test_rm.make_cfg), "dpo": (dpo, dpo_cfg)}[
        trainer
    ]
    over = {"max_steps": 6}
    runs = {}
    for name, flag, ratio in (("fp32", False, 2.0), ("slower", True, 2.0), ("faster", True, 0.5)):
        monkeypatch.setattr(precision, "measure", fake_timings(1.0, ratio))
        monkeypatch.setenv("SHIFU_CACHE", str(tmp_path / name / "cache"))  # each its own probe table
        (tmp_path / name).mkdir()
        cfg = make(tiny_model_dir, tmp_path / name, bf16=flag, **over)
        summary = module.train(cfg)
        weights = load_file(str(tmp_path / name / "run" / "final" / "model.safetensors"))
        runs[name] = (summary, weights, capsys.readouterr().err)
    assert "precision/bf16_update" not in runs["fp32"][0]
    assert (
        runs["slower"][0]["precision/bf16_update"] == 0.0
        and runs["faster"][0]["precision/bf16_update"] == 1.0
    )
    assert f"shifu {trainer}: bf16 probe" in runs["slower"][2] and runs["slower"][2].count("-> fp32") == 1
    fp32, slower, faster = (runs[k][1] for k in ("fp32", "slower", "faster"))
    assert all(torch.equal(fp32[k], slower[k]) for k in fp32)
    assert any(not torch.equal(fp32[k], faster[k]) for k in fp32)
    assert "bf16: true" in (tmp_path / "slower" / "run" / "config.yaml").read_text()

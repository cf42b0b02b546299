"""PPO trainer: learning on a task with a known true reward, conventions, frozen models, the guard."""

from __future__ import annotations

import json

import pytest
import torch
from ppo_task import build_char_model, write_prompts
from safetensors.torch import load_file

from shifu.config import load_config
from shifu.models import load_tokenizer
from shifu.rollout import policy_forward
from shifu.trainers import ppo
from shifu.trainers.ppo_loop import build_trainer


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppo_task")
    return {
        "model": build_char_model(d / "model"),
        "model_pad_eos": build_char_model(d / "pe", pad_equals_eos=True),
        "prompts": write_prompts(d / "prompts.jsonl"),
    }


def make_cfg(task, out, *extra, model="model"):
    base = [
        f"out_dir={out}",
        f"actor_path={task[model]}",
        f"data.prompts={task['prompts']}",
        "reward.function=ppo_task:frac_a",
        "eval.gold_function=ppo_task:frac_a",
        "critic.init=sft",
        "iterations=12",
        "batch_size=16",
        "minibatch_size=8",
        "generation.max_new_tokens=6",
        "optim.lr=1e-2",
        "optim.schedule=constant",
        "critic.optim.lr=1e-2",
        "kl.controller=fixed",
        "kl.init_coef=0.02",
        "eval.every=6",
        "eval.num_prompts=32",
        "save_every=0",
        "target_approx_kl=0.02",  # early stop keeps these short high-lr runs from collapsing
    ]
    return load_config(ppo.Config, None, base + list(extra))


def rows_of(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def gold_curve(out):
    return [r["gold/score"] for r in rows_of(out / "metrics.jsonl") if "gold/score" in r]


def test_ppo_raises_true_reward_with_bounded_kl(task, tmp_path):
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out))
    gold = gold_curve(out)
    kls = [r["objective/kl"] for r in rows_of(out / "metrics.jsonl") if "objective/kl" in r]
    # random policy: ~1/12 of characters are 'a'. Measured over seeds 0-3: final gold 0.39-0.78 at a
    # max KL of 5.7-10.2 nats per 6-token response; the bounds leave room for float-level drift.
    assert gold[0] < 0.2 and gold[-1] > 0.3, gold
    assert max(kls) < 12.0, kls
    assert (out / "final" / "config.json").exists() and (out / "best" / "config.json").exists()
    from shifu.metrics import undefined_keys

    assert undefined_keys(rows_of(out / "metrics.jsonl")) == []  # every logged key is in docs/metrics.md
    samples = rows_of(out / "samples.jsonl")
    assert {s["iteration"] for s in samples} == {0, 6, 12} and all("gold" in s for s in samples)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ("kl.controller=adaptive", "kl.target=4.0", "kl.horizon=16"),
        ("kl.controller=step", "kl.target=4.0"),
        ("kl.controller=penalty", "kl.target=5.0"),
        ("critic.init=shared",),
        ("algo=ppo_penalty", "penalty_init=0.1", "penalty_target=0.05", "kl.init_coef=0.05"),
        ("bf16=true", "critic.init=shared"),  # the fast defaults; bf16 recomputes the rollout log-probs
    ],
    ids=["adaptive", "step", "penalty", "shared_trunk", "ppo_penalty", "bf16_shared_trunk"],
)
def test_ppo_variants_learn(task, tmp_path, extra):
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out, "iterations=16", "eval.every=0", *extra))
    rows = [r for r in rows_of(out / "metrics.jsonl") if "objective/score" in r]
    first = sum(r["objective/score"] for r in rows[:3]) / 3
    last = sum(r["objective/score"] for r in rows[-3:]) / 3
    assert last > first + 0.1, (first, last)  # true reward of the rollouts (48 samples each side)
    target = next((float(x.split("=")[1]) for x in extra if x.startswith("kl.target=")), None)
    bound = 3 * target if target else 12.0  # nats per response; a controller keeps KL within 3x its target
    assert max(r["objective/kl"] for r in rows) < bound
    if target is not None:  # the controller moved beta
        assert any(r["objective/kl_coef"] != rows[0]["objective/kl_coef"] for r in rows)


def _trainer(task, tmp_path, *extra, model="model"):
    cfg = make_cfg(task, tmp_path / "x", *extra, model=model)
    tok = load_tokenizer(cfg.actor_path)
    trainer, _ = build_trainer(cfg, tok, torch.device("cpu"))
    rows = [{"prompt": p} for p in ["abc", "defgh", "kl"] * 4]
    from shifu.models import pad_left

    b = pad_left([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows], tok.pad_token_id)
    return trainer, tok, b, rows


def test_ratio_is_one_before_first_step(task, tmp_path):
    trainer, tok, b, rows = _trainer(task, tmp_path)
    exp = trainer.rollout(b["input_ids"], b["attention_mask"], rows)
    trainer.actor.train()
    idx = torch.tensor([5, 0, 7, 2])  # a minibatch of other rows in another order: same log-probs
    lp = policy_forward(trainer.actor, exp["input_ids"][idx], exp["attention_mask"][idx], exp["prompt_len"])[
        0
    ]
    m = exp["response_mask"][idx]
    torch.testing.assert_close(lp[m], exp["old_log_probs"][idx][m], atol=1e-5, rtol=0)


def test_fp32_rollout_takes_old_log_probs_from_the_decode_steps(task, tmp_path):
    """fp32: no actor forward over the finished sequences (the decode steps' log-probs are the rollout's
    old_log_probs); with reuse off the trainer recomputes them, and both agree to float rounding."""
    calls = []
    results = {}
    for reuse in ("true", "false"):
        trainer, tok, b, rows = _trainer(task, tmp_path / reuse, f"reuse_generation_log_probs={reuse}")
        hook = trainer.actor.register_forward_hook(lambda *a, r=reuse: calls.append(r))
        trainer.sample_gen.manual_seed(0)
        results[reuse] = trainer.rollout(b["input_ids"], b["attention_mask"], rows)
        hook.remove()
    assert calls.count("true") == 0 and calls.count("false") >= 1
    a, c = results["true"], results["false"]
    assert torch.equal(a["input_ids"], c["input_ids"])
    m = a["response_mask"]
    torch.testing.assert_close(a["old_log_probs"][m], c["old_log_probs"][m], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["entropy"][m], c["entropy"][m], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["model", "model_pad_eos"])
def test_score_lands_on_last_real_token(task, tmp_path, model):
    trainer, tok, b, rows = _trainer(task, tmp_path, model=model)
    exp = trainer.rollout(b["input_ids"], b["attention_mask"], rows)
    R = exp["response_mask"].shape[1]
    # rewrite three responses: EOS at t=1; truncated without EOS; EOS at the last position
    mask = torch.zeros_like(exp["response_mask"])
    mask[0, :2], mask[1, :], mask[2, :] = True, True, True
    ids = exp["input_ids"].clone()
    P = exp["prompt_len"]
    a = tok.convert_tokens_to_ids("a")
    ids[0, P:], ids[1, P:], ids[2, P:] = tok.pad_token_id, a, a
    ids[0, P + 1], ids[2, P + R - 1] = tok.eos_token_id, tok.eos_token_id
    for k in range(3, len(rows)):
        mask[k, :3] = True
    exp.update(response_mask=mask, input_ids=ids, scores=torch.arange(len(rows), dtype=torch.float) + 1.0)
    exp["eos_found"] = torch.tensor([True, False, True] + [False] * (len(rows) - 3))
    exp["ref_log_probs"] = exp["old_log_probs"] - 0.1  # k1 = 0.1 per real token
    trainer.cfg.whiten_advantages = False
    trainer.advantages(exp)
    beta = trainer.kl_ctl.value
    # reward = -beta*kl on every real token, plus the score on the last real one; 0 on padding
    rewards = exp["returns"] - exp["values"]  # gamma=1: not a reward; check via shaped rewards instead
    from shifu import core

    kl = core.kl_estimate(exp["old_log_probs"], exp["ref_log_probs"]) * mask
    shaped = core.shape_rewards(exp["scores"], kl, mask, beta)
    assert shaped[0, 1] == pytest.approx(1.0 - beta * 0.1, abs=1e-6) and (shaped[0, 2:] == 0).all()
    assert shaped[1, R - 1] == pytest.approx(2.0 - beta * 0.1, abs=1e-6)
    assert shaped[2, R - 1] == pytest.approx(3.0 - beta * 0.1, abs=1e-6)
    assert (exp["advantages"][~mask] == 0).all() and (exp["returns"][~mask] == 0).all()
    del rewards
    # everything after EOS is masked in every loss: garbage in padded positions changes nothing
    trainer.cfg.ent_coef = 0.01
    micro = torch.arange(len(rows))
    n = mask.sum()
    loss_a, _ = trainer._loss(exp, micro, P, n, 1.0)
    junk = dict(exp)
    for key in ("advantages", "old_log_probs", "returns", "values"):
        junk[key] = torch.where(mask, exp[key], torch.full_like(exp[key], 1e6))
    loss_b, _ = trainer._loss(junk, micro, P, n, 1.0)
    torch.testing.assert_close(loss_a, loss_b)


def test_frozen_models_never_change(task, tmp_path):
    trainer, tok, b, rows = _trainer(task, tmp_path, "iterations=2")
    before = {k: v.clone() for k, v in trainer.ref.state_dict().items()}
    actor_before = {k: v.clone() for k, v in trainer.actor.state_dict().items()}
    for _ in range(2):
        trainer.step(b["input_ids"], b["attention_mask"], rows)
    assert all(p.grad is None and not p.requires_grad for p in trainer.ref.parameters())
    assert all(torch.equal(before[k], v) for k, v in trainer.ref.state_dict().items())
    assert any(not torch.equal(actor_before[k], v) for k, v in trainer.actor.state_dict().items())


def test_nonfinite_scores_are_dropped_not_propagated(task, tmp_path):
    trainer, tok, b, rows = _trainer(task, tmp_path, "reward.function=ppo_task:nan_some")
    dropped = 0
    for _ in range(3):
        m = trainer.step(b["input_ids"], b["attention_mask"], rows)
        dropped += m["rollout/dropped_nonfinite"]
        assert all(torch.isfinite(p).all() for p in trainer.actor.parameters())
        assert torch.isfinite(torch.tensor(m["loss/policy"]))
    assert dropped > 0


def test_guard_restores_best_when_kl_explodes(task, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg(
        task,
        out,
        "reward.function=ppo_task:explode",
        "kl.init_coef=0.0",
        "optim.lr=3e-2",
        "iterations=30",
        "eval.every=1",
        "guard.kl_ceiling=6.0",
        "eval.best_metric=gold/score",
    )
    summary = ppo.train(cfg)
    assert summary["guard"] is not None and "kl_ceiling" in summary["guard"]
    assert summary["iterations"] < 30
    best = load_file(str(out / "best" / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in best)


def test_ptx_term_is_trained(task, tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": "abc", "response": "lll"}) + "\n" for _ in range(8)))
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out, f"data.ptx={sft}", "ptx_coef=1.0", "iterations=6", "eval.every=0"))
    ptx = [r["loss/ptx"] for r in rows_of(out / "metrics.jsonl") if "loss/ptx" in r]
    assert len(ptx) == 6 and ptx[-1] < 0.5 * ptx[0], ptx  # the SFT NLL of the demonstrations fell

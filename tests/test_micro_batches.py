"""Token-budget micro-batches (``micro_batch_tokens``): the same minibatch loss and gradients as the fixed
split up to float rounding, with less padding when response lengths vary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ppo_task import build_char_model, write_prompts
from test_ppo import built

from shifu.config.loader import load_config
from shifu.errors import ConfigError
from shifu.models.padding import pad_left
from shifu.rollout.batch import PromptBatch
from shifu.trainers import ppo, ppo_rollout
from shifu.trainers.ppo_update import coefficients, minibatch_loss, token_budget_split, trim_padding, update


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro_task")
    return {"model": build_char_model(d / "model"), "prompts": write_prompts(d / "prompts.jsonl")}


def make_run(task, out, *extra):
    cfg = load_config(
        ppo.Config,
        None,
        [
            f"out_dir={out}",
            f"model.path={task['model']}",
            f"data.train={task['prompts']}",
            "reward.function=ppo_task:frac_a",
            "critic.init=sft",
            "batch_size=8",
            "minibatch_size=8",
            "ppo_epochs=1",
            "generation.max_new_tokens=8",
            "optim.lr=1e-2",
            "critic.optim.lr=1e-2",
            *extra,
        ],
    )
    return cfg, *built(cfg)


def varied_rollout(task, tmp_path):
    """A real rollout whose responses end at lengths 1..8 and prompts of 1..5 tokens, with advantages."""
    cfg, tok, m, s = make_run(task, tmp_path / "r")
    prompts = ["a", "abcde", "ab", "abc", "abcd", "b", "cd", "e"]
    rows = [{"prompt": p} for p in prompts]
    b = pad_left([tok(p, add_special_tokens=False)["input_ids"] for p in prompts], tok.pad_token_id)
    params = dataclasses.replace(ppo.sampling_params(cfg), stop_at_eos=False)
    batch = PromptBatch(b["input_ids"], b["attention_mask"], rows)
    r, _ = ppo_rollout.collect_rollout(m, cfg, batch, params, s.sample_gen)
    lengths = torch.tensor([3, 8, 1, 6, 2, 8, 5, 4])  # responses stop (EOS) at varied lengths
    R = r.response_mask.shape[1]
    mask = torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)
    P = r.prompt_len
    ids = r.input_ids.clone()
    ids[:, P:] = ids[:, P:].masked_fill(~mask, tok.pad_token_id)
    ids[torch.arange(8), P + lengths - 1] = tok.eos_token_id
    am = torch.cat([r.attention_mask[:, :P], mask.long()], dim=1)
    g = torch.Generator().manual_seed(0)
    return dataclasses.replace(
        r,
        input_ids=ids,
        attention_mask=am,
        response_mask=mask,
        advantages=torch.randn(8, R, generator=g) * mask,
        returns=torch.randn(8, R, generator=g) * mask,
    )


@pytest.mark.integration
def test_token_budget_micro_batches_trim_padding_and_keep_the_minibatch_loss(task, tmp_path):
    rollout = varied_rollout(task, tmp_path)
    cfg, _, m, s = make_run(task, tmp_path / "a")
    idx = torch.arange(8)
    n_tokens = rollout.response_mask.sum()
    micros = token_budget_split(idx, rollout, 24, m.strategy)
    assert sorted(torch.cat(micros).tolist()) == list(range(8)) and len(micros) > 2
    padded = trimmed = 0
    for micro in micros:
        mb = trim_padding(rollout.select(micro))
        assert mb.input_ids.numel() <= 24 or len(micro) == 1  # within budget (a long row alone)
        assert mb.response_mask.sum() == rollout.response_mask[micro].sum()  # no real token lost
        padded += rollout.select(micro).input_ids.numel()
        trimmed += mb.input_ids.numel()
    assert trimmed < 0.7 * padded

    def loss_and_grads(split):
        m.actor.zero_grad(set_to_none=True), m.critic.zero_grad(set_to_none=True)
        total = 0.0
        for micro in split:
            mb = rollout.select(micro)
            mb = trim_padding(mb) if len(split) > 1 else mb
            for _, loss, _ in minibatch_loss(m, cfg, mb, n_tokens, len(micro) / 8, **coefficients(s)):
                loss.backward()  # (the actor's part, then the critic's)
                total += float(loss.detach())
        params = [*m.actor.parameters(), *m.critic.parameters()]
        return total, [p.grad.clone() for p in params]

    whole, g_whole = loss_and_grads([idx])
    split, g_split = loss_and_grads(micros)
    assert split == pytest.approx(whole, rel=1e-5, abs=1e-6)
    for a, b in zip(g_whole, g_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_update_with_a_token_budget_takes_the_fixed_split_step(task, tmp_path):
    """One optimiser step (ppo_epochs=1, one minibatch): the gradients it applies and its logged losses
    match the default's up to float rounding."""
    rollout = varied_rollout(task, tmp_path)
    seen = {}
    for budget in (None, 20):
        extra = [f"micro_batch_tokens={budget}"] if budget else []
        cfg, _, m, s = make_run(task, tmp_path / str(budget), *extra)
        grads = seen.setdefault(budget, {})
        m.optimizers["actor"].optimizer.register_step_pre_hook(
            lambda opt, *a, g=grads: g.update(actor=[p.grad.clone() for p in opt.param_groups[0]["params"]])
        )
        grads["stats"] = update(m, s, cfg, rollout)
    a, b = seen[None], seen[20]
    for k in ("loss/policy", "loss/value", "policy/approx_kl", "policy/clipfrac"):
        assert b["stats"][k] == pytest.approx(a["stats"][k], rel=1e-4, abs=1e-6), k
    for x, y in zip(a["actor"], b["actor"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.unit
def test_micro_batch_tokens_replaces_grad_accum(task, tmp_path):
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        make_run(task, tmp_path, "micro_batch_tokens=64", "grad_accum=2")

"""The objective under staleness: decoupled PPO's importance weight (behaviour log-probs for the weight, the
proximal policy's for the clip), SAO's double-sided mask (tokens outside the band dropped, not clipped), hand
values; the settings' checks; K critic updates per actor update in a real iteration."""

import math

import pytest
import torch
from test_ppo import Run, task  # noqa: F401 (the fixture)

from shifu.config.loader import load_config
from shifu.core import POLICY_LOSSES, decoupled_is_weights, outside_band, truncated_is_weights
from shifu.errors import ConfigError
from shifu.trainers import ppo

torch.set_num_threads(1)

L = math.log
# proximal / behaviour ratios 2, 1, 0.5 on the real tokens; the last position of row 1 is padding
PROX = torch.tensor([[L(0.5), L(0.9)], [L(0.2), 50.0]])
BEHAV = torch.tensor([[L(0.25), L(0.9)], [L(0.4), float("nan")]])
MASK = torch.tensor([[True, True], [True, False]])


@pytest.mark.unit
def test_decoupled_weights_hand_computed():
    w = decoupled_is_weights(PROX, BEHAV, MASK)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0], [0.5, 0.0]]))
    assert not decoupled_is_weights(PROX.clone().requires_grad_(True), BEHAV, MASK).requires_grad
    # capped: truncated importance sampling, bit for bit
    assert torch.equal(
        decoupled_is_weights(PROX, BEHAV, MASK, cap=1.5), truncated_is_weights(PROX, BEHAV, MASK, 1.5)
    )
    # SAO's band [0.6, 1.8]: the ratio-2 and ratio-0.5 tokens are dropped (weight 0), the ratio-1 token kept
    w = decoupled_is_weights(PROX, BEHAV, MASK, band=(0.6, 1.8))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert outside_band(PROX, BEHAV, MASK, (0.6, 1.8)).tolist() == [[True, False], [True, False]]
    # the band reads the ratio before the cap: a capped weight of a token outside the band is still dropped
    w = decoupled_is_weights(PROX, BEHAV, MASK, cap=1.5, band=(0.4, 1.8))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0], [0.5, 0.0]]))
    # inside a wide band nothing changes
    assert torch.equal(
        decoupled_is_weights(PROX, BEHAV, MASK, band=(0.1, 10.0)), decoupled_is_weights(PROX, BEHAV, MASK)
    )
    with pytest.raises(ValueError, match="0 <= low <= 1 <= high"):
        decoupled_is_weights(PROX, BEHAV, MASK, band=(1.2, 2.0))


@pytest.mark.unit
def test_decoupled_loss_hand_computed_clip_around_the_proximal_policy():
    """L = -sum_t w_t min(r_t A_t, clip(r_t) A_t) / n, r_t = pi / pi_prox, w_t = pi_prox / pi_behav."""
    pi = torch.tensor([[L(0.6), L(0.9)], [L(0.1), 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0], [2.0, 0.0]])
    # r = 1.2, 1.0, 0.5; clipped at 0.8 for the third: min(0.5 * 2, 0.8 * 2) = 1.0
    plain, _ = POLICY_LOSSES["ppo"](pi, PROX, adv, MASK)
    assert plain.item() == pytest.approx(-(1.2 - 1.0 + 1.0) / 3)
    w = decoupled_is_weights(PROX, BEHAV, MASK)
    loss, _ = POLICY_LOSSES["ppo"](pi, PROX, adv * w, MASK)
    assert loss.item() == pytest.approx(-(2 * 1.2 + 1 * -1.0 + 0.5 * 1.0) / 3)
    # masked by SAO's band: only the middle token counts, the divisor still 3 real tokens
    masked, _ = POLICY_LOSSES["ppo"](
        pi, PROX, adv * decoupled_is_weights(PROX, BEHAV, MASK, band=(0.6, 1.8)), MASK
    )
    assert masked.item() == pytest.approx(1.0 / 3)
    masked.backward()
    assert pi.grad[0, 0] == 0 and pi.grad[1, 0] == 0 and pi.grad[0, 1] != 0  # dropped tokens: no gradient


@pytest.mark.unit
@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("is_mask=1.0", "is_mask must be > 1"),
        ("critic_updates=0", "critic_updates must be >= 1"),
        ("max_staleness=-1", "max_staleness must be >= 0"),
        ("async_samplers=0", "async_samplers must be >= 1"),
        ("async_schedule=lazy", "async_schedule"),
    ],
)
def test_bad_async_settings_are_refused(tmp_path, setting, match):
    base = [f"out_dir={tmp_path}", "model.path=m", "data.train=p.jsonl", "reward.function=ppo_task:frac_a"]
    with pytest.raises(ConfigError, match=match):
        load_config(ppo.Config, None, [*base, setting])


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra", [["critic.init=shared"], ["joint_optimizer=true"], ["advantage_estimator=rloo", "group_size=2"]]
)
def test_critic_updates_need_a_critic_of_its_own(tmp_path, extra):
    base = [f"out_dir={tmp_path}", "model.path=m", "data.train=p.jsonl", "reward.function=ppo_task:frac_a"]
    with pytest.raises(ConfigError, match="critic_updates > 1 needs a separate critic"):
        load_config(ppo.Config, None, [*base, "critic_updates=3", *extra])


@pytest.mark.unit
def test_staleness_runs_in_one_process(tmp_path):
    base = [f"out_dir={tmp_path}", "model.path=m", "data.train=p.jsonl", "reward.function=ppo_task:frac_a"]
    with pytest.raises(ConfigError, match="max_staleness > 0 runs in one process"):
        load_config(ppo.Config, None, [*base, "max_staleness=1", "distributed.strategy=ddp"])


def _steps(optimizer) -> set[int]:
    return {int(st["step"]) for st in optimizer.state.values()}


@pytest.mark.integration
def test_critic_updates_give_the_critic_k_times_the_actors_steps(task, tmp_path):  # noqa: F811
    # batch 16 / minibatch 8 x ppo_epochs 1: 2 optimiser steps of the actor per iteration
    run = Run(task, tmp_path, "critic_updates=3", "ppo_epochs=1", "target_approx_kl=null")
    before = {n: p.detach().clone() for n, p in run.m.critic.named_parameters()}
    metrics = run.iteration()
    assert _steps(run.m.optimizers["actor"].optimizer) == {2}
    assert _steps(run.m.optimizers["critic"].optimizer) == {6}
    assert "loss/value_last" in metrics and math.isfinite(metrics["loss/value_last"])
    assert any(not torch.equal(p, before[n]) for n, p in run.m.critic.named_parameters())
    one = Run(task, tmp_path, "ppo_epochs=1", "target_approx_kl=null")  # K=1: today's one pass
    assert "loss/value_last" not in one.iteration()
    assert _steps(one.m.optimizers["critic"].optimizer) == {2}


@pytest.mark.integration
def test_decoupled_and_masked_iterations_log_their_weights(task, tmp_path):  # noqa: F811
    run = Run(task, tmp_path, "decoupled=true", "is_mask=2.0")
    m = run.iteration()
    # one version: behaviour and proximal policies are the same weights, so every weight is ~1, nothing masked
    assert m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["rollout/is_maskfrac"] == 0.0
    assert m["rollout/mismatch_abs_log_ratio"] < 1e-4


@pytest.mark.unit
def test_pending_batches_survive_json_bit_for_bit():
    """What a checkpoint keeps of a batch sampled and not yet trained reads back to the same bits (NaN rewards,
    bf16 log-probs, transcripts, counts, the source's metrics)."""
    import json

    from shifu.rollout.batch import Trajectories, Transcript
    from shifu.trainers.ppo_async import pack, unpack

    g = torch.Generator().manual_seed(0)
    B, P, R = 2, 3, 4
    made = Trajectories(
        prompt_ids=torch.randint(0, 50, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.bool),
        ids=torch.randint(0, 50, (B, R), generator=g),
        trainable=torch.rand(B, R, generator=g) > 0.3,
        attention=torch.ones(B, R, dtype=torch.bool),
        rewards=torch.tensor([[0.0, 0.1, float("nan"), 1 / 3], [0.0, 0.0, 0.0, -2.5]]),
        truncated=torch.tensor([False, True]),
        failed=torch.tensor([False, False]),
        rows=[{"prompt": "abc", "n": 1}, {"prompt": "de"}],
        transcripts=[
            Transcript((("input", "abc"), ("sampled", "x")), "x"),
            Transcript((("input", "de"),), ""),
        ],
        log_probs=torch.randn(B, R, generator=g).to(torch.bfloat16),
        entropy=torch.rand(B, R, generator=g),
        counts={"turns": [1, 2]},
        metrics={"env/turns": 1.5},
    )
    back = unpack(json.loads(json.dumps(pack(made))))
    for f in (
        "prompt_ids",
        "prompt_mask",
        "ids",
        "trainable",
        "attention",
        "rewards",
        "truncated",
        "log_probs",
        "entropy",
    ):
        a, b = getattr(made, f), getattr(back, f)
        assert (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.view(-1).view(torch.uint8).tolist() == b.view(-1).view(torch.uint8).tolist()
        ), f
    assert back.values is None and back.turn_ends is None
    assert back.rows == made.rows and back.transcripts == made.transcripts
    assert back.counts == made.counts and back.metrics == made.metrics

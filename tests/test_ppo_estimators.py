"""The critic-free family in the PPO trainer: group sampling, advantage estimators by name, GSPO, the KL as
a loss term, dynamic sampling, truncated importance sampling, critic warm-up and process rewards.

Runs use the synthetic character task of ``ppo_task`` (true reward: the fraction of 'a' characters, about
0.1 for the random policy), so every method is judged by the reward it was meant to raise.
"""

from __future__ import annotations

import pytest
import torch
from ppo_task import SEEN
from safetensors.torch import load_file
from test_ppo import gold_curve, make_cfg, rows_of
from test_ppo import task as task  # the module's fixture: the char model and its prompts

from shifu.errors import ConfigError, ShifuError
from shifu.models.loading import load_tokenizer
from shifu.rollout.sources import place_steps
from shifu.runs import checkpoint as ckpt
from shifu.trainers import ppo
from shifu.trainers.ppo_advantages import ESTIMATORS, Signals

QUIET = ("progress=false", "tensorboard=false")
METHODS = {
    "grpo": ["advantage_estimator=grpo", "group_size=4"],
    "dr_grpo": ["advantage_estimator=dr_grpo", "group_size=4", "loss_aggregation=token_sum_norm"],
    "rloo": ["advantage_estimator=rloo", "group_size=4"],
    "bon": ["advantage_estimator=bon", "group_size=4", "kl.penalty=loss"],
    "rloo_reinforce": ["advantage_estimator=rloo", "group_size=4", "algo=reinforce", "ppo_epochs=1"],
    "reinforce_pp": ["advantage_estimator=reinforce_pp"],
    "reinforce_pp_baseline": ["advantage_estimator=reinforce_pp_baseline", "group_size=4"],
    "gspo": [
        "advantage_estimator=grpo",
        "group_size=4",
        "algo=gspo",
        "clip_low=3e-4",
        "clip_high=4e-4",
        "loss_aggregation=seq_mean",
    ],
    "grpo_kl_loss": ["advantage_estimator=grpo", "group_size=4", "kl.penalty=loss"],
    "grpo_kl_loss_k2": [
        "advantage_estimator=grpo",
        "group_size=4",
        "kl.penalty=loss",
        "kl.loss_estimator=k2",
    ],
    "process_reinforce_pp": ["advantage_estimator=reinforce_pp", "reward.function=ppo_task:a_steps"],
    "process_grpo": ["advantage_estimator=grpo", "group_size=4", "reward.function=ppo_task:a_steps"],
}


def weights(d):
    return load_file(str(d / "model.safetensors"))


@pytest.mark.integration
@pytest.mark.parametrize("method", sorted(METHODS))
def test_critic_free_methods_raise_the_true_reward_without_a_critic(task, tmp_path, method):
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out, *METHODS[method], *QUIET))
    gold = gold_curve(out)
    # from 0.098 (iteration 0); measured at the end (seed 0): 0.33 (reinforce_pp_baseline) to 0.59
    assert gold[0] < 0.15 and gold[-1] > 0.25, gold
    assert not (out / "critic").exists()  # no critic built, trained or saved
    latest = ckpt.latest_checkpoint(out)
    assert (latest / "model-actor.safetensors").exists() and not (
        latest / "model-critic.safetensors"
    ).exists()
    state = torch.load(latest / "state.pt", weights_only=False)
    assert not any("critic" in str(k) for k in state), list(state)


@pytest.mark.integration
def test_groups_stay_together_and_the_prompt_stream_counts_prompts(task, tmp_path, capsys):
    SEEN.clear()
    cfg = make_cfg(
        task,
        tmp_path / "run",
        *METHODS["grpo"],
        "iterations=2",
        "eval.every=0",
        "reward.function=ppo_task:frac_a_seen",
        *QUIET,
    )
    ppo.train(cfg)
    assert "4 prompts x 4 responses per iteration (batch_size 16 counts responses)" in capsys.readouterr().err
    for rows in SEEN[:2]:  # the two rollouts (evaluation scores with the gold judge)
        assert len(rows) == 16  # batch_size counts responses: 4 prompts x G = 4
        groups = [rows[i : i + 4] for i in range(0, 16, 4)]
        assert all(len(set(g)) == 1 for g in groups), groups  # row i answers prompt i // G
        assert len({g[0] for g in groups}) == 4
    assert not {p for p in SEEN[0]} & {p for p in SEEN[1]}  # the stream moved on by 4 prompts, not 16


@pytest.mark.integration
def test_dynamic_sampling_drops_tied_groups_from_the_update(task, tmp_path):
    """Every group tied (a constant reward): each is dropped and counted, and the actor never moves."""
    out = tmp_path / "run"
    cfg = make_cfg(
        task,
        out,
        *METHODS["grpo"],
        "dynamic_sampling=true",
        "iterations=3",
        "eval.every=0",
        "reward.function=ppo_task:constant",
        *QUIET,
    )
    ppo.train(cfg)
    rows = [r for r in rows_of(out / "metrics.jsonl") if "rollout/groups_dropped" in r]
    assert [r["rollout/groups_dropped"] for r in rows] == [4, 4, 4]
    start, final = weights(task["model"]), weights(out / "final")
    assert all(torch.equal(start[k], final[k]) for k in start)
    # an informative reward: groups are kept and the policy learns
    out2 = tmp_path / "learns"
    ppo.train(make_cfg(task, out2, *METHODS["grpo"], "dynamic_sampling=true", *QUIET))
    assert gold_curve(out2)[-1] > 0.25


@pytest.mark.integration
@pytest.mark.parametrize(
    "method",
    [
        ["critic.init=sft"],
        ["advantage_estimator=reinforce_pp"],
        ["advantage_estimator=reinforce_pp_baseline"],
        ["algo=reinforce", "ppo_epochs=1"],
    ],
    ids=["gae", "reinforce_pp", "reinforce_pp_baseline", "reinforce"],
)
def test_dynamic_sampling_with_per_token_and_batch_estimators(task, tmp_path, method):
    """Estimators that shape per-token rewards or whiten over the batch take the dropped rows out: some
    groups tied -> dropped and counted, the update still runs on the rest; every group tied -> no update."""
    out = tmp_path / "some"
    ppo.train(
        make_cfg(
            task,
            out,
            *method,
            "group_size=4",
            "dynamic_sampling=true",
            "iterations=3",
            "eval.every=0",
            "reward.function=ppo_task:tied_half",
            *QUIET,
        )
    )
    rows = [r for r in rows_of(out / "metrics.jsonl") if "rollout/groups_dropped" in r]
    dropped = [r["rollout/groups_dropped"] for r in rows]
    assert len(rows) == 3 and sum(dropped) > 0 and min(dropped) < 4, dropped
    assert all(torch.isfinite(torch.tensor(r["loss/policy"])) for r in rows)
    start, moved = weights(task["model"]), weights(out / "final")
    assert any(not torch.equal(start[k], moved[k]) for k in start)
    out2 = tmp_path / "all"
    ppo.train(
        make_cfg(
            task,
            out2,
            *method,
            "group_size=4",
            "dynamic_sampling=true",
            "iterations=2",
            "eval.every=0",
            "reward.function=ppo_task:constant",
            *QUIET,
        )
    )
    rows = [r for r in rows_of(out2 / "metrics.jsonl") if "rollout/groups_dropped" in r]
    assert [r["rollout/groups_dropped"] for r in rows] == [4, 4]
    final = weights(out2 / "final")
    assert all(torch.equal(start[k], final[k]) for k in start)


@pytest.mark.integration
@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_kl_as_a_loss_term_holds_the_policy_near_the_reference(task, tmp_path, estimator):
    kls = {}
    for beta in (0.02, 1.0):
        out = tmp_path / f"beta{beta}"
        ppo.train(
            make_cfg(
                task,
                out,
                *METHODS["grpo_kl_loss"],
                f"kl.init_coef={beta}",
                f"kl.loss_estimator={estimator}",
                *QUIET,
            )
        )
        last = rows_of(out / "metrics.jsonl")[-1]
        assert last["loss/kl"] > 0
        kls[beta] = last["objective/kl_k3"]
    # measured 9.5 vs 0.6 nats per response
    assert kls[1.0] < kls[0.02] / 4, kls


@pytest.mark.integration
def test_exact_kl_that_would_not_fit_in_memory_is_refused_before_anything_is_written(
    task, tmp_path, monkeypatch
):
    """The reference's (B, R, V) log-probs are sized against the memory free on the device (MemAvailable here,
    read for real) and refused over half of it, naming the size and what to change."""
    from shifu.parallel.strategy import Strategy

    free = Strategy(None).free_memory()
    assert free is not None and free > 2**20  # Linux: the kernel's MemAvailable, in bytes
    monkeypatch.setattr(Strategy, "free_memory", lambda self: 1000)  # a device with 1000 bytes free
    out = tmp_path / "run"
    cfg = make_cfg(task, out, *METHODS["grpo_kl_loss"], "kl.loss_estimator=full", *QUIET)
    with pytest.raises(
        ShifuError, match=r"kl.loss_estimator=full .* GiB on this process.*kl.loss_estimator=k3"
    ):
        ppo.train(cfg)
    assert not out.exists()
    ppo.train(make_cfg(task, out, *METHODS["grpo_kl_loss"], "kl.loss_estimator=k3", "iterations=1", *QUIET))


@pytest.mark.integration
@pytest.mark.parametrize("bf16", [False, True])
def test_truncated_importance_sampling_logs_the_rollout_mismatch(task, tmp_path, bf16):
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out, "tis_cap=2.0", f"bf16={str(bf16).lower()}", "iterations=4", *QUIET))
    rows = [r for r in rows_of(out / "metrics.jsonl") if "rollout/mismatch_abs_log_ratio" in r]
    assert len(rows) == 4
    for r in rows:
        assert 0 < r["rollout/mismatch_is_weight_mean"] <= 2.0
        if bf16:  # bf16 decode steps and the full-sequence forward round differently (measured ~1e-3)
            assert r["rollout/mismatch_abs_log_ratio"] > 0
        else:  # fp32: the trainer's forward reproduces the decode's log-probs
            assert r["rollout/mismatch_abs_log_ratio"] < 1e-5
            assert r["rollout/mismatch_is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.integration
def test_critic_warmup_keeps_the_actor_still_and_resumes_exactly(task, tmp_path):
    common = [
        *QUIET,
        "critic_warmup=3",
        "save_every=1",
        "keep_last=10",
        "eval.every=0",
        "critic.optim.schedule=constant",
    ]  # (a schedule over more iterations would differ)
    clean = tmp_path / "clean"
    ppo.train(make_cfg(task, clean, "iterations=5", *common))
    start = weights(task["model"])
    for step, moved in ((3, False), (4, True)):  # the actor sits still through the warm-up, then moves
        actor = load_file(str(clean / "checkpoints" / f"step-{step:08d}" / "model-actor.safetensors"))
        common_keys = start.keys() & actor.keys()  # (a tied embedding is stored once, under either name)
        assert len(common_keys) > 10
        assert all(torch.equal(start[k], actor[k]) for k in common_keys) is not moved, step
    rows = rows_of(clean / "metrics.jsonl")
    warm = [r for r in rows if r.get("step") in (1, 2, 3) and "loss/value" in r]
    assert len(warm) == 3 and all("loss/policy" not in r for r in warm)  # only the critic trained
    assert all("loss/policy" in r for r in rows if r.get("step") in (4, 5))
    # stopped inside the warm-up (iteration 2 of 3), resumed to 5: the same weights as the clean run
    resumed = tmp_path / "resumed"
    ppo.train(make_cfg(task, resumed, "iterations=2", *common))
    ppo.train(make_cfg(task, resumed, "iterations=5", *common), resume=True)
    for d in ("final", "critic"):
        a, b = weights(clean / d), weights(resumed / d)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), d


@pytest.mark.integration
def test_a_group_run_resumes_exactly(task, tmp_path):
    """G = 4 responses per prompt: the prompt stream counts prompts (batch_size / G a step) and the checkpoint
    carries it, so 2 iterations + --resume to 5 equal 5 uninterrupted iterations (metrics and weights)."""
    common = [*METHODS["rloo"], *QUIET, "save_every=1", "eval.every=0", "optim.schedule=constant"]
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    ppo.train(make_cfg(task, clean, "iterations=5", *common))
    ppo.train(make_cfg(task, resumed, "iterations=2", *common))
    ppo.train(make_cfg(task, resumed, "iterations=5", *common), resume=True)
    # the first run planned 2 iterations (sizes/) and evaluated at its end, iteration 2 (eval/, gold/)
    drop = ("time/", "perf/", "sizes/", "eval/", "gold/")
    a, b = (
        [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows_of(d / "metrics.jsonl")]
        for d in (clean, resumed)
    )
    assert a == b
    x, y = weights(clean / "final"), weights(resumed / "final")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.unit
def test_step_rewards_land_on_the_token_that_completes_the_step(tiny_model_dir):
    """A step ending at character ``end`` earns its reward on the first token whose decoded prefix reaches
    ``end`` characters; two steps completed by one token add up there."""
    tok = load_tokenizer(tiny_model_dir)
    texts = ["hello world and more", "a b"]
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    R = max(map(len, enc)) + 1
    ids = torch.full((2, R), tok.pad_token_id)
    mask = torch.zeros(2, R, dtype=torch.bool)
    for i, e in enumerate(enc):
        ids[i, : len(e)], mask[i, : len(e)] = torch.tensor(e), True
    steps = [[(5, 1.0), (11, 0.0), (20, 3.0)], [(1, 0.5), (2, 0.25)]]
    out, ends = place_steps(tok, ids, mask, steps)
    expected, expected_ends = torch.zeros(2, R), torch.zeros(2, R, dtype=torch.bool)
    for i, row in enumerate(steps):
        for end, reward in row:  # the first token whose decoded prefix reaches `end` characters
            k = next(k for k in range(len(enc[i])) if len(tok.decode(enc[i][: k + 1])) >= end)
            expected[i, k] += reward
            expected_ends[i, k] = True  # a step of reward 0 ends there too
    assert torch.equal(out, expected), (out, expected)
    assert torch.equal(ends, expected_ends) and ends[0].sum() == 3, ends
    assert out[0].sum() == 4.0 and out[1].sum() == 0.75 and (out[~mask] == 0).all()


@pytest.mark.unit
def test_process_rewards_credit_the_tokens_up_to_their_step():
    """reinforce_pp and gae (gamma = lam = 1, values 0, no whitening, no KL): the advantage of a token is
    the sum of the step rewards from it on, so a reward at token 2 credits tokens 0-2 and none after."""
    from shifu.config.schema import PPOConfig

    mask = torch.ones(1, 6, dtype=torch.bool)
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, -0.5]])
    x = Signals(torch.zeros(1), token_rewards, torch.zeros(1, 6), 0.0, mask, torch.zeros(1, 6), mask)
    cfg = PPOConfig(whiten_advantages=False, gamma=1.0, lam=1.0)
    expected = torch.tensor([[0.5, 0.5, 0.5, -0.5, -0.5, -0.5]])
    for name in ("reinforce_pp", "gae"):
        adv, _ = ESTIMATORS[name](x, cfg, None)
        assert torch.allclose(adv, expected), (name, adv)


@pytest.mark.unit
def test_group_estimators_normalise_process_rewards_per_step():
    """grpo / dr_grpo with process rewards (DeepSeekMath's process supervision): the group's steps are 1 and
    -0.5 (response 0, ending at tokens 2 and 5), 0 (a step of reward 0 ending at token 3 of response 1) and
    response 1's score 0.25 on its last token, minus beta * KL of each step's tokens (0.1 a token, beta 0.5).
    A token's advantage sums the normalised steps from it on; rloo and bon refuse per-token rewards."""
    from shifu.config.schema import PPOConfig

    mask = torch.ones(2, 6, dtype=torch.bool)
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, -0.5], [0.0] * 6])
    steps = torch.tensor(
        [[False, False, True, False, False, True], [False, False, False, True, False, False]]
    )
    kl = torch.full((2, 6), 0.1)
    x = Signals(torch.tensor([0.0, 0.25]), token_rewards, kl, 0.5, mask, torch.zeros(2, 6), mask, steps)
    # steps: 1 - 0.15, -0.5 - 0.15, 0 - 0.2, 0.25 - 0.1 (the last token ends response 1's second step)
    r = torch.tensor([0.85, -0.65, -0.2, 0.15])
    c = r - r.mean()
    dr = torch.tensor([[c[0] + c[1]] * 3 + [c[1]] * 3, [c[2] + c[3]] * 4 + [c[3]] * 2])
    cfg = PPOConfig(group_size=2, advantage_estimator="dr_grpo", loss_aggregation="token_sum_norm")
    adv, _ = ESTIMATORS["dr_grpo"](x, cfg, None)
    torch.testing.assert_close(adv, dr)
    adv, _ = ESTIMATORS["grpo"](x, PPOConfig(group_size=2, advantage_estimator="grpo"), None)
    torch.testing.assert_close(adv, dr / (r.std() + 1e-6))
    for name in ("rloo", "bon"):
        with pytest.raises(ShifuError, match="compares one number per response"):
            ESTIMATORS[name](x, PPOConfig(group_size=2), None)


@pytest.mark.integration
def test_process_reward_run_raises_the_true_reward_with_gae(task, tmp_path):
    out = tmp_path / "run"
    ppo.train(make_cfg(task, out, "reward.function=ppo_task:a_steps", *QUIET))
    assert gold_curve(out)[-1] > 0.25
    assert rows_of(out / "metrics.jsonl")[-1]["objective/process_reward"] > 0.25


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["advantage_estimator=grpo"], "group_size >= 2"),
        (["dynamic_sampling=true"], "group_size >= 2"),
        (["advantage_estimator=rloo", "group_size=3"], "multiple of group_size"),
        (["advantage_estimator=dr_grpo", "group_size=4"], "token_sum_norm"),
        (["algo=gspo"], "3e-4"),
        (["critic_warmup=2", "advantage_estimator=reinforce_pp"], "separate critic"),
        (["critic_warmup=2", "critic.init=shared"], "separate critic"),
        (["tis_cap=0"], "tis_cap"),
    ],
)
def test_bad_combinations_are_refused_before_anything_runs(task, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        make_cfg(task, tmp_path / "run", *extra)
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
def test_an_evaluations_return_counts_the_process_steps(task):
    """A process-reward function scores a response by its steps: the evaluation's return (eval/score) is their
    sum, not the 0 its number slot holds."""
    import ppo_task

    from shifu.evaluation.evaluate import encode_prompts, evaluate, prompt_batches
    from shifu.generation.rollout import SamplingParams
    from shifu.models.loading import load_causal_lm
    from shifu.rewards.sources import RewardSource
    from shifu.rollout.sources import Policy, SingleTurn

    tok = load_tokenizer(task["model"])
    model = load_causal_lm(task["model"], dropout=False).eval()
    rows = [{"prompt": p} for p in ("abc", "def", "ghij", "kl")]
    batches = prompt_batches(tok, rows, encode_prompts(tok, rows, None, False), 4)
    source = SingleTurn(RewardSource(function=ppo_task.a_steps))
    done = evaluate(Policy(model, tok), source, batches, SamplingParams(6), torch.Generator().manual_seed(0))
    want = [
        sum(r for _, r in steps)
        for steps in ppo_task.a_steps([r["prompt"] for r in rows], done.responses, rows)
    ]
    assert done.returns == pytest.approx(want, abs=1e-6) and any(w != 0 for w in want)

"""The bag-of-tokens reward model (``rm.model.path=bag-of-tokens``) and dense rewards from a reward model's
prefix scores (``ppo.reward.dense``): it learns a word preference, its ridge penalty shrinks what the data
does not support, it reloads bit for bit, each token's reward is its own weight, and PPO on the dense reward
raises the true reward."""

from __future__ import annotations

import pytest
import torch
from test_ppo import gold_curve, make_cfg, rows_of
from test_ppo import task as task  # the module's fixture: the char model and its prompts
from test_rm import make_cfg as rm_cfg
from test_rm import pref_rows

from shifu.config.loader import load_config
from shifu.errors import ConfigError
from shifu.models.loading import load_tokenizer
from shifu.models.scalar import ScalarModel
from shifu.rewards.ensemble import load_reward
from shifu.rewards.sources import RewardSource
from shifu.trainers import ppo, reward

BOW = {"path": "bag-of-tokens"}


@pytest.mark.integration
def test_bag_of_tokens_learns_the_word_preference_and_reloads_bit_for_bit(tiny_model_dir, tmp_path):
    """Chosen responses hold " great": accuracy goes from chance to >= 0.95, " great" ends up the heaviest
    token, and the saved model scores the held-out pairs exactly as the run reported."""
    cfg = rm_cfg(
        tiny_model_dir,
        tmp_path,
        model=BOW | {"tokenizer": str(tiny_model_dir)},
        optim={"lr": 0.05},
        max_steps=60,
        l2_coef=1e-3,
    )
    summary = reward.train(cfg)
    rows = rows_of(tmp_path / "run" / "metrics.jsonl")
    first = next(r["eval/rm/accuracy"] for r in rows if "eval/rm/accuracy" in r)
    assert first <= 0.6 and summary["eval/rm/accuracy"] >= 0.95, (first, summary["eval/rm/accuracy"])
    rm = load_reward(tmp_path / "run")
    assert isinstance(rm, ScalarModel) and rm.is_causal and rm.config.model_type == "shifu_bag_of_tokens"
    tok = load_tokenizer(tiny_model_dir)
    weight = rm.backbone.weight.weight[:, 0]
    great = tok(" great", add_special_tokens=False)["input_ids"]
    assert int(weight.argmax()) in great, tok.convert_ids_to_tokens([int(weight.argmax())])
    held = pref_rows(60, seed=1)
    chosen = rm.score_texts([r["prompt"] for r in held], [r["chosen"] for r in held])
    rejected = rm.score_texts([r["prompt"] for r in held], [r["rejected"] for r in held])
    assert (chosen > rejected).float().mean().item() == pytest.approx(summary["eval/rm/accuracy"])
    again = load_reward(tmp_path / "run").score_texts(
        [r["prompt"] for r in held], [r["chosen"] for r in held]
    )
    assert torch.equal(again, chosen)


@pytest.mark.integration
def test_the_ridge_penalty_shrinks_the_weights_of_what_the_pairs_do_not_decide(tiny_model_dir, tmp_path):
    """Tokens that appear on both sides alike carry no preference; with l2_coef their weights shrink (AdamW's
    decoupled weight decay would leave them where the noise put them) while the preference is kept."""
    norms = {}
    for l2 in (0.0, 1e-2):
        (tmp_path / f"l2-{l2}").mkdir()
        cfg = rm_cfg(
            tiny_model_dir,
            tmp_path / f"l2-{l2}",
            model=BOW | {"tokenizer": str(tiny_model_dir)},
            optim={"lr": 0.05},
            max_steps=200,
            l2_coef=l2,
        )
        summary = reward.train(cfg)
        assert summary["eval/rm/accuracy"] >= 0.9
        w = load_reward(tmp_path / f"l2-{l2}" / "run").backbone.weight.weight[:, 0].detach().clone()
        great = w.argmax()
        norms[l2] = (float(w[great]), float(w[torch.arange(len(w)) != great].norm()))
    assert norms[1e-2][1] < 0.6 * norms[0.0][1], norms  # the noise shrinks ...
    assert norms[1e-2][0] > 2 * norms[1e-2][1], norms  # ... more than the preference


@pytest.mark.unit
@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"model": BOW}, "needs model.tokenizer"),
        ({"model": BOW | {"tokenizer": "TOK"}, "keep_layers": 1}, "no transformer blocks"),
        ({"model": {"path": "MODEL", "tokenizer": "TOK"}}, "only with model.path=bag-of-tokens"),
        ({"model": BOW | {"tokenizer": "TOK"}, "l2_coef": -1.0}, "l2_coef must be >= 0"),
    ],
)
def test_bad_bag_of_tokens_settings_are_refused_before_anything_runs(tiny_model_dir, tmp_path, over, match):
    over = {
        k: (
            {kk: str(tiny_model_dir) if vv in ("TOK", "MODEL") else vv for kk, vv in v.items()}
            if isinstance(v, dict)
            else v
        )
        for k, v in over.items()
    }
    with pytest.raises(ConfigError, match=match):
        rm_cfg(tiny_model_dir, tmp_path, **over)
    assert not (tmp_path / "run").exists()


def a_weighted(tokenizer_dir, path, weight_a: float = 1.0, gain: float = 1.0, bias: float = 0.0):
    """A bag-of-tokens reward model over ``tokenizer_dir``'s ids that weighs only 'a', saved in ``path``."""
    rm = ScalarModel.bag_of_tokens(tokenizer_dir, seed=0)
    a = rm.tokenizer("a", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        rm.backbone.weight.weight[a] = weight_a
        rm.gain.fill_(gain)
        rm.bias.fill_(bias)
    rm.save_pretrained(path)
    return rm, a


@pytest.mark.unit
def test_dense_rewards_put_each_tokens_weight_on_it(task, tmp_path):
    """Hand-computed: prompt "ab" (left-padded) + response "aca" (right-padded): the response's 'a' tokens
    get gain x weight, the others 0, padding 0; a row sums to its score minus its prompt's prefix score."""
    rm, a = a_weighted(task["model"], tmp_path / "rm", weight_a=1.5, gain=2.0, bias=0.25)
    tok = rm.tokenizer
    src = RewardSource(model=rm, policy_tokenizer=tok, dense=True)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] + enc("ab") + enc("aca"), enc("cab") + enc("b") + [tok.eos_token_id, pad]])
    mask = (ids != pad).long()
    out = src.dense_rewards(ids, mask, 3)
    assert torch.equal(out, torch.tensor([[3.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))
    prompt_score = rm.score(ids[:, :3], mask[:, :3])
    assert torch.allclose(out.sum(1), rm.score(ids, mask) - prompt_score)
    with pytest.raises(ConfigError, match="reward.dense needs"):
        RewardSource(function=lambda p, r, rows: [0.0] * len(r), dense=True)


@pytest.mark.integration
@pytest.mark.parametrize("estimator", [[], ["advantage_estimator=grpo", "group_size=4"]], ids=["gae", "grpo"])
def test_ppo_on_the_dense_reward_of_a_bag_of_tokens_model_raises_the_true_reward(task, tmp_path, estimator):
    """The reward model weighs 'a' by 1 and nothing else, so its dense reward is the count of 'a' tokens and
    the true reward (frac_a) must rise, with GAE and with GRPO normalising every token as a step; the logged
    process reward is that count's batch mean."""
    a_weighted(task["model"], tmp_path / "rm")
    out = tmp_path / "run"
    cfg = make_cfg(
        task,
        out,
        f"reward.model_path={tmp_path / 'rm'}",
        "reward.function=null",
        "reward.dense=true",
        "progress=false",
        "tensorboard=false",
        *estimator,
    )
    ppo.train(cfg)
    gold = gold_curve(out)
    assert gold[0] < 0.15 and gold[-1] > 0.25, gold
    rows = [r for r in rows_of(out / "metrics.jsonl") if "objective/process_reward" in r]
    assert rows[-1]["objective/process_reward"] > rows[0]["objective/process_reward"] + 0.5


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["reward.dense=true"], "set reward.model_path"),
        (
            ["reward.model_path=RM", "reward.function=null", "reward.dense=true", "reward.normalize=true"],
            "one score per response",
        ),
        (
            [
                "reward.model_path=RM",
                "reward.function=null",
                "reward.dense=true",
                "advantage_estimator=rloo",
                "group_size=4",
            ],
            "compares one number per response",
        ),
    ],
)
def test_bad_dense_settings_are_refused_before_anything_runs(task, tmp_path, extra, match):
    extra = [x.replace("RM", str(tmp_path / "rm")) for x in extra]
    with pytest.raises(ConfigError, match=match):
        make_cfg(task, tmp_path / "run", *extra)
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_dense_reward_from_an_encoder_or_another_tokenizer_is_a_clear_error(task, tiny_model_dir, tmp_path):
    """A bag-of-tokens model over another tokenizer cannot read the policy's ids: refused when PPO builds."""
    ScalarModel.bag_of_tokens(tiny_model_dir, seed=0).save_pretrained(tmp_path / "rm")
    cfg = make_cfg(
        task,
        tmp_path / "run",
        f"reward.model_path={tmp_path / 'rm'}",
        "reward.function=null",
        "reward.dense=true",
        "progress=false",
        "tensorboard=false",
    )
    with pytest.raises(ConfigError, match="reward.dense needs the prefix scores"):
        ppo.train(cfg)


@pytest.mark.unit
def test_config_round_trip_keeps_the_new_keys(tiny_model_dir):
    cfg = load_config(
        reward.Config,
        overrides={
            "model": BOW | {"tokenizer": str(tiny_model_dir)},
            "l2_coef": 0.1,
            "data": {"train": "x.jsonl"},
            "out_dir": "o",
        },
    )
    assert cfg.model.tokenizer == str(tiny_model_dir) and cfg.l2_coef == 0.1

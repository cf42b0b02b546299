"""What a run did, in words, from its recorded ``config.yaml`` and ``summary.json``: the training recipe, the
algorithm's name, the config keys that mattered, the keys that had no effect, and a model card's YAML metadata.

A PPO run (``shifu ppo``) is described by what ran, never by the defaults of another method: the advantage
estimator (GAE on a learned critic only when one was trained; GRPO, Dr. GRPO, RLOO, best-of-G, REINFORCE,
REINFORCE++ otherwise), the group size, the policy loss (PPO-clip, PPO-penalty, REINFORCE, GSPO), where the
KL to the reference went (the reward or the loss) and what made the rollouts (single responses scored by a
reward function, model, ensemble or service; an environment's episodes; an agent's), as the run recorded its
rollout source (``source``: :func:`shifu.reporting.run_data.ran_source`, named by
:func:`shifu.reporting.run_data.reward_source`). Paths are shown by :mod:`shifu.reporting.names`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shifu.config.loader import lookup, to_dict
from shifu.reporting.names import shown_path
from shifu.reporting.run_data import ran_source, reward_source

KINDS = ("sft", "rm", "ppo", "dpo")
TITLES = {
    "sft": "supervised fine-tuned policy",
    "rm": "Bradley-Terry reward model",
    "ppo": "policy aligned with {name}",
    "dpo": "policy aligned with DPO",
}
TAGS = {"sft": ["sft"], "rm": ["reward-model"], "dpo": ["dpo"]}
# the config keys a reader asks about first, per stage (absent or empty ones are skipped); ppo: ppo_keys()
KEY_CONFIG = {
    "sft": ("model.path", "data.max_len", "epochs", "max_steps", "batch_size", "grad_accum"),
    "rm": ("model.path", "ensemble.k", "ensemble.aggregate", "center_coef", "epochs", "max_steps"),
    "dpo": ("model.path", "model.ref_path", "beta", "epochs", "max_steps", "batch_size"),
}
COMMON_CONFIG = ("optim.lr", "optim.schedule", "optim.warmup_steps", "seed", "bf16", "distributed.strategy")
DATA_KEYS = ("data.train", "data.eval", "data.ptx")
RECIPE = {
    "sft": "Supervised fine-tuning (`shifu sft`): next-token loss on the trained response tokens of (prompt, "
    "response) or chat demonstrations; prompt, read-only spans (tool outputs, non-assistant turns) and padding "
    "positions are masked out.",
    "rm": "Reward modelling (`shifu rm`): a scalar head on the backbone trained with the Bradley-Terry loss "
    "-log sigmoid(r(chosen) - r(rejected)) on preference pairs.",
    "dpo": "Direct preference optimisation (`shifu dpo`): the policy is trained on preference pairs to "
    "raise the log-probability ratio of chosen over rejected responses relative to a frozen reference.",
}
# advantage estimators (advantage_estimator, resolved) and policy losses (algo): names and what they do
ESTIMATOR_NAMES = {
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "rloo": "RLOO",
    "bon": "best-of-G",
    "reinforce": "REINFORCE",
    "reinforce_pp": "REINFORCE++",
    "reinforce_pp_baseline": "REINFORCE++ with a group baseline",
}
LOSS_NAMES = {"ppo": "PPO-clip", "ppo_penalty": "PPO-penalty", "reinforce": "REINFORCE", "gspo": "GSPO"}
GROUPED = ("grpo", "dr_grpo", "rloo", "bon", "reinforce_pp_baseline")
CRITIC_KEYS = (
    "critic",
    "vf_coef",
    "lam",
    "value_clip",
    "critic_warmup",
    "critic_updates",
    "joint_optimizer",
    "lora.critic",
)
# the key config of the source that made a PPO run's rollouts, per kind (SourceDescription.kind)
EPISODE_BUDGETS = ("generation.max_turns", "generation.max_new_tokens", "generation.max_total_tokens")
SOURCE_KEYS = {
    "environment": ("env.factory", "verifiers.taskset", *EPISODE_BUDGETS),
    "agent": ("agent.factory", *EPISODE_BUDGETS),
    "single-turn": ("reward.function", "reward.model_path", "reward.url", "generation.max_new_tokens"),
}


class Settings:
    """A recorded PPO config read with the schema's defaults for keys it lacks (a run recorded before a key
    existed ran with its default), and a key's old name where a run recorded before it was renamed has it."""

    def __init__(self, config: dict[str, Any]):
        from shifu.config.schema import PPOConfig

        self.config, self.defaults = config, to_dict(PPOConfig())
        self.old_names = {new: old for old, new in PPOConfig.RENAMED.items()}

    def __getitem__(self, key: str) -> Any:
        missing = object()
        value = lookup(self.config, key, missing)
        if value is missing and key in self.old_names:
            value = lookup(self.config, self.old_names[key], missing)
        return lookup(self.defaults, key) if value is missing else value

    @property
    def estimator(self) -> str:
        """The advantage estimator that ran (``advantage_estimator``, else gae, or reinforce for algo=reinforce)."""
        return self["advantage_estimator"] or ("reinforce" if self["algo"] == "reinforce" else "gae")

    @property
    def critic(self) -> bool:
        return self.estimator == "gae"


def algorithm_name(config: dict[str, Any]) -> str:
    """The method's short name: PPO, PPO-penalty, GRPO, RLOO, REINFORCE, ... (its loss too when it is not
    PPO-clip: "RLOO with the REINFORCE loss")."""
    s = Settings(config)
    est, algo = s.estimator, s["algo"]
    if est == "gae":
        return {"ppo": "PPO", "ppo_penalty": "PPO-penalty"}.get(
            algo, f"{LOSS_NAMES.get(algo, algo)} with GAE"
        )
    name = ESTIMATOR_NAMES.get(est, est)
    return name if algo in ("ppo", est) else f"{name} with the {LOSS_NAMES.get(algo, algo)} loss"


def _estimator_words(s: Settings) -> str:
    G, est = s["group_size"], s.estimator
    words = {
        "gae": f"GAE (gamma {s['gamma']}, lambda {s['lam']}) on a learned critic (critic.init={s['critic.init']}; "
        f"value loss weight vf_coef {s['vf_coef']})",
        "grpo": f"GRPO: each response's reward minus the mean of its group of {G}, divided by the group's "
        "standard deviation",
        "dr_grpo": f"Dr. GRPO: each response's reward minus the mean of its group of {G}, not divided by the "
        "standard deviation; the loss is summed over tokens and divided by a constant",
        "rloo": f"RLOO: each response's reward minus the mean of the other {G - 1} responses to its prompt",
        "bon": f"best-of-{G}: the responses tied for the group's highest reward are reinforced against the "
        "group's mean",
        "reinforce": "REINFORCE: each response's whole-sequence return"
        + (" minus the batch mean" if s["reinforce_baseline"] else ""),
        "reinforce_pp": f"REINFORCE++: the discounted reward-to-go (gamma {s['gamma']}) of the per-token "
        "rewards, whitened over the batch",
        "reinforce_pp_baseline": f"REINFORCE++ with a baseline: each response's score minus its group's mean "
        f"(groups of {G}), then the discounted reward-to-go (gamma {s['gamma']}), whitened over the batch",
    }
    return words.get(est, f"advantage_estimator={est}")


def _source(config: dict[str, Any], source: Any) -> Any:
    """What made a PPO run's rollouts: ``source`` as the run recorded it, else what its config names."""
    return source if source is not None else ran_source(None, config)


def _unit(source: Any) -> str:
    return source.unit if source is not None else "responses"


def _loss_words(s: Settings, source: Any) -> str:
    algo = s["algo"]
    words = {
        "ppo": f"the clipped PPO objective (ratio clipped to [1 - {s['clip_low']}, 1 + {s['clip_high']}])",
        "ppo_penalty": f"the PPO-penalty objective (an adaptive penalty on KL(pi_old || pi), from "
        f"{s['penalty_init']} toward {s['penalty_target']} per token, instead of clipping)",
        "reinforce": "the REINFORCE policy gradient (on-policy)",
        "gspo": f"GSPO: the length-normalised sequence ratio, clipped to [1 - {s['clip_low']}, "
        f"1 + {s['clip_high']}]",
    }
    epochs, unit = s["ppo_epochs"], _unit(source)
    passes = f"{epochs} pass{'es' if epochs != 1 else ''} over each rollout of {s['batch_size']} {unit}"
    return f"{words.get(algo, f'algo={algo}')}, {passes} in minibatches of {s['minibatch_size']}"


def _kl_words(s: Settings) -> str:
    ctl, beta = s["kl.controller"], s["kl.init_coef"]
    coef = {
        "fixed": f"beta fixed at {beta}",
        "adaptive": f"beta adaptive from {beta}, toward {s['kl.target']} nats per response",
        "step": f"beta from {beta}, stepped toward {s['kl.target']} nats per response",
        "penalty": f"beta from {beta}, halved or doubled around {s['kl.target']} nats per response",
    }.get(ctl, f"kl.controller={ctl}")
    if s["kl.penalty"] == "loss":
        return (
            f"beta x KL ({s['kl.loss_estimator']} estimate) is a term of the loss, not of the reward; {coef}"
        )
    return f"beta x KL ({s['kl.estimator']} estimate per token) is subtracted from the reward; {coef}"


def ppo_recipe(config: dict[str, Any], run_dir: Path, source: Any = None) -> str:
    """The training recipe of a ``shifu ppo`` run, from what its config says ran and what made its rollouts
    (``source``, as the run recorded it; None: what its config names)."""
    if not config:
        return "RL with `shifu ppo`; the run's config.yaml is missing, so the method is not recorded."
    s, source = Settings(config), _source(config, source)
    G, reward = s["group_size"], reward_source(source, run_dir)[1]  # (episodes: named below)
    if source is not None and source.episodes:
        played = f"{'a group of ' + str(G) + ' episodes' if G > 1 else 'an episode'} per training prompt"
        steps = "calls" if source.kind == "agent" else "turns"
        budget = f"up to {s['generation.max_turns']} {steps} of up to {s['generation.max_new_tokens']} tokens"
        if source.kind == "agent":
            sampled = (
                f"plays {played} through the agent {source.spec}, whose calls the policy answers over the "
                f"policy gateway ({budget}); the agent's return is its reward"
            )
        else:
            sampled = (
                f"plays {played} with the environment {source.spec} ({budget}); the episode's return is its "
                "reward"
            )
    else:
        responses = f"a group of {G} responses" if G > 1 else "one response"
        sampled = f"samples {responses} to each training prompt, scored by {reward}"
    parts = [
        f"RL with `shifu ppo` ({algorithm_name(config)}): the policy {sampled}.",
        f"Advantages: {_estimator_words(s)}.",
        f"Update: {_loss_words(s, source)}.",
        f"KL to the frozen reference policy: {_kl_words(s)}.",
    ]
    if s["reward.dense"]:
        parts.append("The reward is dense: each token earns the change it makes to the reward model's score.")
    if s["dynamic_sampling"]:
        parts.append(
            "Dynamic sampling (DAPO): groups whose rewards are all equal are left out of the update."
        )
    if s["ptx_coef"]:
        parts.append(f"PPO-ptx: the SFT loss on data.ptx is added with weight {s['ptx_coef']}.")
    if s["lora.enabled"]:
        parts.append(
            f"LoRA adapters (rank {s['lora.r']}) trained instead of all weights; final/ holds them merged."
        )
    return " ".join(parts)


def method_summary(config: dict[str, Any], source: Any = None) -> str:
    """One line on what a PPO run ran, for the report: the method, how advantages were baselined, where the
    KL went. "GRPO (groups of 4 responses per prompt; KL to the reference in the loss, k3)". ``source``: what
    made the rollouts, as the run recorded it (None: what the config names)."""
    s, source = Settings(config), _source(config, source)
    G, est = s["group_size"], s.estimator
    if est == "gae":
        how = f"GAE on a learned critic, critic.init={s['critic.init']}"
    elif G > 1 or est in GROUPED:
        how = f"groups of {G} {_unit(source)} per prompt"
    else:
        how = "one response per prompt"
    kl = (
        f"in the loss, {s['kl.loss_estimator']}"
        if s["kl.penalty"] == "loss"
        else f"in the reward, {s['kl.estimator']}"
    )
    return f"{algorithm_name(config)} ({how}; KL to the reference {kl})"


def rm_recipe(config: dict[str, Any]) -> str:
    text = RECIPE["rm"]
    k = lookup(config, "ensemble.k")
    if isinstance(k, int) and k > 1:
        text += f" An ensemble of {k} models (seeds seed, seed+1, ...), aggregated by {lookup(config, 'ensemble.aggregate')}."
    norm = lookup(config, "normalize.responses") or lookup(config, "normalize.policy")
    if norm:
        what = "responses" if lookup(config, "normalize.responses") else "policy samples"
        text += f" Scores normalised after training to mean 0, std 1 on {what} (normalize.*)."
    return text


def recipe(kind: str, config: dict[str, Any], run_dir: Path, source: Any = None) -> str:
    """The card's "Training recipe" paragraph for a ``kind`` run in ``run_dir`` (a PPO run's ``source``: what
    made its rollouts)."""
    if kind == "ppo":
        return ppo_recipe(config, run_dir, source)
    return rm_recipe(config) if kind == "rm" else RECIPE[kind]


def title(kind: str, config: dict[str, Any]) -> str:
    return TITLES[kind].format(name=algorithm_name(config) if config else "RL")


def ppo_keys(config: dict[str, Any], source: Any = None) -> list[str]:
    """The key config of a PPO run: what ran and nothing else (no critic keys without a critic, the clip
    range only for a clipped loss, the KL estimator where the KL went, the keys of the source that made the
    rollouts: ``source``, None: what the config names)."""
    s, source = Settings(config), _source(config, source)
    keys = ["model.path", "model.ref_path", "algo", "advantage_estimator"]
    keys += ["group_size"] if s["group_size"] > 1 or s.estimator in GROUPED else []
    keys += list(SOURCE_KEYS[source.kind if source is not None else "single-turn"])
    keys += ["generation.temperature", "iterations", "batch_size", "minibatch_size", "ppo_epochs"]
    keys += {"ppo": ["clip_low", "clip_high"], "gspo": ["clip_low", "clip_high"]}.get(s["algo"], [])
    keys += ["penalty_init", "penalty_target"] if s["algo"] == "ppo_penalty" else []
    keys += ["critic.init", "vf_coef", "gamma", "lam"] if s.critic else []
    keys += ["gamma"] if s.estimator in ("reinforce_pp", "reinforce_pp_baseline") else []
    keys += ["kl.penalty", "kl.controller", "kl.init_coef"]
    keys += [] if s["kl.controller"] == "fixed" else ["kl.target"]
    keys += ["kl.loss_estimator"] if s["kl.penalty"] == "loss" else ["kl.estimator"]
    keys += [k for k in ("dynamic_sampling", "ptx_coef", "ent_coef", "tis_cap") if s[k]]
    keys += ["lora.enabled", "lora.r"] if s["lora.enabled"] else []
    return [*keys, "eval.gold_function"]


def key_values(kind: str, config: dict[str, Any], run_dir: Path, source: Any = None) -> list[tuple[str, Any]]:
    """(key, value) of the card's "Key config" table: set keys only, paths shown by
    :func:`shifu.reporting.names.shown_path`, a PPO run's advantage estimator as it ran."""
    keys = ppo_keys(config, source) if kind == "ppo" and config else KEY_CONFIG.get(kind, ())
    out = []
    for k in (*keys, *COMMON_CONFIG):
        value = (
            Settings(config).estimator if kind == "ppo" and k == "advantage_estimator" else lookup(config, k)
        )
        if value not in (None, "", [], {}):
            out.append((k, shown_path(value, run_dir)))
    return out


def without_unused(config: dict[str, Any], source: Any = None) -> dict[str, Any]:
    """A PPO config without the settings that had no effect in its run (a critic's, without a critic; the
    clip range of an unclipped loss; the other KL estimator; the sections of the sources that did not make the
    rollouts, and without episodes their budgets)."""
    s, source = Settings(config), _source(config, source)
    unused = [] if s.critic else list(CRITIC_KEYS)
    unused += [] if s.critic or s.estimator in ("reinforce_pp", "reinforce_pp_baseline") else ["gamma"]
    unused += [] if s["algo"] in ("ppo", "gspo") else ["clip_low", "clip_high", "dual_clip"]
    unused += [] if s["algo"] == "ppo_penalty" else ["penalty_init", "penalty_target"]
    unused += [] if s.estimator == "reinforce" else ["reinforce_baseline"]
    unused += ["kl.estimator"] if s["kl.penalty"] == "loss" else ["kl.loss_estimator"]
    unused += ["kl.horizon"] if s["kl.controller"] != "adaptive" else []
    kind = source.kind if source is not None else "single-turn"
    unused += [section for k, section in (("environment", "env"), ("agent", "agent")) if k != kind]
    unused += [] if source is not None and source.spec.startswith("verifiers:") else ["verifiers"]
    unused += [] if kind != "single-turn" else ["generation.max_turns", "generation.max_total_tokens"]
    out = dict(config)
    for key in unused:
        *head, last = key.split(".")
        node = out
        for part in head:  # copy the path down, so the recorded config is left as it is
            if not isinstance(node.get(part), dict):
                break
            node[part] = dict(node[part])
            node = node[part]
        else:
            node.pop(last, None)
    return out


def count_rows(path: str) -> str:
    """The data table's note on a file: " (N rows)" for JSONL, "" for another file, or that it is missing."""
    p = Path(path)
    if p.is_file() and p.suffix == ".jsonl":
        with p.open(encoding="utf-8", errors="replace") as f:
            return f" ({sum(1 for line in f if line.strip())} rows)"
    return "" if p.exists() else " (not found when the card was written)"


def metadata(kind: str, config: dict[str, Any], run_dir: Path, source: Any = None) -> dict[str, Any]:
    """The card's YAML metadata: the base model (relative to the run, or by its own name: never an absolute
    path), library, pipeline tag, and tags (a PPO run's: its estimator and, when not PPO-clip, its loss; what
    made its rollouts, ``source``, when an environment or an agent)."""
    meta: dict[str, Any] = {}
    base = lookup(config, "model.path")
    if isinstance(base, str) and base:
        meta["base_model"] = shown_path(base, run_dir)
    meta["library_name"] = "shifu" if kind == "rm" else "transformers"
    if kind != "rm":
        meta["pipeline_tag"] = "text-generation"
    tags = ["shifu", "rlhf"]
    if kind == "ppo":
        s = Settings(config)
        tags.append("ppo" if s.estimator == "gae" else s.estimator.replace("_", "-"))
        if s["algo"] not in ("ppo", s.estimator):
            tags.append(s["algo"].replace("_", "-"))
        source = _source(config, source)
        tags += [source.kind] if source is not None and source.episodes else []
    else:
        tags += TAGS[kind]
    k = lookup(config, "ensemble.k")
    if kind == "rm" and isinstance(k, int) and k > 1:
        tags.append("reward-ensemble")
    meta["tags"] = tags
    return meta

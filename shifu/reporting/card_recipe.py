"""What a model card says a run did: the stages' titles and tags, the training recipe, the key config keys,
the data files, and the card's YAML metadata (:func:`metadata`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shifu.config.loader import lookup

KINDS = ("sft", "rm", "ppo", "dpo")
TITLES = {
    "sft": "supervised fine-tuned policy",
    "rm": "Bradley-Terry reward model",
    "ppo": "policy aligned with PPO",
    "dpo": "policy aligned with DPO",
}
TAGS = {"sft": ["sft"], "rm": ["reward-model"], "ppo": ["ppo"], "dpo": ["dpo"]}
# where each stage's config names the model it started from (first match wins)
BASE_MODEL_KEYS = {
    "sft": ("model.path",),
    "rm": ("model.path",),
    "ppo": ("model.path",),
    "dpo": ("model.path",),
}
# the config keys a reader asks about first, per stage (absent or empty ones are skipped)
KEY_CONFIG = {
    "sft": ("model.path", "data.max_len", "epochs", "max_steps", "batch_size", "grad_accum"),
    "rm": ("model.path", "ensemble.k", "ensemble.aggregate", "center_coef", "epochs", "max_steps"),
    "ppo": (
        "model.path",
        "model.ref_path",
        "algo",
        "reward.model_path",
        "reward.function",
        "iterations",
        "batch_size",
        "minibatch_size",
        "ppo_epochs",
        "clip_low",
        "clip_high",
        "vf_coef",
        "gamma",
        "lam",
        "kl.controller",
        "kl.init_coef",
        "kl.target",
        "kl.estimator",
        "critic.init",
        "generation.max_new_tokens",
        "generation.temperature",
        "eval.gold_function",
    ),
    "dpo": ("model.path", "model.ref_path", "beta", "epochs", "max_steps", "batch_size"),
}
COMMON_CONFIG = ("optim.lr", "optim.schedule", "optim.warmup_steps", "seed", "bf16", "distributed.strategy")
DATA_KEYS = ("data.train", "data.eval", "data.ptx")
RECIPE = {
    "sft": "Supervised fine-tuning (`shifu sft`): next-token loss on the response tokens of (prompt, response) "
    "demonstrations; prompt and padding positions are masked out.",
    "rm": "Reward modelling (`shifu rm`): a scalar head on the backbone trained with the Bradley-Terry loss "
    "-log sigmoid(r(chosen) - r(rejected)) on preference pairs; scores normalised after training.",
    "ppo": "RLHF with PPO (`shifu ppo`): the policy samples responses to prompts, a reward model (or reward "
    "function) scores them, the score minus beta x KL to the frozen reference policy is the reward, and "
    "the clipped PPO objective with GAE on a learned critic updates the policy; a KL controller sets beta.",
    "dpo": "Direct preference optimisation (`shifu dpo`): the policy is trained on preference pairs to "
    "raise the log-probability ratio of chosen over rejected responses relative to a frozen reference.",
}


def count_rows(path: str) -> str:
    """The data table's note on a file: " (N rows)" for JSONL, "" for another file, or that it is missing."""
    p = Path(path)
    if p.is_file() and p.suffix == ".jsonl":
        with p.open(encoding="utf-8", errors="replace") as f:
            return f" ({sum(1 for line in f if line.strip())} rows)"
    return "" if p.exists() else " (not found when the card was written)"


def metadata(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """The card's YAML metadata: base model, library, pipeline tag and tags."""
    meta: dict[str, Any] = {}
    base = next((lookup(config, k) for k in BASE_MODEL_KEYS[kind] if lookup(config, k)), None)
    if isinstance(base, str) and base:
        meta["base_model"] = base
    meta["library_name"] = "shifu" if kind == "rm" else "transformers"
    if kind != "rm":
        meta["pipeline_tag"] = "text-generation"
    tags = ["shifu", "rlhf", *TAGS[kind]]
    algo = lookup(config, "algo")
    if kind == "ppo" and isinstance(algo, str) and algo != "ppo":
        tags.append(algo.replace("_", "-"))
    k = lookup(config, "ensemble.k")
    if kind == "rm" and isinstance(k, int) and k > 1:
        tags.append("reward-ensemble")
    meta["tags"] = tags
    return meta

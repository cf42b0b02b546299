"""The config sections of where a PPO run's trajectories come from, each defined once: how the policy samples
(``generation``, an episode's budgets included), what scores single responses (``reward``), an environment
(``env``: multi-turn episodes), an outside agent (``agent``: episodes over the policy gateway) or a verifiers
taskset (``verifiers``: its tasks, harness and rewards), and :func:`check_source`, which takes exactly one of them. The other sections are in :mod:`shifu.config.sections`.
"""

from __future__ import annotations

from typing import Literal

from shifu.config.imports import typed_key
from shifu.config.loader import opt
from shifu.config.sections import frozen
from shifu.errors import ConfigError


@frozen
class GenerationConfig:
    max_new_tokens: int = opt(
        48, "tokens the policy samples in one turn (a single-turn response: R); a turn cut here is truncated"
    )
    temperature: float = opt(1.0, "sampling temperature T (log-probs use logits/T too)")
    top_k: int = opt(0, "top-k sampling; 0 disables")
    top_p: float = opt(1.0, "nucleus sampling; 1.0 disables")
    stop: list[str] = opt(
        [], 'strings that end a turn besides EOS (the string is part of the turn), e.g. ["]"]'
    )
    max_turns: int = opt(
        3,
        "multi-turn episodes (env.factory): turns (policy replies) per episode; one still going is truncated",
    )
    max_total_tokens: int = opt(
        128,
        "multi-turn episodes: sampled plus observation tokens after the first input; reaching it truncates",
    )
    prefix_cache_mb: float = opt(
        256,
        "multi-turn episodes (env.factory, agent.factory): MB of keys and values of earlier turns kept during a "
        "rollout, so that a turn prefills only what its cached prefix leaves (the same tokens); 0: off",
    )
    kv_budget_mb: float = opt(
        1024,
        "multi-turn episodes (env.factory): MB of keys and values of the turns decoding at once; a turn joins the "
        "running decode as its environment answers and waits while it does not fit; 0: every episode's turn in "
        "one sampler call, turn by turn",
    )

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("generation.temperature must be > 0")
        for key in ("prefix_cache_mb", "kv_budget_mb"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"generation.{key} must be >= 0 (0: off), got {getattr(self, key)}")
        for key in ("max_new_tokens", "max_turns", "max_total_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"generation.{key} must be >= 1 (got {getattr(self, key)})")
        if not 0 < self.top_p <= 1:
            raise ConfigError("generation.top_p must be in (0, 1]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"generation.stop must be a list of non-empty strings (got {self.stop!r})")

    def validate_episodes(self) -> None:
        """What multi-turn episodes add: a turn fits in the episode's budget."""
        if self.max_total_tokens < self.max_new_tokens:
            raise ConfigError(
                f"generation.max_total_tokens ({self.max_total_tokens}) must be >= "
                f"generation.max_new_tokens ({self.max_new_tokens}), the tokens of one turn"
            )


@frozen
class RewardConfig:
    model_path: str | None = opt(None, "reward model directory (shifu rm output, or an ensemble directory)")
    function: str | None = opt(None, "rule-based reward 'package.module:function' (instead of model_path)")
    url: str | None = opt(
        None,
        "a reward service (`shifu serve`) at http://HOST:PORT instead; its token from $SHIFU_SERVE_TOKEN",
    )
    timeout_s: float = opt(60.0, "reward service: seconds one request may take")
    retries: int = opt(3, "reward service: retries (with backoff) before the run stops with a checkpoint")
    dense: bool = opt(
        False,
        "reward_model: give response token t the change of the model's prefix score, s(<=t) - s(<t), "
        "instead of one score at the end (same objective with gamma 1, each token's credit on it); needs a "
        "causal reward model with the policy's tokenizer, e.g. rm.model.path=bag-of-tokens",
    )
    normalize: bool = opt(False, "running mean/std normalisation of scores")
    clip: float | None = opt(None, "clip (normalised) scores to [-clip, clip]; null disables")
    missing_eos_penalty: float | None = opt(None, "penalty for responses without EOS; null disables")
    missing_eos_mode: Literal["subtract", "replace"] = opt(
        "subtract", "subtract the penalty, or replace the score with -penalty"
    )

    def validate(self) -> None:
        """What a reward's own keys exclude (which of model_path, function and url: the PPO config)."""
        if self.dense and self.model_path is None:
            raise ConfigError(
                "reward.dense reads a reward model's prefix scores: set reward.model_path (a "
                "reward function can return per-token steps itself), or reward.dense=false"
            )
        if self.dense and (self.normalize or self.clip is not None or self.missing_eos_penalty is not None):
            raise ConfigError(
                "reward.normalize, reward.clip and reward.missing_eos_penalty act on one score per "
                "response, which reward.dense does not give; unset them or set reward.dense=false"
            )
        if self.timeout_s <= 0 or self.retries < 0:
            raise ConfigError("reward.timeout_s must be > 0 and reward.retries >= 0")


@frozen
class EnvConfig:
    factory: str | None = opt(
        None,
        "an environment 'package.module:Name' (a class, or a factory of env.kwargs): rollouts, validation and "
        "the held-out evaluation become multi-turn episodes rewarded by it, instead of reward.* (docs/how-to/"
        "multi-turn.md; the episode's budgets are generation.max_turns, max_new_tokens, max_total_tokens, stop); "
        "null: one response per prompt",
    )
    kwargs: dict = opt({}, "keyword arguments of the factory, one fresh instance per episode")
    concurrency: int = opt(
        64,
        "environment calls (resets, steps) run at once, each on a thread: environments wait on tools, judges "
        "and services; results are applied in episode order, so a run does not depend on it",
    )
    step_timeout_s: float | None = opt(
        60.0, "seconds one reset() or step() may take (a fault past it); null: no limit"
    )
    on_error: Literal["raise", "end_episode"] = opt(
        "raise",
        "an environment fault (exception, wrong return type, timeout, observation over budget): stop the "
        "run with an error naming the environment, row and turn, or end that episode with reward 0 (env/errors)",
    )

    def validate(self) -> None:
        if self.factory is None:
            return
        if self.concurrency < 1:
            raise ConfigError(f"{typed_key('env.concurrency')} must be >= 1 (got {self.concurrency})")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ConfigError(
                f"{typed_key('env.step_timeout_s')} must be > 0 (got {self.step_timeout_s}); null: no limit"
            )

    def validate_alongside(self, reward: RewardConfig, gold_function: str | None) -> None:
        """:meth:`validate`, and what an environment excludes in the rest of a PPO config."""
        self.validate()
        if (
            reward.model_path is not None
            or reward.function is not None
            or reward.url is not None
            or reward.dense
        ):
            raise ConfigError(
                f"{typed_key('env.factory')} rewards the episodes: unset reward.model_path, reward.function, "
                f"reward.url and reward.dense (or unset {typed_key('env.factory')})"
            )
        if gold_function is not None:
            raise ConfigError(
                f"with {typed_key('env.factory')} the held-out gold is the mean episode return of the "
                "environment: unset eval.gold_function"
            )


@frozen
class AgentConfig:
    factory: str | None = opt(
        None,
        "an agent 'package.module:solve', async solve(client: openai.AsyncOpenAI, row) -> reward or None: "
        "rollouts and evaluations become its episodes, every call recorded by the policy gateway "
        "(docs/how-to/agents.md); null: off",
    )
    kwargs: dict = opt({}, "keyword arguments of every solve() call")
    concurrency: int = opt(64, "episodes run at once (their calls share sampler calls: 64 fill one)")
    timeout_s: float | None = opt(
        300.0,
        "seconds one episode may take: past it the episode ends truncated, keeping what it recorded "
        "(agent/timeouts); null: no limit",
    )
    on_error: Literal["raise", "end_episode"] = opt(
        "raise",
        "an agent fault (an exception, a return that is not a number or None): stop the run with an error "
        "naming the agent and row, or end that episode with reward 0 (agent/errors)",
    )
    side_calls: Literal["train", "skip"] = opt(
        "skip",
        "calls sent with another system prompt than the agent's (a title, a summary, a classifier; "
        "agent/side_calls): record them and leave them out of training, or train them as forks are trained",
    )

    def validate_alongside(self, cfg) -> None:
        """What an agent needs and excludes in the PPO config ``cfg``."""
        key, r = typed_key("agent.factory"), cfg.reward
        refused = {
            f"{typed_key('agent.concurrency')} must be >= 1 and {typed_key('agent.timeout_s')} > 0 or null": (
                self.concurrency < 1 or (self.timeout_s is not None and not self.timeout_s > 0)
            ),
            f"give {typed_key('env.factory')} or {key}, not both": cfg.env.factory is not None,
            f"{key} rewards its episodes: unset reward.model_path, reward.function, reward.url and "
            "reward.dense": any(x is not None for x in (r.model_path, r.function, r.url)) or r.dense,
            f"{key}: the held-out gold is the episode return; unset eval.gold_function": bool(
                cfg.eval.gold_function
            ),
            f"{key}: the agent sends its own stop strings; unset generation.stop": bool(cfg.generation.stop),
        }
        for message, wrong in refused.items():
            if wrong:
                raise ConfigError(message)


@frozen
class VerifiersConfig:
    taskset: str | None = opt(
        None,
        "a verifiers (0.4) taskset, as verifiers names it (an installed taskset package, or a hub id already "
        "installed): its tasks are the prompts (data.train stays empty), its harness plays them over the policy "
        "gateway, its rewards are the return (docs/how-to/verifiers.md); null: off",
    )
    harness: str = opt(
        "", "the verifiers harness that plays the tasks; empty: the taskset's own, else `null` (chat)"
    )
    kwargs: dict = opt({}, "the taskset's config (what vf-eval's --env.taskset.* sets), e.g. {num_tasks: 64}")
    eval_kwargs: dict = opt(
        {},
        "the held-out split's config, over kwargs (e.g. {split: test}); empty: hold out data.eval_fraction of "
        "the tasks",
    )
    python: str = opt(
        "",
        "the Python that runs verifiers (a virtual environment with shifu-rlhf[verifiers] or verifiers==0.4.*; "
        "it pins another openai than the agents extra); empty: this one",
    )
    concurrency: int = opt(16, "episodes played at once (their calls share sampler calls)")
    timeout_s: float | None = opt(
        600.0,
        "seconds one episode may take (the harness's first start installs its packages with uv): past it the "
        "episode ends truncated; null: no limit",
    )
    on_error: Literal["raise", "end_episode"] = opt(
        "raise",
        "a failed episode (the harness or a reward raised, a stage timed out): stop the run naming the task, "
        "or end that episode with reward 0 (agent/errors)",
    )

    def validate_alongside(self, cfg) -> None:
        """What a verifiers taskset needs and excludes in the PPO config ``cfg``."""
        key, r, d = typed_key("verifiers.taskset"), cfg.reward, cfg.data
        refused = {
            f"{typed_key('verifiers.concurrency')} must be >= 1 and {typed_key('verifiers.timeout_s')} > 0 or "
            "null": self.concurrency < 1 or (self.timeout_s is not None and not self.timeout_s > 0),
            f"give one of {typed_key('env.factory')}, {typed_key('agent.factory')} and {key}": (
                cfg.env.factory is not None or cfg.agent.factory is not None
            ),
            f"{key} rewards its episodes: unset reward.model_path, reward.function, reward.url and "
            "reward.dense": any(x is not None for x in (r.model_path, r.function, r.url)) or r.dense,
            f"{key}: the held-out gold is the episode return; unset eval.gold_function": bool(
                cfg.eval.gold_function
            ),
            f"{key}: the taskset's tasks are the prompts; unset data.train and data.eval (its held-out split is "
            f"{typed_key('verifiers.eval_kwargs')}, or data.eval_fraction)": bool(d.train or d.eval),
            f"{key} samples on each process's own gateway: use distributed.strategy=ddp or none": (
                cfg.distributed.strategy in ("fsdp2", "deepspeed")
            ),
            f"{key}: the harness sends its own stop strings; unset generation.stop": bool(
                cfg.generation.stop
            ),
            f"{typed_key('verifiers.kwargs')} and {typed_key('verifiers.eval_kwargs')} are the taskset's config: "
            "its id is verifiers.taskset": "id" in self.kwargs or "id" in self.eval_kwargs,
            f"data.eval_fraction must be in (0, 1) when {typed_key('verifiers.eval_kwargs')} is empty (got "
            f"{d.eval_fraction})": not self.eval_kwargs and not 0 < d.eval_fraction < 1,
            f"data.max_prompt_len must be >= 1 (got {d.max_prompt_len})": d.max_prompt_len < 1,
        }
        for message, wrong in refused.items():
            if wrong:
                raise ConfigError(message)


def check_source(cfg) -> None:
    """Exactly one of ``env.factory``, ``agent.factory``, ``verifiers.taskset`` and ``reward.*`` makes and rewards
    the rollouts of the PPO config ``cfg``, each with what it needs and excludes."""
    r = cfg.reward
    if cfg.verifiers.taskset:  # a verifiers taskset's episodes (shifu.rollout.verifiers)
        cfg.verifiers.validate_alongside(cfg)
    elif cfg.agent.factory is not None:  # an outside agent's episodes (shifu.rollout.agent)
        cfg.agent.validate_alongside(cfg)
    elif cfg.env.factory is not None:  # the environment rewards the episodes
        cfg.env.validate_alongside(r, cfg.eval.gold_function)
    elif sum(x is not None for x in (r.model_path, r.function, r.url)) != 1:
        raise ConfigError(
            "give exactly one of reward.model_path, reward.function, reward.url, "
            f"{typed_key('env.factory')}, {typed_key('agent.factory')} and {typed_key('verifiers.taskset')}"
        )
    if cfg.agent.factory is not None or cfg.env.factory is not None or cfg.verifiers.taskset:
        cfg.generation.validate_episodes()

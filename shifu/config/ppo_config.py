"""``shifu ppo``'s config (:class:`PPOConfig`): the loop's sizes, the policy loss and advantage estimator by
name, the sections of its four models, and the checks of their combinations. KL targets are in **nats per
response** (the unit of ``objective/kl``), never per token."""

from __future__ import annotations

from typing import ClassVar, Literal

from shifu.config.commands import RunConfig
from shifu.config.loader import group_size_advice, opt, require_positive
from shifu.config.sections import (
    CriticConfig,
    GuardConfig,
    KLConfig,
    LoraConfig,
    OptimConfig,
    PolicyEvalConfig,
    PolicyModelConfig,
    PromptDataConfig,
    TracesConfig,
    frozen,
)
from shifu.config.sources import (
    AgentConfig,
    EnvConfig,
    GenerationConfig,
    RewardConfig,
    VerifiersConfig,
    check_source,
)
from shifu.errors import ConfigError


@frozen
class PPOConfig(RunConfig):
    RENAMED: ClassVar[dict[str, str]] = {
        "actor_path": "model.path",
        "ref_path": "model.ref_path",
        "trust_remote_code": "model.trust_remote_code",
        "data.prompts": "data.train",
        "data.eval_prompts": "data.eval",
        # the episode's budgets belong to the sampler
        "env.max_turns": "generation.max_turns",
        "env.max_tokens_per_turn": "generation.max_new_tokens",
        "env.max_total_tokens": "generation.max_total_tokens",
        "env.stop": "generation.stop",
    }

    model: PolicyModelConfig = opt(
        PolicyModelConfig(), "the actor's starting point (the SFT model) and the reference"
    )
    bf16: bool = opt(
        False,
        "bf16 where a GEMM probe at the model's shapes measures it faster, each phase decided apart (decode "
        "from a bf16 actor copy, bf16 reference and reward model, autocast update; cached in "
        "$SHIFU_CACHE/bf16_probe.json; the choice is printed and logged as precision/*); master weights and "
        "optimiser state stay fp32",
    )
    algo: Literal["ppo", "ppo_penalty", "reinforce", "gspo"] = opt(
        "ppo",
        "policy loss by name: ppo (clip), ppo_penalty (PPO paper), reinforce, gspo (sequence-level "
        "ratio and clip: set clip_low/clip_high near the paper's 3e-4/4e-4)",
    )
    advantage_estimator: (
        Literal["gae", "grpo", "dr_grpo", "rloo", "bon", "reinforce_pp", "reinforce_pp_baseline"] | None
    ) = opt(
        None,
        "advantages by name: gae (critic), grpo, dr_grpo, rloo, bon (best-of-G; group_size >= 2), reinforce_pp, "
        "reinforce_pp_baseline (critic-free); null: gae, or algo=reinforce's sequence return",
    )
    group_size: int = opt(
        1,
        "G responses sampled per prompt, kept together (batch_size counts responses: "
        "G x the prompts wanted per rollout)",
    )
    dynamic_sampling: bool = opt(False, "DAPO: drop the groups whose scores are all equal (from the update)")
    tis_cap: float | None = opt(
        None, "truncated importance sampling: weigh each token by min(pi_old / pi_rollout, cap); null: off"
    )
    critic_warmup: int = opt(0, "the first N iterations train only the critic (the actor does not move)")
    decoupled: bool = opt(
        False,
        "decoupled PPO (AReaL): clip around the proximal policy pi_old (the trainer's forward at the update) "
        "and weigh each token's loss by pi_old / pi_behav, the sampler's recorded log-probs (capped at tis_cap "
        "when set); for max_staleness > 0",
    )
    is_mask: float | None = opt(
        None,
        "SAO's double-sided mask c > 1: tokens whose ratio pi_old / pi_behav lies outside [1/c, c] are dropped "
        "from the policy loss (weight 0), not clipped; the others keep decoupled's weight; null: off",
    )
    critic_updates: int = opt(
        1,
        "K: the critic's passes over each rollout per actor update (ppo_epochs x minibatches each; the K-1 "
        "extra ones train the critic alone); needs a critic with its own optimiser",
    )
    max_staleness: int = opt(
        0,
        "S: asynchronous PPO, rollouts sampled up to S policy versions behind the trainer while it updates "
        "(async_schedule); 0: synchronous",
    )
    async_schedule: Literal["fixed", "bounded"] = opt(
        "fixed",
        "fixed: iteration k trains a batch sampled by policy version max(0, k - 1 - S), bit-reproducible; "
        "bounded: each iteration trains the first episodes finished by a version at most S behind (a straggler "
        "does not hold its batch), exactly-once but not bit-reproducible",
    )
    async_samplers: int = opt(
        4,
        "async_schedule=bounded: sampler threads sampling at once, each batch_size / async_samplers responses per "
        "call and each with its own copy of the policy's weights (more hide more stragglers, for memory); over "
        "environment or agent episodes each sampler's episodes run on their own, and 1 is enough",
    )
    iterations: int = opt(20, "rollout + update iterations")
    batch_size: int = opt(32, "responses per rollout (batch_size / group_size prompts), over all processes")
    minibatch_size: int = opt(8, "responses per optimiser step, over all processes (global)")
    grad_accum: int = opt(1, "micro-batches a minibatch is split into (same update, less memory)")
    micro_batch_tokens: int | None = opt(
        None,
        "split each minibatch into micro-batches of at most this many tokens (rows x (longest prompt + longest "
        "response), padding columns that every row of a micro-batch pads trimmed), longest responses "
        "together, instead of grad_accum equal splits: less padding when response lengths vary, the same "
        "loss up to float rounding; null: off",
    )
    micro_batch_size: int = opt(32, "rows per no-grad scoring forward in the rollout")
    ppo_epochs: int = opt(4, "passes over each rollout")
    clip_low: float = opt(0.2, "PPO clip: ratio >= 1 - clip_low")
    clip_high: float = opt(0.2, "PPO clip: ratio <= 1 + clip_high")
    dual_clip: float | None = opt(None, "dual-clip bound c > 1 for negative advantages; null disables")
    value_clip: float | None = opt(0.2, "value clipping around old values; null disables")
    vf_coef: float = opt(0.1, "c1: weight of the value loss")
    ent_coef: float = opt(0.0, "c2: weight of the entropy bonus")
    ptx_coef: float = opt(0.0, "weight of the SFT NLL term (PPO-ptx); needs data.ptx")
    gamma: float = opt(1.0, "GAE discount")
    lam: float = opt(0.95, "GAE lambda")
    whiten_advantages: bool = opt(True, "whiten advantages over the real tokens of the rollout")
    loss_aggregation: Literal["token_mean", "seq_mean", "token_sum_norm"] = opt(
        "token_mean", "token-mean, sequence-mean, or token-sum / (rows * max_new_tokens) losses (Dr. GRPO)"
    )
    target_approx_kl: float | None = opt(
        None, "stop the epochs early when approx_kl > 1.5 x this; null disables"
    )
    joint_optimizer: bool = opt(False, "one optimiser over actor and critic (always for critic.init=shared)")
    reinforce_baseline: bool = opt(True, "reinforce: subtract the batch mean return")
    penalty_init: float = opt(1.0, "ppo_penalty: initial beta of KL(pi_old || pi)")
    penalty_target: float = opt(0.01, "ppo_penalty: target per-token KL(pi_old || pi) (PPO paper d_targ)")
    reuse_generation_log_probs: bool = opt(
        True,
        "fp32: take old log-probs, entropy and shared-trunk values from the decode steps instead of a "
        "second forward pass (equal up to float rounding); bf16 autocast or half-precision weights always "
        "recompute",
    )
    save_every: int = opt(10, "checkpoint every N iterations (0: only at the end)")
    max_nonfinite_steps: int = opt(
        8, "stop after this many consecutive optimiser steps with a NaN/Inf loss or gradient (each skipped)"
    )
    generation: GenerationConfig = opt(GenerationConfig(), "sampling of rollouts")
    data: PromptDataConfig = opt(PromptDataConfig(), "prompt data")
    reward: RewardConfig = opt(RewardConfig(), "reward model or function, score processing")
    critic: CriticConfig = opt(CriticConfig(), "critic initialisation and optimiser")
    kl: KLConfig = opt(KLConfig(), "KL penalty to the reference and its controller")
    optim: OptimConfig = opt(OptimConfig(lr=1e-5), "actor optimiser")
    eval: PolicyEvalConfig = opt(PolicyEvalConfig(), "held-out evaluation and best checkpoint")
    guard: GuardConfig = opt(GuardConfig(), "reward-hacking guard")
    lora: LoraConfig = opt(
        LoraConfig(), "LoRA actor (the reference is then the actor with adapters disabled) and critic"
    )
    env: EnvConfig = opt(EnvConfig(), "multi-turn episodes with an environment or tools (factory null: off)")
    agent: AgentConfig = opt(
        AgentConfig(), "episodes of an outside agent on the policy gateway (factory null: off)"
    )
    verifiers: VerifiersConfig = opt(
        VerifiersConfig(), "episodes of a verifiers taskset, its harness and its rewards (taskset null: off)"
    )
    traces: TracesConfig = opt(
        TracesConfig(), "what the run records of its trajectories (shifu traces export)"
    )

    def validate(self) -> None:
        super().validate()
        if not self.verifiers.taskset:  # (a verifiers taskset's tasks are the prompts)
            self.data.validate()
        check_source(self)  # exactly one of env.factory, agent.factory, verifiers.taskset and reward.*
        self.reward.validate()
        self._validate_sizes()
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ConfigError("clip_low must be in (0, 1) and clip_high > 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip must be > 1 (got {self.dual_clip}); null disables it")
        self.generation.validate()
        self.kl.validate()
        if self.ptx_coef > 0 and not self.data.ptx:
            raise ConfigError("ptx_coef > 0 needs data.ptx (an SFT data file)")
        if self.algo == "reinforce" and self.ppo_epochs != 1:
            raise ConfigError("algo=reinforce is on-policy: set ppo_epochs=1")
        self.eval.validate()
        self._validate_estimators()
        self.optim.validate("optim")
        self.critic.optim.validate("critic.optim")
        self._validate_lora_and_processes()

    def _validate_sizes(self) -> None:
        """The batch sizes: positive, each a multiple of the next (or micro_batch_tokens instead)."""
        require_positive(
            self,
            ("iterations", "batch_size", "minibatch_size", "grad_accum", "micro_batch_size", "ppo_epochs"),
        )
        if self.batch_size % self.minibatch_size:
            raise ConfigError(
                f"batch_size ({self.batch_size}) must be a multiple of minibatch_size ({self.minibatch_size})"
            )
        if self.minibatch_size % self.grad_accum:
            raise ConfigError(
                f"minibatch_size ({self.minibatch_size}) must be a multiple of grad_accum ({self.grad_accum})"
            )
        if self.micro_batch_tokens is not None and (self.micro_batch_tokens < 1 or self.grad_accum > 1):
            raise ConfigError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) must be >= 1 and replaces grad_accum "
                f"({self.grad_accum}): set grad_accum=1, or micro_batch_tokens=null"
            )

    def _validate_lora_and_processes(self) -> None:
        """LoRA actor / critic, and what the multi-process strategies do not support."""
        d = self.distributed
        if self.lora.enabled:
            self.lora.check_adapters(d.strategy)
            if self.model.ref_path:
                raise ConfigError(
                    "lora.enabled=true uses the actor with adapters disabled as the reference: drop model.ref_path"
                )
        if self.lora.critic:
            self.lora.validate()
            if not self.uses_critic or self.algo == "reinforce" or self.critic.init == "shared":
                raise ConfigError(
                    "lora.critic=true needs a critic of its own (critic.init=reward or sft, with GAE); a shared "
                    "critic is the actor's trunk (LoRA through lora.enabled), other estimators have none"
                )
            if d.strategy in ("fsdp2", "deepspeed"):
                raise ConfigError(
                    f"lora.critic=true with distributed.strategy={d.strategy} is not supported: use strategy=ddp"
                )
        if self.critic.head_init == "zero" and self.critic.init == "reward":
            raise ConfigError(
                "critic.head_init=zero starts a new value head at 0: set critic.init=sft or shared "
                "(critic.init=reward keeps the reward model's trained head)"
            )
        if d.strategy != "none" and self.critic.init == "shared":
            raise ConfigError(
                f"critic.init=shared with distributed.strategy={d.strategy} is not supported (the value head "
                "sits outside the wrapped actor): use critic.init=sft or reward"
            )
        if d.strategy == "deepspeed" and self.joint_optimizer:
            raise ConfigError("joint_optimizer=true with distributed.strategy=deepspeed is not supported")

    @property
    def estimator(self) -> str:
        """The advantage estimator that runs: ``advantage_estimator``, else ``gae``, or ``reinforce`` (the
        batch-baselined sequence return) for algo=reinforce."""
        return self.advantage_estimator or ("reinforce" if self.algo == "reinforce" else "gae")

    @property
    def max_response_tokens(self) -> int:
        """The most tokens a rollout row holds after its prompt: ``generation.max_new_tokens``, or with an
        environment or an agent ``generation.max_total_tokens`` (sampled and read tokens of an episode)."""
        g = self.generation
        episodes = self.env.factory or self.agent.factory or self.verifiers.taskset
        return g.max_total_tokens if episodes else g.max_new_tokens

    @property
    def uses_critic(self) -> bool:
        """Only GAE values tokens: every other estimator runs without a critic."""
        return self.estimator == "gae"

    def _validate_estimators(self) -> None:
        G, est = self.group_size, self.estimator
        if G < 1 or self.batch_size % G:
            raise ConfigError(group_size_advice(self.batch_size, G, self.minibatch_size))
        grouped = est in ("grpo", "dr_grpo", "rloo", "bon", "reinforce_pp_baseline") or self.dynamic_sampling
        if grouped and G < 2:
            what = f"advantage_estimator={est}" if est != "gae" else "dynamic_sampling=true"
            raise ConfigError(f"{what} compares the responses to one prompt: set group_size >= 2 (got {G})")
        if self.reward.dense and est in ("rloo", "bon"):
            raise ConfigError(
                f"reward.dense gives per-token rewards, but advantage_estimator={est} compares one "
                "number per response: use grpo or dr_grpo (normalised per token), gae, reinforce_pp "
                "or reinforce_pp_baseline, or reward.dense=false"
            )
        if est == "dr_grpo" and self.loss_aggregation != "token_sum_norm":
            raise ConfigError(
                "advantage_estimator=dr_grpo divides the loss by a constant (Dr. GRPO): set "
                "loss_aggregation=token_sum_norm"
            )
        if self.algo == "gspo" and max(self.clip_low, self.clip_high) > 0.01:
            raise ConfigError(
                f"algo=gspo clips the length-normalised sequence ratio, which moves far less than a token's: "
                f"clip_low={self.clip_low}, clip_high={self.clip_high} would never clip; use the paper's "
                "clip_low=3e-4 clip_high=4e-4"
            )
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError(f"tis_cap must be > 0 (got {self.tis_cap}); null disables it")
        self._validate_async()
        if self.critic_warmup < 0:
            raise ConfigError(f"critic_warmup must be >= 0 (got {self.critic_warmup})")
        if self.critic_warmup:
            if not self.uses_critic or self.critic.init == "shared" or self.joint_optimizer:
                raise ConfigError(
                    "critic_warmup needs a separate critic with its own optimiser: advantage_estimator gae, "
                    "critic.init reward or sft, joint_optimizer=false"
                )

    def _validate_async(self) -> None:
        """Asynchronous PPO and its objective: decoupled, is_mask, critic_updates, max_staleness."""
        if self.is_mask is not None and not self.is_mask > 1:
            raise ConfigError(
                f"is_mask must be > 1, the band [1/c, c] (got {self.is_mask}); null disables it"
            )
        if self.critic_updates < 1:
            raise ConfigError(f"critic_updates must be >= 1 (got {self.critic_updates})")
        if self.critic_updates > 1 and (
            not self.uses_critic or self.critic.init == "shared" or self.joint_optimizer
        ):
            raise ConfigError(
                "critic_updates > 1 needs a separate critic with its own optimiser: advantage_estimator gae, "
                "critic.init reward or sft, joint_optimizer=false"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0 (got {self.max_staleness}); 0 is synchronous")
        if self.async_samplers < 1:
            raise ConfigError(f"async_samplers must be >= 1 (got {self.async_samplers})")
        if self.max_staleness > 0 and self.distributed.strategy != "none":
            raise ConfigError(
                f"max_staleness > 0 runs in one process: distributed.strategy={self.distributed.strategy} "
                "is not supported with it yet (set max_staleness=0, or distributed.strategy=none)"
            )

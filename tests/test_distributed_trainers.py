"""The trainers under torchrun (2 CPU processes, gloo): PPO with DDP / FSDP2 / DeepSpeed ZeRO, LoRA and
gradient checkpointing inside the PPO trainer.

Launches (each costs seconds of start-up, so checks are batched):

- ``dist_scripts/check_ppo.py``: one PPO update on 2 ranks == 1 process on the same global experience
  (DDP, FSDP2; with a negative control), and, with ``--deepspeed``, ZeRO-2/3 PPO updates lower the loss.
- the real CLI, ``torchrun -m shifu ppo``: 2 iterations with DDP (uneven response lengths across ranks,
  evaluation, best/ and final/ written once by rank 0); FSDP2 with sharded checkpoints: 2 iterations,
  resume to 4 == 4 uninterrupted.

Process groups get a short timeout (a deadlock fails instead of hanging) and every launch a subprocess
timeout. The LoRA and gradient-checkpointing checks run in this process (no torchrun needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ppo_task
import pytest
import torch
from test_distributed import launch

from shifu.config.loader import load_config
from shifu.config.schema import PPOConfig as Config
from shifu.core.stats import mean_se
from shifu.generation.rollout import policy_forward
from shifu.models.loading import fuse_tanh_gelu, load_causal_lm, load_tokenizer
from shifu.models.padding import pad_left
from shifu.models.scalar import ScalarModel
from shifu.parallel import build_strategy
from shifu.rewards.sources import RewardSource
from shifu.rollout.batch import PromptBatch
from shifu.rollout.sources import SingleTurn
from shifu.trainers import ppo, ppo_models, ppo_rollout

HERE = Path(__file__).resolve().parent
torch.set_num_threads(1)


def env() -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1"}
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), e.get("PYTHONPATH", "")])
    e.pop("WORLD_SIZE", None)
    return e


def torchrun_ppo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "shifu",
        "ppo",
        *args,
    ]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_ppo")
    return {"model": ppo_task.build_char_model(d / "model"), "prompts": ppo_task.write_prompts(d / "p.jsonl")}


def cli_args(task, out: Path, *extra: str) -> list[str]:
    return [
        f"out_dir={out}",
        f"model.path={task['model']}",
        f"data.train={task['prompts']}",
        "reward.function=ppo_task:frac_a",
        "critic.init=sft",
        "batch_size=8",
        "minibatch_size=4",
        "ppo_epochs=2",
        "generation.max_new_tokens=8",
        "optim.lr=1e-2",
        "optim.schedule=constant",
        "critic.optim.lr=1e-2",
        "critic.optim.schedule=constant",
        "distributed.timeout_s=60",
        *extra,
    ]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ------------------------------------------------------------------------------------------ 2 processes


@pytest.fixture(scope="module")
def ppo_results(tmp_path_factory):
    return launch("check_ppo.py", tmp_path_factory.mktemp("ppo_eq"), timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("check", ["ppo_ddp_equals_single", "ppo_fsdp2_equals_single"])
def test_ppo_update_on_two_ranks_equals_one_process(ppo_results, check):
    results, log = ppo_results
    assert check in results, f"check '{check}' never ran; torchrun output:\n{log}"
    assert results[check]["ok"], results[check]["detail"]


@pytest.fixture(scope="module")
def episode_results(tmp_path_factory):
    return launch("check_episodes.py", tmp_path_factory.mktemp("episodes_eq"), timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("check", ["episodes_ddp_equals_single", "episodes_fsdp2_equals_single"])
def test_episodes_on_two_ranks_equal_one_process(episode_results, check):
    """Each rank runs its share of the episodes (rank 0's end after one turn, rank 1's after three: rank 0
    samples stand-ins in step) and gets exactly the one-process episodes; the PPO update agrees."""
    results, log = episode_results
    assert check in results, f"check '{check}' never ran; torchrun output:\n{log}"
    assert results[check]["ok"], results[check]["detail"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_ppo_lowers_the_loss(tmp_path_factory, stage):
    pytest.importorskip("deepspeed", reason="optional: pip install 'shifu-rlhf[deepspeed]'")
    results, log = _deepspeed_results(tmp_path_factory)
    check = f"ppo_zero{stage}_learns"
    assert check in results, f"check '{check}' never ran; torchrun output:\n{log}"
    assert results[check]["ok"], results[check]["detail"]


_DS: dict = {}


def _deepspeed_results(tmp_path_factory):
    # one launch for both stages; DeepSpeed compiles its CPU comm op on first use (minutes when cold)
    if "r" not in _DS:
        _DS["r"] = launch("check_ppo.py", tmp_path_factory.mktemp("ppo_ds"), "--deepspeed", timeout=500)
    return _DS["r"]


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_ddp_two_iterations_rank0_writes_once(task, tmp_path):
    """torchrun -m shifu ppo with DDP: uneven responses across ranks finish (synced generation), the
    evaluation runs on both ranks, and the run directory holds exactly one copy of every record."""
    out = tmp_path / "ddp"
    torchrun_ppo(
        *cli_args(
            task,
            out,
            "distributed.strategy=ddp",
            "iterations=2",
            "eval.every=1",
            "eval.num_prompts=6",
            "save_every=1",
            "eval.gold_function=ppo_task:frac_a",
            "eval.final_prompts=4",
        )
    )
    metrics = rows_of(out / "metrics.jsonl")
    its = [r["step"] for r in metrics if "objective/kl" in r]
    assert its == [1, 2], its  # one line per iteration (rank 1 wrote nothing)
    sizes = next(r for r in metrics if "sizes/processes" in r)
    assert sizes["sizes/processes"] == 2 and sizes["sizes/batch_per_process"] == 4
    assert all(r["rollout/rows"] == 8 for r in metrics if "rollout/rows" in r)  # global batch
    trained = rows_of(out / "trained.jsonl")  # every rank's trajectories, written once
    assert [r["step"] for r in trained] == [0] * 8 + [1] * 8 and all(
        r["version"] == r["step"] for r in trained
    )
    samples = rows_of(out / "samples.jsonl")
    per_eval = [sum(s["iteration"] == i for s in samples) for i in (0, 1, 2)]
    assert per_eval[0] > 0 and per_eval == [per_eval[0]] * 3, per_eval  # each held-out prompt once per eval
    assert (out / "final" / "model.safetensors").exists() and (out / "critic").is_dir()
    assert (out / "best" / "model.safetensors").exists()
    assert load_causal_lm(out / "final") is not None
    assert not any(p.name.startswith(".tmp") for p in out.rglob("*"))
    # the final evaluation: each rank its share of the held-out prompts (3: 5% of 64), gathered back in order
    summary = json.loads((out / "summary.json").read_text())
    before, after = rows_of(out / "samples_before.jsonl"), rows_of(out / "samples_after.jsonl")
    assert summary["eval_prompts"] == 3 and [r["prompt"] for r in before] == [r["prompt"] for r in after]
    assert [r["prompt"] for r in before] == [r["prompt"] for r in samples if r["iteration"] == 0][:3]
    gain, gain_se = mean_se([a["gold"] - b["gold"] for b, a in zip(before, after)])
    assert summary["gold_gain"] == pytest.approx(gain) and summary["gold_gain_se"] == pytest.approx(gain_se)


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_fsdp2_episodes_train_and_evaluate_on_two_processes(task, tmp_path):
    """torchrun -m shifu ppo with an environment under FSDP2: each process runs its share of the episodes
    (rollouts and the held-out evaluation), the run directory holds one copy of every record."""
    out = tmp_path / "episodes"
    args = [
        a
        for a in cli_args(task, out, "distributed.strategy=fsdp2", "iterations=2", "eval.every=1")
        if not a.startswith("reward.function=")
    ]
    torchrun_ppo(
        *args,
        "env.factory=thirdparty_env:Echo",
        "generation.stop=[g,h,i,j,k,l]",
        "generation.max_new_tokens=6",
        "generation.max_total_tokens=24",
        "eval.num_prompts=6",
    )
    metrics = rows_of(out / "metrics.jsonl")
    rolled = [r for r in metrics if "env/turns" in r]
    assert len(rolled) == 2 and all(r["rollout/rows"] == 8 and 1 <= r["env/turns"] <= 2 for r in rolled)
    evals = [r for r in metrics if "eval/env/return" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["gold/score"] == r["eval/score"] for r in evals)
    samples = rows_of(out / "samples.jsonl")
    per_eval = [sum(x["iteration"] == i for x in samples) for i in (0, 1, 2)]
    assert per_eval[0] > 1 and per_eval == [per_eval[0]] * 3, per_eval  # each held-out prompt once per eval
    assert all(x["turns"] >= 1 and "input" in x for x in samples)
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_ddp_group_estimator_keeps_each_group_on_one_process(task, tmp_path):
    """GRPO under torchrun: 2 prompts x G = 4 responses, one prompt's whole group per process (the group
    statistics need no collective); no critic anywhere. One prompt for two processes is refused at launch."""
    out = tmp_path / "grpo"
    args = ("distributed.strategy=ddp", "advantage_estimator=grpo", "group_size=4", "eval.every=0")
    torchrun_ppo(*cli_args(task, out, *args, "iterations=2"))
    metrics = rows_of(out / "metrics.jsonl")
    assert [r["rollout/rows"] for r in metrics if "rollout/rows" in r] == [8, 8]
    assert all("loss/value" not in r for r in metrics) and not (out / "critic").exists()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "shifu",
        "ppo",
        *cli_args(task, tmp_path / "one", *args, "group_size=8"),
    ]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "stays on one process" in proc.stdout + proc.stderr, proc.stderr[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_fsdp2_sharded_checkpoint_resume_equals_uninterrupted(task, tmp_path):
    common = ("distributed.strategy=fsdp2", "eval.every=0", "save_every=2")
    full, part = tmp_path / "full", tmp_path / "part"
    torchrun_ppo(*cli_args(task, full, *common, "iterations=4"))
    torchrun_ppo(*cli_args(task, part, *common, "iterations=2"))
    ck = part / "checkpoints" / "step-00000002"
    assert (ck / "sharded" / "actor" / ".metadata").exists() and (ck / "sharded" / "critic").is_dir()
    torchrun_ppo("--resume", *cli_args(task, part, *common, "iterations=4"))
    a, b = weights(full / "final"), weights(part / "final")
    start = weights(task["model"])
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 1e-3, "training did not change the actor"
    assert diff <= 1e-6 * max(1.0, moved), f"resumed actor differs from uninterrupted by {diff:.2e}"
    ma, mb = rows_of(full / "metrics.jsonl"), rows_of(part / "metrics.jsonl")
    ka = [r["objective/kl"] for r in ma if "objective/kl" in r]
    kb = [r["objective/kl"] for r in mb if "objective/kl" in r]
    assert ka == pytest.approx(kb, rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------ inside the trainer


class _Run:
    """PPO's four models placed by the one-process strategy (no torchrun needed)."""

    def __init__(self, task, *extra: str, ref: bool = True, lora: bool = False):
        self.cfg = load_config(Config, overrides=cli_args(task, Path("/tmp/unused"), "ppo_epochs=1", *extra))
        self.tok = load_tokenizer(task["model"])
        self.tok.padding_side = "left"
        actor = load_causal_lm(task["model"], dropout=False)
        if lora:
            from shifu.models.lora import wrap_lora

            actor = wrap_lora(actor, self.cfg.lora)
        critic = ScalarModel.from_backbone(task["model"], seed=0)
        r = load_causal_lm(task["model"], dropout=False) if ref else None
        strategy = build_strategy(self.cfg.distributed)
        strategy.launch("cpu")
        source = SingleTurn(RewardSource(function=ppo_task.frac_a))
        self.m = ppo_models.place(actor, critic, None, r, source, None, self.tok, self.cfg, strategy)
        self.s = ppo_models.PPOState.new(self.cfg, strategy)

    def rollout(self, pids, pmask, rows):
        params = ppo.sampling_params(self.cfg)
        batch = PromptBatch(pids, pmask, rows)
        return ppo_rollout.collect_rollout(self.m, self.cfg, batch, params, self.s.sample_gen)[0]


def _prompts(tok, n=8):
    rows = [{"prompt": "abc"[: 1 + i % 3] + "def"[i % 3]} for i in range(n)]
    b = pad_left([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows], tok.pad_token_id)
    return b["input_ids"], b["attention_mask"], rows


@pytest.mark.integration
def test_lora_reference_in_the_trainer_equals_a_frozen_copy(task):
    """With lora.enabled the trainer loads no reference: its reference log-probs (actor with adapters off)
    equal a real frozen SFT copy's, also after PPO updates moved the adapters."""
    pytest.importorskip("peft")
    t = _Run(
        task,
        "lora.enabled=true",
        "lora.r=4",
        "lora.target_modules=[c_attn]",
        "optim.lr=5e-2",
        ref=False,
        lora=True,
    )
    # the trainer runs GPT-2 with the fused tanh-GELU; the frozen copy must use the same kernel to be bit-equal
    frozen = fuse_tanh_gelu(load_causal_lm(task["model"], dropout=False).eval())
    pids, pmask, rows = _prompts(t.tok)
    for _ in range(2):
        ppo.learn(t.m, t.s, t.cfg, t.rollout(pids, pmask, rows))
    exp = t.rollout(pids, pmask, rows)
    with torch.no_grad():
        want = policy_forward(frozen, exp.input_ids, exp.attention_mask, exp.prompt_len)[0]
    assert torch.equal(exp.ref_log_probs, want.float())
    moved = (exp.old_log_probs - exp.ref_log_probs).abs().max().item()
    assert moved > 1e-4, "the adapters did not change the actor: the check above would be vacuous"


@pytest.mark.integration
def test_gradient_checkpointing_in_the_trainer_gives_the_same_update(task):
    a = _Run(task)
    b = _Run(task, "distributed.gradient_checkpointing=true")
    assert b.m.actor.is_gradient_checkpointing and not a.m.actor.is_gradient_checkpointing
    pids, pmask, rows = _prompts(a.tok)
    exp = a.rollout(pids, pmask, rows)
    ppo.learn(a.m, a.s, a.cfg, exp)
    ppo.learn(b.m, b.s, b.cfg, exp)
    for (k, p), q in zip(a.m.actor.named_parameters(), b.m.actor.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=k)
    assert any(
        (p - q).abs().max() > 0 for p, q in zip(a.m.actor.parameters(), _Run(task).m.actor.parameters())
    )


@pytest.mark.unit
def test_distributed_config_rejects_impossible_combinations(task):
    from shifu.errors import ConfigError

    bad = {
        "distributed.strategy=deepspeed": "deepspeed_config",
        "distributed.deepspeed_config=x.json": "strategy",
        "distributed.frozen=fsdp2 distributed.offload_frozen=true distributed.strategy=ddp": "offload_frozen",
        "lora.enabled=true distributed.strategy=fsdp2": "lora.enabled",
        "critic.init=shared distributed.strategy=ddp": "critic.init=shared",
    }
    for overrides, name in bad.items():
        with pytest.raises(ConfigError, match=name):
            load_config(Config, overrides=cli_args(task, Path("/tmp/x"), *overrides.split()))

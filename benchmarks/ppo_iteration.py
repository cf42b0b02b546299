"""Time full PPO iterations of shifu (and, with --vs-trl, of TRL's PPO on the identical models).

Setup: random GPT-2-style policy (4 layers, width 256, 4 heads, vocab 4096, tied embeddings),
reward and value models of the same shape; 32 prompts x 16 tokens, 32 new tokens with EOS disabled (every
response has 32 tokens), 4 PPO epochs of minibatch 8 (16 optimiser steps per iteration), fp32, 1 thread,
1 warm-up + 5 measured iterations. Prints one JSON line per system.

    python benchmarks/ppo_iteration.py              # shifu only
    python benchmarks/ppo_iteration.py --vs-trl     # alternate shifu and TRL runs, print the ratio
    python benchmarks/ppo_iteration.py --short      # 1 iteration, no warm-up (CI: keeps it from rotting)

The cost curve: ``--shape toy|gpt2-12x512|smollm2-135m`` and ``--response-len N`` (random weights;
``--batch``/``--minibatch`` shrink the rollout at the large shapes). ``--eos-scale s`` scales the EOS row of
the tied embedding so that responses stop at EOS at varied lengths (then EOS is not disabled);
``--micro-batch-tokens N`` passes shifu's token-budget micro-batches; ``--budget-ab N`` alternates shifu
runs without and with ``micro_batch_tokens=N`` instead of the TRL comparison.

The model builders below import only torch/transformers/tokenizers so that the TRL side (its own
virtualenv, ``.bench/trl-venv``, TRL 1.12.0) builds bit-identical models from the same seeds.
FLOPs are counted analytically (the useful work, identical for both systems): matmuls of the trunk,
attention scores and the LM head at the positions that need logits; backward = 2 x forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when `shifu bench` loads this file
import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".bench" / "trl-venv"
TRL_SPEC = ["trl==1.12.0"]
TORCH_WHEEL_GLOB = "/opt/wheels/torch-2.13.0*.whl"

SEED = 0


@dataclasses.dataclass
class Setup:
    """The benchmarked model shape and rollout (the defaults: the toy configuration)."""

    shape: str = "toy"
    arch: str = "gpt2"  # gpt2 or llama
    vocab: int = 4096
    width: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 1024  # MLP width
    batch: int = 32
    prompt_len: int = 16
    new_tokens: int = 32
    epochs: int = 4
    minibatch: int = 8
    eos_scale: float = 0.0  # > 0: responses stop at EOS (its embedding row scaled by this)
    micro_batch_tokens: int | None = None


SHAPES = {
    "toy": {},
    "gpt2-12x512": {"width": 512, "layers": 12, "heads": 8, "kv_heads": 8, "intermediate": 2048},
    # SmolLM2-135M's shape: Llama, 30 layers, width 576, GQA 9 query / 3 KV heads, SwiGLU 1536, tied embeddings
    "smollm2-135m": {
        "arch": "llama",
        "vocab": 49152,
        "width": 576,
        "layers": 30,
        "heads": 9,
        "kv_heads": 3,
        "intermediate": 1536,
    },
}
S = Setup()


# ----------------------------------------------------------------------------------------- models
def build_tokenizer(tmp: Path):
    """A word-level tokenizer over ``S.vocab`` tokens ``<pad>, <eos>, w2 ..`` (offline, instant)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, S.vocab)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp / "tokenizer.json"
    tk.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), pad_token="<pad>", eos_token="<eos>")


def model_config():
    """The HF config of ``S``'s shape (dropout off, EOS 1, pad 0, tied embeddings)."""
    if S.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=S.vocab,
            hidden_size=S.width,
            intermediate_size=S.intermediate,
            num_hidden_layers=S.layers,
            num_attention_heads=S.heads,
            num_key_value_heads=S.kv_heads,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=1,
            pad_token_id=0,
        )
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=S.vocab,
        n_positions=max(128, S.prompt_len + S.new_tokens),
        n_embd=S.width,
        n_layer=S.layers,
        n_head=S.heads,
        n_inner=S.intermediate,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )


def build_policy(seed: int = SEED):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config()).eval()
    if S.eos_scale:  # a large EOS embedding (tied: also its logit row): responses end at varied lengths
        with torch.no_grad():
            model.get_input_embeddings().weight[1].mul_(S.eos_scale)
    return model


def build_scalar_parts(seed: int):
    """(trunk, head weight (1, d)) of a scalar model: head N(0, 1/sqrt(d+1)), bias 0 (the spec)."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    trunk = AutoModel.from_config(model_config()).eval()
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(1, S.width, generator=g) / (S.width + 1) ** 0.5
    return trunk, head


def build_prompts(n_iters: int) -> torch.Tensor:
    """(n_iters * S.batch, S.prompt_len) prompt ids, no padding, never <pad>/<eos>."""
    g = torch.Generator().manual_seed(SEED + 100)
    return torch.randint(2, S.vocab, (n_iters * S.batch, S.prompt_len), generator=g)


# ----------------------------------------------------------------------------------------- FLOPs
def trunk_params() -> int:
    """Weights of the trunk's matmuls per layer x layers (GPT-2: 12 d^2; Llama: q, o d^2, k, v d*d_kv, MLP 3 d f)."""
    d, f = S.width, S.intermediate
    if S.arch == "llama":
        kv = d * S.kv_heads // S.heads
        return S.layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    return S.layers * (4 * d * d + 2 * d * f)


def forward_flops(tokens: int, context: float, logit_positions: int, lm_head: bool = True) -> float:
    """Matmul FLOPs of one forward: trunk 2 x its matmul weights per token (GPT-2: 24 L d^2), attention
    4 L d per (query, key) pair, LM head 2 d V per position that needs logits."""
    trunk = 2 * trunk_params() * tokens
    attention = 4 * S.layers * S.width * tokens * context
    head = 2 * S.width * S.vocab * logit_positions if lm_head else 0
    return trunk + attention + head


def phase_flops(response_len: float | None = None) -> dict[str, float]:
    """FLOPs per phase at the full response length, or (EOS) at the measured mean ``response_len`` (the
    useful work: padding after EOS earns no credit)."""
    B, P = S.batch, S.prompt_len
    R = S.new_tokens if response_len is None else response_len
    T = P + R
    causal = (T + 1) / 2  # mean keys per query of a causal forward over T positions
    # generation: prefill B*P tokens (logits at the last position), then R-1 one-token steps
    gen = forward_flops(B * P, (P + 1) / 2, B) + sum(
        forward_flops(B, P + t + 1, B) for t in range(max(0, round(R) - 1))
    )
    # scoring: the reference (logits at R positions), critic and reward trunks (scalar heads ~ 0). The
    # rollout policy's own log-probs are not counted: the decode steps already computed those logits (a
    # system that runs a second policy forward for them, as TRL does, gets no credit for it)
    scoring = forward_flops(B * T, causal, B * R) + 2 * forward_flops(B * T, causal, 0, lm_head=False)
    # training: every epoch, actor and critic forward + backward (3x forward) over the whole rollout
    train = (
        S.epochs * 3 * (forward_flops(B * T, causal, B * R) + forward_flops(B * T, causal, 0, lm_head=False))
    )
    return {"generation": gen, "scoring": scoring, "train": train}


def matmul_peak_gflops(n: int = 512, repeats: int = 20) -> float:
    """Best-of measured fp32 GEMM throughput (n x n @ n x n) in this process, 1 thread."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarise(system: str, iters: list[dict], peaks: tuple[float, float], extra: dict) -> dict:
    """One JSON-able dict from per-iteration {total, generation, scoring, train} seconds.

    ``peaks``: the GEMM peak read before and after the iterations. MFU divides by the higher one (the
    machine's speed drifts on a VM; one reading taken in a slow moment made MFU read above 1)."""
    peak = max(peaks)
    fl = phase_flops(extra.get("mean_response_len") if S.eos_scale else None)
    total_flops = sum(fl.values())

    def med(k):
        return statistics.median(it[k] for it in iters)

    out = {
        "system": system,
        "setup": dataclasses.asdict(S),
        "iterations": len(iters),
        "median_s_per_iter": med("total"),
        "min_s_per_iter": min(it["total"] for it in iters),
        "median_generation_s": med("generation"),
        "median_scoring_s": med("scoring"),
        "median_train_s": med("train"),
        "generated_tokens_per_s": S.batch * extra.get("mean_response_len", S.new_tokens) / med("generation"),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "flops_per_iter": total_flops,
        "matmul_peak_gflops": round(peak, 2),
        "matmul_peak_gflops_before_after": [round(p, 2) for p in peaks],
        "mfu": total_flops / med("total") / (peak * 1e9),
    }
    for phase, key in (("generation", "generation"), ("scoring", "scoring"), ("train", "train")):
        out[f"mfu_{phase}"] = fl[phase] / med(key) / (peak * 1e9) if med(key) > 0 else None
    out.update(extra)
    return out


# ----------------------------------------------------------------------------------------- shifu
def run_shifu(n_iters: int, warmup: int, fast: bool) -> dict:
    from shifu.cli.main import keep_freed_memory

    malloc = keep_freed_memory()  # as the shifu command does before any command (SHIFU_MALLOC=system: not)
    from shifu.config.schema import PPOConfig
    from shifu.config.sections import GenerationConfig, OptimConfig
    from shifu.models.scalar import ScalarModel, new_value_head
    from shifu.parallel import build_strategy
    from shifu.rewards.sources import RewardSource
    from shifu.trainers import ppo, ppo_models

    tmp = Path(tempfile.mkdtemp(prefix="shifu-bench-"))
    tok = build_tokenizer(tmp)
    actor, ref = build_policy(), build_policy()
    reward = _scalar_model(1, tok, ScalarModel)
    critic = None if fast else _scalar_model(2, tok, ScalarModel)
    cfg = PPOConfig(
        batch_size=S.batch,
        minibatch_size=S.minibatch,
        ppo_epochs=S.epochs,
        micro_batch_size=S.batch,
        seed=SEED,
        joint_optimizer=fast,
        bf16=fast,
        optim=OptimConfig(lr=1e-5),
        micro_batch_tokens=S.micro_batch_tokens,
        generation=GenerationConfig(max_new_tokens=S.new_tokens),
    )
    value_head = new_value_head(S.width, SEED) if fast else None
    strategy = build_strategy(cfg.distributed)
    strategy.launch("cpu")
    reward_source = RewardSource(model=reward, policy_tokenizer=tok)
    models = ppo_models.place(actor, critic, value_head, ref, reward_source, tok, cfg, strategy)
    state = ppo_models.PPOState.new(cfg, strategy)
    # EOS disabled (every response has S.new_tokens tokens) unless --eos-scale
    params = dataclasses.replace(ppo.sampling_params(cfg), stop_at_eos=bool(S.eos_scale))
    steps = [0]
    models.optimizers["actor"].optimizer.register_step_post_hook(
        lambda *a: steps.__setitem__(0, steps[0] + 1)
    )
    prompts = build_prompts(warmup + n_iters)
    mask = torch.ones_like(prompts)
    peak_before = matmul_peak_gflops()
    iters, lengths = [], []
    for i in range(warmup + n_iters):
        rows = [{"prompt": ""} for _ in range(S.batch)]
        sl = slice(i * S.batch, (i + 1) * S.batch)
        t0 = time.perf_counter()
        m = ppo.iteration(models, state, cfg, prompts[sl], mask[sl], rows, params)
        total = time.perf_counter() - t0
        if i >= warmup:
            lengths.append(m["rollout/response_len"])
            iters.append(
                {
                    "total": total,
                    "generation": m["time/generation_s"],
                    "scoring": m["time/scoring_s"],
                    "train": m["time/update_s"],
                }
            )
    p = models.precision
    extra = {
        "optimizer_steps_per_iter": steps[0] // (warmup + n_iters),
        "mode": ("fast (shared trunk, bf16 where measured faster)" if fast else "fp32")
        + (f", micro_batch_tokens={S.micro_batch_tokens}" if S.micro_batch_tokens else ""),
        "bf16": dataclasses.asdict(p),  # decode, frozen, update, reward and the probe's reason
        "mean_response_len": statistics.mean(lengths),
        "malloc": malloc,
    }
    return summarise("shifu", iters, (peak_before, matmul_peak_gflops()), extra)


def _scalar_model(seed: int, tok, cls):
    trunk, head = build_scalar_parts(seed)
    model = cls(trunk, tok, seed=seed)
    with torch.no_grad():
        model.head.weight.copy_(head)
        model.head.bias.zero_()
    return model.eval()


def generation_vs_hf(rounds: int = 3) -> dict:  # (EOS disabled whatever --eos-scale says)
    """Generation tokens/s of shifu's engine and of HF ``generate`` (sampling, no EOS), alternating; and of
    shifu's engine on the bf16 decode copy that the fast defaults generate with where the probe picks it
    (``shifu.parallel.precision.bf16_copy``: weights cast once), against the same fp32 HF ``generate``."""
    from shifu.generation.rollout import SamplingParams, generate
    from shifu.parallel.precision import bf16_copy

    model = build_policy()
    model16 = bf16_copy(model)
    prompts = build_prompts(1)
    mask = torch.ones_like(prompts)
    params = SamplingParams(max_new_tokens=S.new_tokens, stop_at_eos=False)

    def ours():
        generate(model, prompts, mask, params, eos_token_id=1, pad_token_id=0)

    def ours16():
        generate(model16, prompts, mask, params, eos_token_id=1, pad_token_id=0)

    def hf():
        with torch.no_grad():
            model.generate(
                input_ids=prompts,
                attention_mask=mask,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                max_new_tokens=S.new_tokens,
                min_new_tokens=S.new_tokens,
                pad_token_id=0,
            )

    times: dict[str, list[float]] = {"shifu": [], "hf": [], "shifu_bf16": []}
    ours(), hf(), ours16()
    for _ in range(rounds):
        for name, fn in (("shifu", ours), ("hf", hf), ("shifu_bf16", ours16)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tps = {k: S.batch * S.new_tokens / statistics.median(v) for k, v in times.items()}
    return {
        "generation_tokens_per_s_shifu": tps["shifu"],
        "generation_tokens_per_s_hf_generate": tps["hf"],
        "generation_speedup_vs_hf": tps["shifu"] / tps["hf"],
        "generation_tokens_per_s_shifu_bf16_decode": tps["shifu_bf16"],
        "generation_speedup_bf16_decode_vs_hf": tps["shifu_bf16"] / tps["hf"],
    }


# ----------------------------------------------------------------------------------------- TRL
def run_trl(n_iters: int, warmup: int) -> dict:
    """TRL 1.12.0 PPO (trl.experimental.ppo) on the same models; runs inside the TRL virtualenv."""
    import warnings

    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tmp = Path(tempfile.mkdtemp(prefix="trl-bench-"))
    tok = build_tokenizer(tmp)

    def scalar(seed):
        trunk, head = build_scalar_parts(seed)
        cfg = model_config()
        cfg.num_labels = 1
        m = AutoModelForSequenceClassification.from_config(cfg)
        getattr(m, m.base_model_prefix).load_state_dict(trunk.state_dict())
        with torch.no_grad():
            m.score.weight.copy_(head)
        return m.eval()

    n = warmup + n_iters
    data = Dataset.from_dict({"input_ids": build_prompts(n).tolist()})
    # TRL: rollout batch = per_device_train_batch_size * gradient_accumulation_steps = 32, split into
    # num_mini_batches = 4 minibatches of 8 (at the default setup). Accelerate would step the optimiser
    # only every 4th minibatch (each minibatch is one micro-batch); gradient_accumulation_steps is reset
    # to 1 on the accelerator below so that TRL, like shifu, takes 16 optimiser steps of 8 sequences per
    # iteration. With --eos-scale TRL truncates responses after EOS (stop_token="eos").
    n_mini = S.batch // S.minibatch
    args = PPOConfig(
        output_dir=str(tmp / "out"),
        per_device_train_batch_size=S.minibatch,
        gradient_accumulation_steps=n_mini,
        num_mini_batches=n_mini,
        num_ppo_epochs=S.epochs,
        total_episodes=S.batch * n,
        response_length=S.new_tokens,
        stop_token="eos" if S.eos_scale else None,
        temperature=1.0,
        local_rollout_forward_batch_size=S.batch,
        learning_rate=1e-5,
        kl_coef=0.05,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        dataloader_num_workers=0,
        missing_eos_penalty=None,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_policy(),
        ref_model=build_policy(),
        reward_model=scalar(1),
        value_model=scalar(2),
        train_dataset=data,
    )
    trainer.accelerator.gradient_accumulation_steps = 1
    steps = [0]
    trainer.optimizer.optimizer.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer.add_callback(Clock())
    peak_before = matmul_peak_gflops()
    trainer.train()
    totals = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    # TRL times no phases; only the iteration total is comparable
    iters = [
        {"total": t, "generation": float("nan"), "scoring": float("nan"), "train": float("nan")}
        for t in totals
    ]
    out = summarise(
        "trl", iters, (peak_before, matmul_peak_gflops()), {"optimizer_steps_per_iter": steps[0] // n}
    )
    for k in ("median_generation_s", "median_scoring_s", "median_train_s", "generated_tokens_per_s"):
        out[k] = None
    for k in ("mfu_generation", "mfu_scoring", "mfu_train"):
        out[k] = None
    import trl

    out["trl_version"] = trl.__version__
    return out


def ensure_trl_venv() -> Path:
    """The TRL virtualenv (created on first use: CPU torch from the local wheel if present, then TRL)."""
    py = TRL_VENV / "bin" / "python"
    if py.exists():
        return py
    import glob

    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    wheels = glob.glob(TORCH_WHEEL_GLOB)
    torch_spec = wheels[0] if wheels else "torch==2.13.0"
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(
        [*pip, torch_spec, "--index-url", "https://download.pytorch.org/whl/cpu"]
        if not wheels
        else [*pip, torch_spec],
        check=True,
    )
    subprocess.run([*pip, *TRL_SPEC], check=True)
    return py


def setup_args() -> list[str]:
    """``S`` as command-line arguments (the subprocesses rebuild the same setup)."""
    out = [
        "--shape",
        S.shape,
        "--response-len",
        str(S.new_tokens),
        "--batch",
        str(S.batch),
        "--minibatch",
        str(S.minibatch),
        "--eos-scale",
        str(S.eos_scale),
    ]
    return out + (["--micro-batch-tokens", str(S.micro_batch_tokens)] if S.micro_batch_tokens else [])


# glibc's malloc set as shifu sets it (shifu.cli.main.keep_freed_memory), for a peer run given the same allocator
KEPT_MALLOC_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"}


def subprocess_run(
    python: str, system: str, n_iters: int, warmup: int, fast: bool = False, env_extra=None
) -> dict:
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--system",
        system,
        "--iters",
        str(n_iters),
        "--warmup",
        str(warmup),
        *setup_args(),
    ] + (["--fast"] if fast else [])
    env = dict(
        os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {})
    )
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{system} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    global S
    args = _parser().parse_args(argv)
    S = Setup(
        shape=args.shape,
        **SHAPES[args.shape],
        batch=args.batch,
        new_tokens=args.response_len,
        minibatch=args.minibatch,
        eos_scale=args.eos_scale,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    torch.set_num_threads(1)
    if args.short:
        args.iters, args.warmup, args.rounds = 1, 0, 1
    if args.system == "trl":
        print(json.dumps(run_trl(args.iters, args.warmup)), flush=True)
        return 0
    if args.budget_ab:
        _budget_ab(args)
        return 0
    if not args.vs_trl:
        out = run_shifu(args.iters, args.warmup, args.fast)
        if not (args.short or args.no_gen_check):
            out.update(generation_vs_hf(args.gen_rounds))
        print(json.dumps(out), flush=True)
        record(
            args,
            "single",
            {k: v for k, v in out.items() if k != "setup"},
            fast=args.fast,
            malloc=out.get("malloc"),
        )
        return 0
    _vs_trl(args)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="1 iteration, no warm-up (CI)")
    ap.add_argument("--iters", type=int, default=5, help="measured iterations")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up iterations (not measured)")
    ap.add_argument(
        "--fast",
        action="store_true",
        help="shifu's fast defaults: shared-trunk critic, bf16=true (bf16 only where the probe measures it faster)",
    )
    ap.add_argument("--vs-trl", action="store_true", help="alternate shifu and TRL runs; print the ratio")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of shifu/TRL runs with --vs-trl")
    ap.add_argument("--no-gen-check", action="store_true", help="skip generation tokens/s vs HF generate")
    ap.add_argument("--gen-rounds", type=int, default=3, help="alternating rounds of the generation check")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="toy", help="model shape (random weights)")
    ap.add_argument("--response-len", type=int, default=32, help="max new tokens per response")
    ap.add_argument("--batch", type=int, default=32, help="responses per rollout")
    ap.add_argument("--minibatch", type=int, default=8, help="responses per optimiser step")
    ap.add_argument(
        "--eos-scale", type=float, default=0.0, help="> 0: responses stop at EOS at varied lengths"
    )
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="shifu's micro_batch_tokens")
    ap.add_argument(
        "--budget-ab",
        type=int,
        default=None,
        help="alternate shifu fp32 runs without / with micro_batch_tokens=N (no TRL)",
    )
    ap.add_argument(
        "--peer-malloc",
        action="store_true",
        help="with --vs-trl: also run TRL with glibc malloc set as shifu sets it",
    )
    ap.add_argument("--system", choices=["shifu", "trl"], default="shifu", help=argparse.SUPPRESS)
    provenance.add_arguments(ap)
    return ap


def _budget_ab(args: argparse.Namespace) -> None:
    """``--budget-ab N``: alternating shifu fp32 runs without / with ``micro_batch_tokens=N``."""
    runs = {"fixed": [], "budget": []}
    for _ in range(args.rounds):
        for name, budget in (("fixed", None), ("budget", args.budget_ab)):
            S.micro_batch_tokens = budget
            runs[name].append(subprocess_run(sys.executable, "shifu", args.iters, args.warmup))
            print(json.dumps({"run": name, **runs[name][-1]}), flush=True)
    med = {k: statistics.median(r["median_train_s"] for r in v) for k, v in runs.items()}
    summary = {
        "update_s_fixed": med["fixed"],
        "update_s_budget": med["budget"],
        "update_ratio_budget_over_fixed": med["budget"] / med["fixed"],
        "per_round_update_ratio": [
            b["median_train_s"] / a["median_train_s"] for a, b in zip(runs["fixed"], runs["budget"])
        ],
    }
    print(json.dumps(summary), flush=True)
    runs = {k: [{x: y for x, y in r.items() if x != "setup"} for r in v] for k, v in runs.items()}
    record(
        args,
        "budget-ab",
        {"summary": summary, "runs": runs},
        budget=args.budget_ab,
        micro_batch_tokens=None,
    )


def _vs_trl(args: argparse.Namespace) -> None:
    """``--vs-trl``: alternating shifu, TRL and shifu-fast runs (and TRL with shifu's malloc), their ratios."""
    trl_py = str(ensure_trl_venv())
    runs: dict[str, list[dict]] = {"shifu": [], "trl": [], "shifu_fast": []}
    for _ in range(args.rounds):
        runs["shifu"].append(subprocess_run(sys.executable, "shifu", args.iters, args.warmup))
        print(json.dumps({"run": "shifu", **runs["shifu"][-1]}), flush=True)
        runs["trl"].append(subprocess_run(trl_py, "trl", args.iters, args.warmup))
        print(json.dumps({"run": "trl", **runs["trl"][-1]}), flush=True)
        runs["shifu_fast"].append(subprocess_run(sys.executable, "shifu", args.iters, args.warmup, fast=True))
        print(json.dumps({"run": "shifu_fast", **runs["shifu_fast"][-1]}), flush=True)
        if args.peer_malloc:  # TRL given shifu's malloc setting too: how much of the ratio is the allocator
            runs.setdefault("trl_kept_malloc", []).append(
                subprocess_run(trl_py, "trl", args.iters, args.warmup, env_extra=KEPT_MALLOC_ENV)
            )
            print(json.dumps({"run": "trl_kept_malloc", **runs["trl_kept_malloc"][-1]}), flush=True)

    def med(name):
        return statistics.median(r["median_s_per_iter"] for r in runs[name])

    summary = {
        "setup": dataclasses.asdict(S),
        "shifu_median_s_per_iter": med("shifu"),
        "trl_median_s_per_iter": med("trl"),
        "shifu_fast_median_s_per_iter": med("shifu_fast"),
        "ratio_shifu_over_trl": med("shifu") / med("trl"),
        "throughput_fast_over_trl": med("trl") / med("shifu_fast"),
        "throughput_fast_over_fp32": med("shifu") / med("shifu_fast"),
        "peak_rss_mib": {k: max(r["peak_rss_mib"] for r in v) for k, v in runs.items()},
    }
    if args.peer_malloc:
        summary["trl_kept_malloc_median_s_per_iter"] = med("trl_kept_malloc")
        summary["ratio_shifu_over_trl_kept_malloc"] = med("shifu") / med("trl_kept_malloc")
    if not args.no_gen_check:
        summary.update(generation_vs_hf(args.gen_rounds))
    print(json.dumps(summary), flush=True)
    runs_only = {k: [{x: y for x, y in r.items() if x != "setup"} for r in v] for k, v in runs.items()}
    summary = {k: v for k, v in summary.items() if k != "setup"}
    record(args, "vs-trl", {"summary": summary, "runs": runs_only}, peer_malloc=args.peer_malloc)


def record(args: argparse.Namespace, mode: str, metrics: dict, **extra) -> None:
    """With ``--record``: the run as a provenance record (params: the setup, the mode and its options)."""
    params = {
        **dataclasses.asdict(S),
        "mode": mode,
        "rounds": args.rounds,
        "iters": args.iters,
        "warmup": args.warmup,
        **extra,
    }
    provenance.record(args, "ppo_iteration", metrics, params=params, config=params, threads=1)


if __name__ == "__main__":
    sys.exit(main())

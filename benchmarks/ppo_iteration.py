"""Time full PPO iterations of shifu (and, with --vs-trl, of TRL's PPO on the identical models).

Setup (issue 8): random GPT-2-style policy (4 layers, width 256, 4 heads, vocab 4096, tied embeddings),
reward and value models of the same shape; 32 prompts x 16 tokens, 32 new tokens with EOS disabled (every
response has 32 tokens), 4 PPO epochs of minibatch 8 (16 optimiser steps per iteration), fp32, 1 thread,
1 warm-up + 5 measured iterations. Prints one JSON line per system.

    python benchmarks/ppo_iteration.py              # shifu only
    python benchmarks/ppo_iteration.py --vs-trl     # alternate shifu and TRL runs, print the ratio
    python benchmarks/ppo_iteration.py --short      # 1 iteration, no warm-up (CI: keeps it from rotting)

The model builders below import only torch/transformers/tokenizers so that the TRL side (its own
virtualenv, ``.bench/trl-venv``, TRL 1.12.0) builds bit-identical models from the same seeds.
FLOPs are counted analytically (the useful work, identical for both systems): matmuls of the trunk,
attention scores and the LM head at the positions that need logits; backward = 2 x forward.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".bench" / "trl-venv"
TRL_SPEC = ["trl==1.12.0"]
TORCH_WHEEL_GLOB = "/opt/wheels/torch-2.13.0*.whl"

VOCAB, WIDTH, LAYERS, HEADS = 4096, 256, 4, 4
BATCH, PROMPT_LEN, NEW_TOKENS, EPOCHS, MINIBATCH = 32, 16, 32, 4, 8
SEED = 0


# ----------------------------------------------------------------------------------------- models
def build_tokenizer(tmp: Path):
    """A word-level tokenizer over ``VOCAB`` tokens ``<pad>, <eos>, w2 .. w4095`` (offline, instant)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp / "tokenizer.json"
    tk.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), pad_token="<pad>", eos_token="<eos>")


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip


def build_policy(seed: int = SEED):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config()).eval()


def build_scalar_parts(seed: int):
    """(GPT-2 trunk, head weight (1, d)) of a scalar model: head N(0, 1/sqrt(d+1)), bias 0 (the spec)."""
    from transformers import GPT2Model

    torch.manual_seed(seed)
    trunk = GPT2Model(gpt2_config()).eval()
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(1, WIDTH, generator=g) / (WIDTH + 1) ** 0.5
    return trunk, head


def build_prompts(n_iters: int) -> torch.Tensor:
    """(n_iters * BATCH, PROMPT_LEN) prompt ids, no padding, never <pad>/<eos>."""
    g = torch.Generator().manual_seed(SEED + 100)
    return torch.randint(2, VOCAB, (n_iters * BATCH, PROMPT_LEN), generator=g)


# ----------------------------------------------------------------------------------------- FLOPs
def forward_flops(tokens: int, context: float, logit_positions: int, lm_head: bool = True) -> float:
    """Matmul FLOPs of one forward: trunk 24 L d^2 per token (qkv 3d^2, out d^2, MLP 8d^2, x2 for
    multiply-add), attention 4 L d per (query, key) pair, LM head 2 d V per position that needs logits."""
    trunk = 24 * LAYERS * WIDTH**2 * tokens
    attention = 4 * LAYERS * WIDTH * tokens * context
    head = 2 * WIDTH * VOCAB * logit_positions if lm_head else 0
    return trunk + attention + head


def phase_flops() -> dict[str, float]:
    B, P, R = BATCH, PROMPT_LEN, NEW_TOKENS
    T = P + R
    causal = (T + 1) / 2  # mean keys per query of a causal forward over T positions
    # generation: prefill B*P tokens (logits at the last position), then R-1 one-token steps
    gen = forward_flops(B * P, (P + 1) / 2, B) + sum(forward_flops(B, P + t + 1, B) for t in range(R - 1))
    # scoring: the reference (logits at R positions), critic and reward trunks (scalar heads ~ 0). The
    # rollout policy's own log-probs are not counted: the decode steps already computed those logits (a
    # system that runs a second policy forward for them, as TRL does, gets no credit for it)
    scoring = forward_flops(B * T, causal, B * R) + 2 * forward_flops(B * T, causal, 0, lm_head=False)
    # training: every epoch, actor and critic forward + backward (3x forward) over the whole rollout
    train = (
        EPOCHS * 3 * (forward_flops(B * T, causal, B * R) + forward_flops(B * T, causal, 0, lm_head=False))
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
    fl = phase_flops()
    total_flops = sum(fl.values())

    def med(k):
        return statistics.median(it[k] for it in iters)

    out = {
        "system": system,
        "iterations": len(iters),
        "median_s_per_iter": med("total"),
        "min_s_per_iter": min(it["total"] for it in iters),
        "median_generation_s": med("generation"),
        "median_scoring_s": med("scoring"),
        "median_train_s": med("train"),
        "generated_tokens_per_s": BATCH * NEW_TOKENS / med("generation"),
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
    from shifu.models import ScalarModel
    from shifu.rewards import RewardSource
    from shifu.trainers.common import OptimConfig
    from shifu.trainers.ppo import Config, PPOTrainer, new_value_head

    tmp = Path(tempfile.mkdtemp(prefix="shifu-bench-"))
    tok = build_tokenizer(tmp)
    actor, ref = build_policy(), build_policy()
    reward = _scalar_model(1, tok, ScalarModel)
    critic = None if fast else _scalar_model(2, tok, ScalarModel)
    cfg = Config(
        batch_size=BATCH, minibatch_size=MINIBATCH, ppo_epochs=EPOCHS, micro_batch_size=BATCH, seed=SEED,
        joint_optimizer=fast, bf16=fast and _bf16_supported(), optim=OptimConfig(lr=1e-5),
    )  # fmt: skip
    cfg.generation.max_new_tokens = NEW_TOKENS
    value_head = new_value_head(WIDTH, SEED) if fast else None
    trainer = PPOTrainer(actor, critic, ref, RewardSource(model=reward, policy_tokenizer=tok), tok, cfg,
                         value_head=value_head)  # fmt: skip
    trainer.params.stop_at_eos = False  # EOS disabled: every response has NEW_TOKENS tokens
    steps = [0]
    trainer.opt.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    prompts = build_prompts(warmup + n_iters)
    mask = torch.ones_like(prompts)
    peak_before = matmul_peak_gflops()
    iters = []
    for i in range(warmup + n_iters):
        rows = [{"prompt": ""} for _ in range(BATCH)]
        sl = slice(i * BATCH, (i + 1) * BATCH)
        t0 = time.perf_counter()
        m = trainer.step(prompts[sl], mask[sl], rows)
        total = time.perf_counter() - t0
        if i >= warmup:
            iters.append({"total": total, "generation": m["time/generation_s"], "scoring": m["time/scoring_s"],
                          "train": m["time/update_s"]})  # fmt: skip
    extra = {
        "optimizer_steps_per_iter": steps[0] // (warmup + n_iters),
        "mode": "fast (shared trunk%s)" % (", bf16" if cfg.bf16 else "") if fast else "fp32",
    }
    return summarise("shifu", iters, (peak_before, matmul_peak_gflops()), extra)


def _scalar_model(seed: int, tok, cls):
    trunk, head = build_scalar_parts(seed)
    model = cls(trunk, tok, seed=seed)
    with torch.no_grad():
        model.head.weight.copy_(head)
        model.head.bias.zero_()
    return model.eval()


def _bf16_supported() -> bool:
    # autocast bf16 on a CPU without native bf16 (avx512_bf16/AMX) is emulated and slower than fp32
    return bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)()) and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ) and "avx512_bf16" in Path("/proc/cpuinfo").read_text()  # fmt: skip


def generation_vs_hf(rounds: int = 3) -> dict:
    """Generation tokens/s of shifu's engine and of HF ``generate`` (sampling, no EOS), alternating."""
    from shifu.rollout import SamplingParams, generate

    model = build_policy()
    prompts = build_prompts(1)
    mask = torch.ones_like(prompts)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_at_eos=False)

    def ours():
        generate(model, prompts, mask, params, eos_token_id=1, pad_token_id=0)

    def hf():
        with torch.no_grad():
            model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)  # fmt: skip

    times: dict[str, list[float]] = {"shifu": [], "hf": []}
    ours(), hf()
    for _ in range(rounds):
        for name, fn in (("shifu", ours), ("hf", hf)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tps = {k: BATCH * NEW_TOKENS / statistics.median(v) for k, v in times.items()}
    return {
        "generation_tokens_per_s_shifu": tps["shifu"],
        "generation_tokens_per_s_hf_generate": tps["hf"],
        "generation_speedup_vs_hf": tps["shifu"] / tps["hf"],
    }


# ----------------------------------------------------------------------------------------- TRL
def run_trl(n_iters: int, warmup: int) -> dict:
    """TRL 1.12.0 PPO (trl.experimental.ppo) on the same models; runs inside the TRL virtualenv."""
    import warnings

    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import GPT2ForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tmp = Path(tempfile.mkdtemp(prefix="trl-bench-"))
    tok = build_tokenizer(tmp)

    def scalar(seed):
        trunk, head = build_scalar_parts(seed)
        cfg = gpt2_config()
        cfg.num_labels = 1
        m = GPT2ForSequenceClassification(cfg)
        m.transformer.load_state_dict(trunk.state_dict())
        with torch.no_grad():
            m.score.weight.copy_(head)
        return m.eval()

    n = warmup + n_iters
    data = Dataset.from_dict({"input_ids": build_prompts(n).tolist()})
    # TRL: rollout batch = per_device_train_batch_size * gradient_accumulation_steps = 32, split into
    # num_mini_batches = 4 minibatches of 8. Accelerate would step the optimiser only every 4th
    # minibatch (each minibatch is one micro-batch); gradient_accumulation_steps is reset to 1 on the
    # accelerator below so that TRL, like shifu, takes 16 optimiser steps of 8 sequences per iteration.
    args = PPOConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=8, gradient_accumulation_steps=4,
        num_mini_batches=4, num_ppo_epochs=EPOCHS, total_episodes=BATCH * n, response_length=NEW_TOKENS,
        stop_token=None, temperature=1.0, local_rollout_forward_batch_size=BATCH, learning_rate=1e-5,
        kl_coef=0.05, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95,
        num_sample_generations=0, report_to=[], save_strategy="no", logging_steps=10**6, use_cpu=True,
        bf16=False, fp16=False, seed=SEED, dataloader_num_workers=0, missing_eos_penalty=None,
    )  # fmt: skip
    trainer = PPOTrainer(args=args, processing_class=tok, model=build_policy(), ref_model=build_policy(),
                         reward_model=scalar(1), value_model=scalar(2), train_dataset=data)  # fmt: skip
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
    subprocess.run([*pip, torch_spec, "--index-url", "https://download.pytorch.org/whl/cpu"] if not wheels
                   else [*pip, torch_spec], check=True)  # fmt: skip
    subprocess.run([*pip, *TRL_SPEC], check=True)
    return py


def subprocess_run(python: str, system: str, n_iters: int, warmup: int, fast: bool = False) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--system", system, "--iters", str(n_iters),
           "--warmup", str(warmup)] + (["--fast"] if fast else [])  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{system} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="1 iteration, no warm-up (CI)")
    ap.add_argument("--iters", type=int, default=5, help="measured iterations")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up iterations (not measured)")
    ap.add_argument(
        "--fast", action="store_true", help="shifu's fast defaults: shared-trunk critic, bf16 if native"
    )
    ap.add_argument("--vs-trl", action="store_true", help="alternate shifu and TRL runs; print the ratio")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of shifu/TRL runs with --vs-trl")
    ap.add_argument("--no-gen-check", action="store_true", help="skip generation tokens/s vs HF generate")
    ap.add_argument("--system", choices=["shifu", "trl"], default="shifu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.short:
        args.iters, args.warmup, args.rounds = 1, 0, 1
    if args.system == "trl":
        print(json.dumps(run_trl(args.iters, args.warmup)), flush=True)
        return 0
    if not args.vs_trl:
        out = run_shifu(args.iters, args.warmup, args.fast)
        if not (args.short or args.no_gen_check):
            out.update(generation_vs_hf())
        print(json.dumps(out), flush=True)
        return 0
    trl_py = str(ensure_trl_venv())
    runs: dict[str, list[dict]] = {"shifu": [], "trl": [], "shifu_fast": []}
    for _ in range(args.rounds):
        runs["shifu"].append(subprocess_run(sys.executable, "shifu", args.iters, args.warmup))
        runs["trl"].append(subprocess_run(trl_py, "trl", args.iters, args.warmup))
        runs["shifu_fast"].append(subprocess_run(sys.executable, "shifu", args.iters, args.warmup, fast=True))
    for name, rs in runs.items():
        for r in rs:
            print(json.dumps({"run": name, **r}), flush=True)

    def med(name):
        return statistics.median(r["median_s_per_iter"] for r in runs[name])

    summary = {
        "shifu_median_s_per_iter": med("shifu"),
        "trl_median_s_per_iter": med("trl"),
        "shifu_fast_median_s_per_iter": med("shifu_fast"),
        "ratio_shifu_over_trl": med("shifu") / med("trl"),
        "throughput_fast_over_trl": med("trl") / med("shifu_fast"),
    }
    if not args.no_gen_check:
        summary.update(generation_vs_hf())
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

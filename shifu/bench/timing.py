"""``shifu bench``: time full PPO iterations of shifu on a fixed offline setup, one JSON line.

Setup (:mod:`shifu.bench.workload`): random GPT-2-style policy (4 layers, width 256, 4 heads, vocab
4096, tied embeddings), reward and value models of the same shape; 32 prompts x 16 tokens, 32 new tokens with
EOS disabled (every response has 32 tokens), 4 PPO epochs of minibatch 8 (16 optimiser steps per iteration),
fp32, 1 thread, 1 warm-up + 5 measured iterations.

    shifu bench              # shifu fp32 at the toy shape, and generation tokens/s against HF generate
    shifu bench --fast       # the fast settings: shared-trunk critic, bf16 where measured faster
    shifu bench --short      # 1 iteration, no warm-up, no generation check (CI: keeps it from rotting)

The cost curve: ``--shape toy|gpt2-12x512|smollm2-135m`` and ``--response-len N`` (random weights;
``--batch``/``--minibatch`` shrink the rollout at the large shapes). ``--eos-scale s`` scales the EOS row of
the tied embedding so that responses stop at EOS at varied lengths (then EOS is not disabled);
``--micro-batch-tokens N`` passes shifu's token-budget micro-batches.

A source checkout's ``benchmarks/ppo_iteration.py`` runs the same, and adds the comparisons that need it:
TRL on identical models in its own virtualenv (``--vs-trl``), token-budget A/B runs (``--budget-ab``) and
records with provenance (``--record``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from shifu.bench.workload import (
    SEED,
    Setup,
    build_policy,
    build_prompts,
    build_scalar_parts,
    build_tokenizer,
    matmul_peak_gflops,
    summarise,
)
from shifu.config.loader import read_shipped_table, shipped

# the shapes: shifu/presets/bench/shapes.yaml, each checked against Setup's fields
SHAPES: dict[str, Setup] = read_shipped_table(shipped("bench", "shapes.yaml"), Setup)


def run_shifu(s: Setup, n_iters: int, warmup: int, fast: bool) -> dict[str, Any]:
    """``warmup + n_iters`` PPO iterations on ``s`` (fp32, or the fast settings), summarised."""
    from shifu.parallel.threads import keep_freed_memory

    malloc = keep_freed_memory()  # as the shifu command does before any command (SHIFU_MALLOC=system: not)
    from shifu.config.schema import PPOConfig
    from shifu.config.sections import OptimConfig
    from shifu.config.sources import GenerationConfig
    from shifu.models.scalar import ScalarModel, new_value_head
    from shifu.parallel import build_strategy
    from shifu.rewards.sources import RewardSource
    from shifu.rollout.batch import PromptBatch
    from shifu.rollout.sources import SingleTurn
    from shifu.trainers import ppo, ppo_models

    tmp = Path(tempfile.mkdtemp(prefix="shifu-bench-"))
    tok = build_tokenizer(s, tmp)
    actor, ref = build_policy(s), build_policy(s)
    reward = _scalar_model(s, 1, tok, ScalarModel)
    critic = None if fast else _scalar_model(s, 2, tok, ScalarModel)
    cfg = PPOConfig(
        batch_size=s.batch,
        minibatch_size=s.minibatch,
        ppo_epochs=s.epochs,
        micro_batch_size=s.batch,
        seed=SEED,
        joint_optimizer=fast,
        bf16=fast,
        optim=OptimConfig(lr=1e-5),
        micro_batch_tokens=s.micro_batch_tokens,
        generation=GenerationConfig(max_new_tokens=s.new_tokens),
    )
    value_head = new_value_head(s.width, SEED) if fast else None
    strategy = build_strategy(cfg.distributed)
    strategy.launch("cpu")
    source = SingleTurn(RewardSource(model=reward, policy_tokenizer=tok))
    models = ppo_models.place(actor, critic, value_head, ref, source, reward, tok, cfg, strategy)
    state = ppo_models.PPOState.new(cfg, strategy)
    # EOS disabled (every response has s.new_tokens tokens) unless --eos-scale
    params = dataclasses.replace(ppo.sampling_params(cfg), stop_at_eos=bool(s.eos_scale))
    steps = [0]
    models.optimizers["actor"].optimizer.register_step_post_hook(
        lambda *a: steps.__setitem__(0, steps[0] + 1)
    )
    prompts = build_prompts(s, warmup + n_iters)
    mask = torch.ones_like(prompts)
    peak_before = matmul_peak_gflops()
    iters, lengths = [], []
    for i in range(warmup + n_iters):
        rows = [{"prompt": ""} for _ in range(s.batch)]
        sl = slice(i * s.batch, (i + 1) * s.batch)
        t0 = time.perf_counter()
        m = ppo.iteration(models, state, cfg, PromptBatch(prompts[sl], mask[sl], rows), params)
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
        + (f", micro_batch_tokens={s.micro_batch_tokens}" if s.micro_batch_tokens else ""),
        "bf16": dataclasses.asdict(p),  # decode, frozen, update, reward and the probe's reason
        "mean_response_len": statistics.mean(lengths),
        "malloc": malloc,
    }
    return summarise(s, "shifu", iters, (peak_before, matmul_peak_gflops()), extra)


def _scalar_model(s: Setup, seed: int, tok, cls):
    trunk, head = build_scalar_parts(s, seed)
    model = cls(trunk, tok, seed=seed)
    with torch.no_grad():
        model.head.weight.copy_(head)
        model.head.bias.zero_()
    return model.eval()


def generation_vs_hf(
    s: Setup, rounds: int = 3
) -> dict[str, float]:  # (EOS disabled whatever --eos-scale says)
    """Generation tokens/s of shifu's engine and of HF ``generate`` (sampling, no EOS), alternating; and of
    shifu's engine on the bf16 decode copy that the fast defaults generate with where the probe picks it
    (``shifu.parallel.precision.bf16_copy``: weights cast once), against the same fp32 HF ``generate``."""
    from shifu.generation.rollout import SamplingParams, generate
    from shifu.parallel.precision import bf16_copy

    model = build_policy(s)
    model16 = bf16_copy(model)
    prompts = build_prompts(s, 1)
    mask = torch.ones_like(prompts)
    params = SamplingParams(max_new_tokens=s.new_tokens, stop_at_eos=False)

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
                max_new_tokens=s.new_tokens,
                min_new_tokens=s.new_tokens,
                pad_token_id=0,
            )

    times: dict[str, list[float]] = {"shifu": [], "hf": [], "shifu_bf16": []}
    ours(), hf(), ours16()
    for _ in range(rounds):
        for name, fn in (("shifu", ours), ("hf", hf), ("shifu_bf16", ours16)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tps = {k: s.batch * s.new_tokens / statistics.median(v) for k, v in times.items()}
    return {
        "generation_tokens_per_s_shifu": tps["shifu"],
        "generation_tokens_per_s_hf_generate": tps["hf"],
        "generation_speedup_vs_hf": tps["shifu"] / tps["hf"],
        "generation_tokens_per_s_shifu_bf16_decode": tps["shifu_bf16"],
        "generation_speedup_bf16_decode_vs_hf": tps["shifu_bf16"] / tps["hf"],
    }


def parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The options of ``shifu bench`` (``benchmarks/ppo_iteration.py`` adds its comparisons to them)."""
    ap = argparse.ArgumentParser(
        prog="shifu bench", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--short", action="store_true", help="1 iteration, no warm-up (CI)")
    ap.add_argument("--iters", type=int, default=5, help="measured iterations")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up iterations (not measured)")
    ap.add_argument(
        "--fast",
        action="store_true",
        help="shifu's fast defaults: shared-trunk critic, bf16=true (bf16 only where the probe measures it faster)",
    )
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
    return ap


def setup_from(args: argparse.Namespace) -> Setup:
    """The :class:`Setup` the parsed options name: the shape's fields, then the rollout's."""
    return dataclasses.replace(
        SHAPES[args.shape],
        shape=args.shape,
        batch=args.batch,
        new_tokens=args.response_len,
        minibatch=args.minibatch,
        eos_scale=args.eos_scale,
        micro_batch_tokens=args.micro_batch_tokens,
    )


def single(s: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """One shifu run (and, unless ``--short`` or ``--no-gen-check``, the generation check), printed."""
    out = run_shifu(s, args.iters, args.warmup, args.fast)
    if not (args.short or args.no_gen_check):
        out.update(generation_vs_hf(s, args.gen_rounds))
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    if args.short:
        args.iters, args.warmup = 1, 0
    single(setup_from(args), args)
    return 0

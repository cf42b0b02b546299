"""The fixed offline setup that ``shifu bench`` times PPO iterations on, and what it counts.

A random policy of the chosen shape (:class:`Setup`; the shapes are ``shifu/presets/bench/shapes.yaml``), a
copy as the reference, reward model and critic as trunks of the same shape with a scalar head, prompts of
random token ids, all built from fixed seeds. This module imports only torch, transformers and tokenizers, so
that a peer system in its own virtualenv (TRL, ``benchmarks/ppo_iteration.py --vs-trl``) builds bit-identical
models from the same seeds.

FLOPs are counted analytically (the useful work, identical for every system): matmuls of the trunk, attention
scores and the LM head at the positions that need logits; backward = 2 x forward.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import torch

SEED = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """The benchmarked model shape and rollout (the defaults: the toy shape)."""

    shape: str = "toy"
    arch: Literal["gpt2", "llama"] = "gpt2"
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


# ----------------------------------------------------------------------------------------- models
def build_tokenizer(s: Setup, tmp: Path):
    """A word-level tokenizer over ``s.vocab`` tokens ``<pad>, <eos>, w2 ..`` (offline, instant)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, s.vocab)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp / "tokenizer.json"
    tk.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), pad_token="<pad>", eos_token="<eos>")


def model_config(s: Setup):
    """The HF config of ``s``'s shape (dropout off, EOS 1, pad 0, tied embeddings)."""
    if s.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=s.vocab,
            hidden_size=s.width,
            intermediate_size=s.intermediate,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
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
        vocab_size=s.vocab,
        n_positions=max(128, s.prompt_len + s.new_tokens),
        n_embd=s.width,
        n_layer=s.layers,
        n_head=s.heads,
        n_inner=s.intermediate,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )


def build_policy(s: Setup, seed: int = SEED):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(s)).eval()
    if s.eos_scale:  # a large EOS embedding (tied: also its logit row): responses end at varied lengths
        with torch.no_grad():
            model.get_input_embeddings().weight[1].mul_(s.eos_scale)
    return model


def build_scalar_parts(s: Setup, seed: int):
    """(trunk, head weight (1, d)) of a scalar model: head N(0, 1/sqrt(d+1)), bias 0 (the spec)."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    trunk = AutoModel.from_config(model_config(s)).eval()
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(1, s.width, generator=g) / (s.width + 1) ** 0.5
    return trunk, head


def build_prompts(s: Setup, n_iters: int) -> torch.Tensor:
    """(n_iters * s.batch, s.prompt_len) prompt ids, no padding, never <pad>/<eos>."""
    g = torch.Generator().manual_seed(SEED + 100)
    return torch.randint(2, s.vocab, (n_iters * s.batch, s.prompt_len), generator=g)


# ----------------------------------------------------------------------------------------- FLOPs
def trunk_params(s: Setup) -> int:
    """Weights of the trunk's matmuls per layer x layers (GPT-2: 12 d^2; Llama: q, o d^2, k, v d*d_kv, MLP 3 d f)."""
    d, f = s.width, s.intermediate
    if s.arch == "llama":
        kv = d * s.kv_heads // s.heads
        return s.layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    return s.layers * (4 * d * d + 2 * d * f)


def forward_flops(s: Setup, tokens: int, context: float, logit_positions: int, lm_head: bool = True) -> float:
    """Matmul FLOPs of one forward: trunk 2 x its matmul weights per token (GPT-2: 24 L d^2), attention
    4 L d per (query, key) pair, LM head 2 d V per position that needs logits."""
    trunk = 2 * trunk_params(s) * tokens
    attention = 4 * s.layers * s.width * tokens * context
    head = 2 * s.width * s.vocab * logit_positions if lm_head else 0
    return trunk + attention + head


def phase_flops(s: Setup, response_len: float | None = None) -> dict[str, float]:
    """FLOPs per phase at the full response length, or (EOS) at the measured mean ``response_len`` (the
    useful work: padding after EOS earns no credit)."""
    B, P = s.batch, s.prompt_len
    R = s.new_tokens if response_len is None else response_len
    T = P + R
    causal = (T + 1) / 2  # mean keys per query of a causal forward over T positions
    # generation: prefill B*P tokens (logits at the last position), then R-1 one-token steps
    gen = forward_flops(s, B * P, (P + 1) / 2, B) + sum(
        forward_flops(s, B, P + t + 1, B) for t in range(max(0, round(R) - 1))
    )
    # scoring: the reference (logits at R positions), critic and reward trunks (scalar heads ~ 0). The
    # rollout policy's own log-probs are not counted: the decode steps already computed those logits (a
    # system that runs a second policy forward for them, as TRL does, gets no credit for it)
    scoring = forward_flops(s, B * T, causal, B * R) + 2 * forward_flops(s, B * T, causal, 0, lm_head=False)
    # training: every epoch, actor and critic forward + backward (3x forward) over the whole rollout
    train = (
        s.epochs
        * 3
        * (forward_flops(s, B * T, causal, B * R) + forward_flops(s, B * T, causal, 0, lm_head=False))
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


def summarise(
    s: Setup, system: str, iters: list[dict], peaks: tuple[float, float], extra: dict[str, Any]
) -> dict[str, Any]:
    """One JSON-able dict from per-iteration {total, generation, scoring, train} seconds.

    ``peaks``: the GEMM peak read before and after the iterations. MFU divides by the higher one (the
    machine's speed drifts on a VM; one reading taken in a slow moment made MFU read above 1)."""
    peak = max(peaks)
    fl = phase_flops(s, extra.get("mean_response_len") if s.eos_scale else None)
    total_flops = sum(fl.values())

    def med(k):
        return statistics.median(it[k] for it in iters)

    out = {
        "system": system,
        "setup": dataclasses.asdict(s),
        "iterations": len(iters),
        "median_s_per_iter": med("total"),
        "min_s_per_iter": min(it["total"] for it in iters),
        "median_generation_s": med("generation"),
        "median_scoring_s": med("scoring"),
        "median_train_s": med("train"),
        "generated_tokens_per_s": s.batch * extra.get("mean_response_len", s.new_tokens) / med("generation"),
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

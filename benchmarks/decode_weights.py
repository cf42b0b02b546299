"""How fast can one decode step read SmolLM2-135M's weights? fp32, bf16 and int8 weight-only linears.

At the 135M shape with 128-token responses shifu's decode reaches 1.0-1.25x HF ``generate`` in fp32 and
1.8-2.6x with its bf16 decode copy (docs/benchmarks/throughput.md). At a few rows per
step a decode linear is a matrix-vector product that reads every weight once, so its time is set by the bytes
it reads. This measures, one thread, each linear of one decode step at the SmolLM2-135M shape (per layer:
fused q/k/v 576 -> 960, o 576 -> 576, fused gate/up 576 -> 3072, down 1536 -> 576; 30 layers; the tied
lm_head 576 -> 49152) with the weight held

- in fp32 (``F.linear``), what HF ``generate`` and shifu's fp32 decode run;
- in bf16 (``F.linear`` on bf16 input and weight), shifu's bf16 decode copy;
- in int8 with one fp32 scale per output row (``torch._weight_int8pack_mm``, bf16 activations; torch's
  weight-only int8 kernel, the one gpt-fast-style quantised decoding uses),

and prints, per row count, one JSON line: milliseconds per decode step for each (30 x the layer's linears +
the head), the ratio to fp32, and the effective read bandwidth. Attention over the cache, norms and
sampling are not included (they are the same for all three). Each linear is timed alone, so its weight is
read from cache where it fits (a real step streams all 30 layers from memory: slower).

``--generation``: whole generations instead (the random-weight SmolLM2-135M policy of ``shifu bench``,
:mod:`shifu.bench.workload`; 128 new tokens, sampling, fp32), alternating shifu's decoder with the
output embedding read as ``F.linear(h, W)``, shifu's decoder with it read as ``(W @ h^T)^T`` (the two orders
:func:`shifu.generation.decode.head_product` chooses between) and HF ``generate``; one JSON line per row count::

    python benchmarks/decode_weights.py                 # rows 4 and 16
    python benchmarks/decode_weights.py --rows 1 4 --repeats 100
    python benchmarks/decode_weights.py --generation --rows 4 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from shifu.parallel.precision import machine_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

LAYER = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD, N_LAYER = (576, 49152), 30


def per_call_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):  # best of three timed blocks: a busy neighbour inflates one, rarely all
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats * 1e3)
    return best


def step(rows: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ms = {"fp32": 0.0, "bf16": 0.0, "int8": 0.0}
    nbytes = {"fp32": 0, "bf16": 0, "int8": 0}
    for name, (k, n) in [*LAYER.items(), ("lm_head", HEAD)]:
        w = torch.randn(n, k, generator=g) * k**-0.5
        x = torch.randn(rows, k, generator=g)
        w16, x16 = w.bfloat16(), x.bfloat16()
        scale = w.abs().amax(dim=1) / 127
        w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        s16 = scale.bfloat16()
        times = {
            "fp32": per_call_ms(lambda x=x, w=w: F.linear(x, w), repeats),
            "bf16": per_call_ms(lambda x=x16, w=w16: F.linear(x, w), repeats),
            "int8": per_call_ms(lambda x=x16, w=w8, s=s16: torch._weight_int8pack_mm(x, w, s), repeats),
        }
        count = 1 if name == "lm_head" else N_LAYER
        for kind, t in times.items():
            ms[kind] += count * t
            nbytes[kind] += count * n * k * {"fp32": 4, "bf16": 2, "int8": 1}[kind]
    return {
        "rows": rows,
        "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
        "speedup_vs_fp32": {k: round(ms["fp32"] / v, 2) for k, v in ms.items()},
        "read_gb_per_s": {k: round(nbytes[k] / ms[k] / 1e6, 1) for k in ms},
        "machine": machine_key(torch.device("cpu")),
    }


def generation(rows: int, rounds: int = 3) -> dict:
    """Seconds per generation of shifu's decoder with each head order, and of HF ``generate``."""
    import dataclasses

    import shifu.generation.decode as dec
    from shifu.bench.timing import SHAPES
    from shifu.bench.workload import build_policy, build_prompts
    from shifu.generation.rollout import SamplingParams, generate

    setup = dataclasses.replace(SHAPES["smollm2-135m"], shape="smollm2-135m", batch=rows, new_tokens=128)
    model = build_policy(setup)
    prompts = build_prompts(setup, 1)
    mask = torch.ones_like(prompts)
    params = SamplingParams(max_new_tokens=128, stop_at_eos=False)

    def ours():
        generate(model, prompts, mask, params, eos_token_id=1, pad_token_id=0)

    def hf():
        with torch.no_grad():
            model.generate(
                input_ids=prompts,
                attention_mask=mask,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                max_new_tokens=128,
                min_new_tokens=128,
                pad_token_id=0,
            )

    ours(), hf()  # warm-up; the first also runs (or reads) the head probe
    name = next(k for k in dec._HEAD_LAYOUTS if k.startswith(f"decode head {rows}x"))
    chosen = dec._HEAD_LAYOUTS[name]
    times: dict[str, list[float]] = {"plain": [], "left": [], "hf": []}
    for _ in range(rounds):
        for kind in times:
            dec._HEAD_LAYOUTS[name] = kind == "left"
            t0 = time.perf_counter()
            hf() if kind == "hf" else ours()
            times[kind].append(round(time.perf_counter() - t0, 3))
    dec._HEAD_LAYOUTS[name] = chosen
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rows": rows,
        "seconds": times,
        "speedup_vs_hf": {k: round(med["hf"] / med[k], 3) for k in ("plain", "left")},
        "left_over_plain_speed": round(med["plain"] / med["left"], 3),
        "probe_chose": "left" if chosen else "plain",
        "machine": machine_key(torch.device("cpu")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16], help="sequences decoded together")
    ap.add_argument("--repeats", type=int, default=30, help="calls per timed block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--generation", action="store_true", help="whole generations: head orders vs HF generate")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        out = generation(rows) if args.generation else step(rows, args.repeats)
        print(json.dumps(out), flush=True)
        params = {
            "mode": "generation" if args.generation else "step",
            "rows": rows,
            "model": "SmolLM2-135M shape",
            **({} if args.generation else {"repeats": args.repeats}),
        }
        provenance.record(
            args,
            "decode_weights",
            {k: v for k, v in out.items() if k != "rows"},
            params=params,
            config=params,
        )


if __name__ == "__main__":
    main()

"""Load on `shifu serve`: N concurrent clients on loopback against in-process scoring of the same batches.

Setup: a GPT-2-style reward model (4 layers, width 256, 4 heads, vocab 4096; the shape of
benchmarks/ppo_iteration.py's reward model), random weights, saved to a temporary directory and served by
the real command (``python -m shifu serve DIR --port 0 --threads 1``) in its own process on 127.0.0.1.
Each request is one rollout micro-batch in token ids (``--rows`` rows of 16 prompt + 32 response tokens;
the token path PPO takes when the reward model shares the policy's tokenizer), sent by ``RemoteReward``.
Each of ``--clients`` threads sends requests back to back for ``--seconds`` (at most ``--max-requests``
each). The in-process line scores the same batches one after another with ``RewardSource`` (one thread).

Prints two JSON lines per configuration: the in-process run measured just before it (the machine's load
drifts), then the served run: rows/s, requests/s, latency p50/p99 (ms) per request, the ratio to the
in-process rows/s, rows per forward (the server's merging), and the largest score difference from
in-process on the same batch.

    python benchmarks/serve_load.py                          # clients 1 4 16, merged and --exact servers
    python benchmarks/serve_load.py --clients 8 --seconds 5 --modes merged
    python benchmarks/serve_load.py --short                  # CI-sized: 2 clients, 1 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import provenance  # noqa: E402  (benchmarks/provenance.py: this script's own folder is on sys.path)
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, WIDTH, LAYERS, HEADS = 4096, 256, 4, 4
PROMPT_LEN, RESPONSE_LEN = 16, 32
N_BATCHES = 64  # distinct batches, cycled through by every client


def build_reward_model(path: Path) -> Path:
    """A random ScalarModel on a GPT-2 trunk with a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    from shifu.models.scalar import ScalarModel

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=128,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    ScalarModel(GPT2Model(cfg), tok, seed=0).save_pretrained(path)
    return path


def build_batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``N_BATCHES`` rollout-shaped (rows, 48) id batches: full prompts, responses of 8..32 tokens
    ending in EOS and right-padded (the token layout of a PPO rollout)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(N_BATCHES):
        ids = torch.randint(2, VOCAB, (rows, PROMPT_LEN + RESPONSE_LEN), generator=g)
        mask = torch.ones_like(ids)
        lengths = torch.randint(8, RESPONSE_LEN + 1, (rows,), generator=g)
        for i, n in enumerate(lengths.tolist()):
            ids[i, PROMPT_LEN + n - 1] = 1  # EOS
            ids[i, PROMPT_LEN + n :] = 0
            mask[i, PROMPT_LEN + n :] = 0
        out.append((ids, mask))
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def reward_source(model_dir: Path, rows: int):
    """The trainer's in-process scorer of the same model (token path, micro-batches of ``rows``)."""
    from shifu.models.loading import fuse_tanh_gelu
    from shifu.rewards.ensemble import load_reward
    from shifu.rewards.sources import RewardSource

    model = fuse_tanh_gelu(load_reward(model_dir))  # as the server and the PPO trainer hold it
    return RewardSource(model=model, policy_tokenizer=model.tokenizer, micro_batch=rows)


def in_process(source, batches, seconds: float, max_requests: int) -> dict:
    """Score the batches one after another with ``source`` (a RewardSource), as a trainer does."""
    source([""] * batches[0][0].shape[0], [""] * batches[0][0].shape[0], [], *batches[0])  # warm-up
    lat, rows, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and len(lat) < max_requests:
        ids, mask = batches[len(lat) % len(batches)]
        t = time.perf_counter()
        source([""] * ids.shape[0], [""] * ids.shape[0], [], ids, mask)
        lat.append(time.perf_counter() - t)
        rows += ids.shape[0]
    wall = time.perf_counter() - t0
    return summary("in_process", 1, lat, rows, wall) | {"errors": 0}


def summary(mode: str, clients: int, lat: list[float], rows: int, wall: float) -> dict:
    return {
        "mode": mode,
        "clients": clients,
        "requests": len(lat),
        "rows": rows,
        "seconds": round(wall, 2),
        "rows_per_s": round(rows / wall, 1),
        "requests_per_s": round(len(lat) / wall, 1),
        "p50_ms": round(1000 * statistics.median(lat), 2),
        "p99_ms": round(1000 * percentile(lat, 99), 2),
    }


def start_server(model_dir: Path, exact: bool) -> tuple[subprocess.Popen, str]:
    """The real `shifu serve` command on 127.0.0.1, any free port; returns (process, url)."""
    cmd = [sys.executable, "-m", "shifu", "serve", str(model_dir), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--threads", "1", "--log-level", "warning"] + (["--exact"] if exact else [])
    env = os.environ | {"SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("SHIFU_SERVE_TOKEN", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"shifu serve did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0]


def served(url: str, mode: str, batches, clients: int, seconds: float, max_requests: int, reference) -> dict:
    """``clients`` threads, each with its own RemoteReward, sending batches back to back."""
    from shifu.rewards.remote import RemoteReward

    tokenizer = reference.model.tokenizer
    remotes = [
        RemoteReward(url, tokenizer, batch_size=batches[0][0].shape[0], max_in_flight=1)
        for _ in range(clients)
    ]
    assert all(r.token_path for r in remotes), "the served model should take token ids"
    ids, mask = batches[0]
    n = ids.shape[0]
    diff = (
        (remotes[0]([""] * n, [""] * n, [], ids, mask) - reference([""] * n, [""] * n, [], ids, mask))
        .abs()
        .max()
    )
    before = remotes[0].health()
    lat: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    start = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        i = k
        while time.perf_counter() - t0 < seconds and len(lat[k]) < max_requests:
            ids, mask = batches[i % len(batches)]
            t = time.perf_counter()
            try:
                remotes[k]([""] * ids.shape[0], [""] * ids.shape[0], [], ids, mask)
            except Exception:  # counted, not raised: a benchmark reports what failed
                errors[k] += 1
            lat[k].append(time.perf_counter() - t)
            i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = remotes[0].health()
    for r in remotes:
        r.close()
    all_lat = [x for per in lat for x in per]
    forwards = after["forwards"] - before["forwards"]
    rows = sum(len(per) for per in lat) * n
    return summary(mode, clients, all_lat, rows, wall) | {
        "errors": sum(errors),
        "rows_per_forward": round((after["rows"] - before["rows"]) / max(forwards, 1), 1),
        "max_abs_diff_vs_in_process": float(diff),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients per run")
    p.add_argument("--modes", nargs="+", default=["merged", "exact"], choices=["merged", "exact"])
    p.add_argument("--rows", type=int, default=8, help="rows per request (one rollout micro-batch)")
    p.add_argument("--seconds", type=float, default=8.0, help="duration of each configuration")
    p.add_argument("--max-requests", type=int, default=5000, help="requests per client, at most")
    p.add_argument("--short", action="store_true", help="2 clients, 1 s, merged only (keeps it from rotting)")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    if args.short:
        args.clients, args.seconds, args.modes = [2], 1.0, ["merged"]
    torch.set_num_threads(1)
    batches = build_batches(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_reward_model(Path(tmp) / "rm")
        reference = reward_source(model_dir, args.rows)
        for mode in args.modes:
            proc, url = start_server(model_dir, exact=mode == "exact")
            try:
                for clients in args.clients:
                    base = in_process(reference, batches, args.seconds, args.max_requests)
                    print(json.dumps(base), flush=True)
                    row = served(url, mode, batches, clients, args.seconds, args.max_requests, reference)
                    row["ratio_vs_in_process"] = round(row["rows_per_s"] / base["rows_per_s"], 3)
                    print(json.dumps(row), flush=True)
                    params = {
                        "mode": mode,
                        "clients": clients,
                        "rows": args.rows,
                        "seconds": args.seconds,
                        "max_requests": args.max_requests,
                        "model": f"gpt2 {LAYERS}x{WIDTH}, vocab {VOCAB}",
                    }
                    metrics = {k: v for k, v in row.items() if k not in ("mode", "clients")}
                    metrics |= {"in_process_rows_per_s": base["rows_per_s"], "in_process": base}
                    provenance.record(args, "serve_load", metrics, params=params, config=params, threads=1)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

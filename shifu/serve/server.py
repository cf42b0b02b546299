"""``shifu serve SOURCE``: a reward model, an ensemble or a rule reward over HTTP (Starlette on uvicorn);
``shifu serve --policy MODEL``: a policy behind an OpenAI-compatible endpoint (:mod:`shifu.serve.policy`).

SOURCE is what ``shifu ppo`` takes in process: a reward model directory (one ``shifu rm`` model, an
ensemble directory, or a run directory with ``final/``; loaded by :func:`shifu.rewards.ensemble.load_reward`) or
a rule reward ``package.module:function`` (:func:`shifu.rewards.sources.load_function`). Endpoints, all JSON
(guide in docs/how-to/reward-service.md; the API as an OpenAPI 3.1 document in openapi.json):

    GET  /health        {"status": "ok", "kind", "requests", "forwards", "rows", "pending"}  (no token)
    GET  /openapi.json  the API, with the served model's limits filled in  (no token)
    GET  /v1/metadata   kind, source, tokenizer fingerprint, normalisation, max_length, max_positions,
                        vocab_rows, ensemble, limits, version
    POST /v1/score      {"prompts", "responses", "rows"?} or {"input_ids", "attention_mask"}
                        -> {"scores": [...]}; from a process reward {"scores", "steps": [[[end, r], ...], ...]}
                        (shifu's steps format) or {"token_scores": [[...], ...]} (one value per element)

The wing: :mod:`shifu.serve.validation` (requests, refused with a 4xx naming the field),
:mod:`shifu.serve.served` (what is scored), :mod:`shifu.serve.batcher` (the queue and its forwards),
:mod:`shifu.serve.app` (the Starlette app), and this module (the command).

**Batching.** One asyncio task (:class:`shifu.serve.batcher.Batcher`) runs the scoring on one thread, one forward at a time,
while the event loop keeps accepting requests; the requests that arrived during a forward are merged
into the next one, right-padded to one width, up to ``--max-batch-tokens`` (rows x width). Merged scores
equal in-process :class:`shifu.rewards.sources.RewardSource` scores up to float32 summation order (a row's
result depends on its place in the batch in the last bit; tests/test_serve.py bounds the difference by
1e-5 relative). ``--exact`` scores each request in its own forward exactly as sent: a client sending one
of the trainer's micro-batches per request (text is padded per request, as ``score_texts`` pads per
micro-batch) then gets the in-process scores bit for bit. Reward functions are called once per request,
in arrival order, on the same thread.

**Safety.** Binds 127.0.0.1 by default; any other address needs a bearer token (``--token`` or
``SHIFU_SERVE_TOKEN``). Bodies are capped (``--max-body-bytes``, 413) and must arrive within
``--body-timeout`` seconds (408), so a slow client holds one connection, never the server. Every refused
request gets a JSON error ``{"error": {"status", "field", "message"}}`` naming what to fix; a bad request
(bodies that are not strict RFC 8259 JSON, wrong types, ids beyond the vocabulary or rows beyond the
model's positions, wrong content types, oversized or deeply nested bodies) is always a 4xx, never a 5xx
(tests/test_serve_api.py fuzzes the API to hold it). A 500 means the served reward function failed.
"""

from __future__ import annotations

import argparse
import os

from shifu.errors import ConfigError
from shifu.http.runner import (
    bind_socket,
    check_exposure,
    is_loopback,
    require_uvicorn,
    serve_forever,
    socket_url,
)
from shifu.rewards.remote import TOKEN_ENV
from shifu.serve.app import create_app
from shifu.serve.served import load_served

__all__ = ["bind_socket", "build_parser", "is_loopback", "main", "socket_url"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shifu serve",
        description="serve a reward model, an ensemble or a rule reward over HTTP "
        "(docs/how-to/reward-service.md)",
    )
    p.add_argument(
        "source",
        nargs="?",
        metavar="RM_DIR|module:function",
        help="reward model/ensemble/run directory, or a rule reward (or --policy)",
    )
    p.add_argument(
        "--policy",
        metavar="MODEL",
        default=None,
        help="serve a policy instead (a run directory with final/, or an HF model directory) on an "
        "OpenAI-compatible /v1/chat/completions (docs/how-to/policy-endpoint.md)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback; others need a token)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    p.add_argument(
        "--token",
        default=None,
        help=f"bearer token clients must send (default: ${TOKEN_ENV}; none: no check)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="rows x padded width merged into one forward (default 16384; with --policy: rows x (prompt + "
        "budget) of one sampler call, default 65536)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=16 * 2**20, help="largest request body accepted (413 above)"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive (408)"
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="one forward per request as sent (no merging): scores equal in-process ones bit for bit",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device of the reward model (cpu, cuda, cuda:1, ...)"
    )
    p.add_argument(
        "--aggregate",
        default=None,
        help="override an ensemble's aggregation: mean, median, min, mean_minus_std",
    )
    p.add_argument(
        "--std-coef", type=float, default=None, help="override an ensemble's std_coef (mean_minus_std)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: SHIFU_THREADS or torch's)"
    )
    from shifu.serve.policy import add_policy_arguments

    add_policy_arguments(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--access-log", action="store_true", help="log every request (off: it costs time under load)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.source is None) == (args.policy is None):
        raise ConfigError(
            "shifu serve takes a reward model or function (SOURCE) or a policy (--policy MODEL): give one"
        )
    token = args.token if args.token is not None else (os.environ.get(TOKEN_ENV) or None)
    check_exposure(args.host, token, "the policy" if args.policy else "the reward model", TOKEN_ENV)
    if args.max_batch_tokens is None:
        args.max_batch_tokens = 65536 if args.policy else 16384
    for name in ("max_batch_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.body_timeout <= 0 or not 0 <= args.port < 65536:
        raise ConfigError(
            f"need --body-timeout > 0 and 0 <= --port < 65536; got {args.body_timeout}, {args.port}"
        )
    require_uvicorn()
    from shifu.parallel.threads import set_threads

    set_threads(args.threads)
    if args.policy is not None:
        from shifu.serve.policy import serve_policy

        return serve_policy(args, token)
    served = load_served(args.source, args.device, args.aggregate, args.std_coef)
    app = create_app(served, token, args.max_batch_tokens, args.max_body_bytes, args.body_timeout, args.exact)
    sock = bind_socket(args.host, args.port)
    print(
        f"shifu serve: {served.kind} {served.source} on {socket_url(sock)} "
        f"(token {'required' if token else 'off'}; stop with Ctrl-C)",
        flush=True,
    )
    serve_forever(app, sock, args.log_level, args.access_log)
    return 0

"""``shifu serve --policy MODEL``: a trained policy behind the OpenAI-compatible gateway
(:class:`shifu.gateway.Gateway`), on the same server stack as the reward service.

MODEL is what ``shifu sample`` takes (:func:`shifu.runs.files.resolve_policy`): a run directory of any
policy stage (its ``final/``; a quickstart run's last policy) or a local Hugging Face causal-LM directory.
Every prompt goes through the model's chat template (``--chat-template FILE`` for a tokenizer without one).
Requests sample at their own ``temperature`` / ``top_p`` / ``seed`` (defaults: ``--temperature``,
``--top-p``), with ``--top-k`` for all, at most ``--max-tokens`` tokens a completion. Guide:
docs/how-to/policy-endpoint.md; the API: ``GET /openapi.json`` (shifu/gateway/openapi.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shifu.errors import ConfigError

# the defaults of --prefix-cache-mb and --kv-budget-mb: with SmolLM2-135M's 540 MB of weights, 32 agent sessions
# peak under 2.5 GB (docs/how-to/policy-endpoint.md)
PREFIX_CACHE_MB, KV_BUDGET_MB = 256, 512


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``shifu serve --policy`` (ignored when serving a reward)."""
    g = p.add_argument_group("with --policy")
    g.add_argument("--name", default="policy", help="the model name clients send (default: policy)")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens of one completion (default 256)")
    g.add_argument("--temperature", type=float, default=1.0, help="default temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="default nucleus mass (1.0: off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--max-batch-rows", type=int, default=64, help="most rows of one sampler call")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler's generator")
    g.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=PREFIX_CACHE_MB,
        help="keys and values of earlier calls kept for prefix reuse, least recently used evicted (default "
        f"{PREFIX_CACHE_MB}; 0: off)",
    )
    g.add_argument(
        "--kv-budget-mb",
        type=float,
        default=KV_BUDGET_MB,
        help=f"keys and values of the requests decoding at once, in blocks (default {KV_BUDGET_MB}); a request "
        "that does not fit beside the running ones waits, one bigger than the budget is refused",
    )
    g.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file")


def load_gateway(args: argparse.Namespace, token: str | None):
    """The gateway of ``args.policy`` (resolved like ``shifu sample``), loaded on ``args.device``."""
    from shifu.gateway import Gateway, Sampling
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.runs.files import resolve_policy

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.max_tokens)
    if (
        sampling.temperature < 0
        or sampling.top_k < 0
        or not 0 < sampling.top_p <= 1
        or sampling.max_tokens < 1
    ):
        raise ConfigError(
            "need --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1 and --max-tokens >= 1; got "
            f"{args.temperature}, {args.top_k}, {args.top_p}, {args.max_tokens}"
        )
    if args.max_batch_rows < 1:
        raise ConfigError(f"--max-batch-rows must be >= 1, got {args.max_batch_rows}")
    if args.prefix_cache_mb < 0:
        raise ConfigError(f"--prefix-cache-mb must be >= 0 (0: no prefix reuse), got {args.prefix_cache_mb}")
    if not args.kv_budget_mb > 0:
        raise ConfigError(f"--kv-budget-mb must be > 0, got {args.kv_budget_mb}")
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template {path}: no such file; give a Jinja chat template file")
        template = path.read_text(encoding="utf-8")
    policy_dir = resolve_policy(args.policy, reward_as="SOURCE (shifu serve RM_DIR)", policy_as="--policy")
    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).to(args.device).eval()
    return Gateway(
        model,
        tok,
        name=args.name,
        token=token,
        sampling=sampling,
        max_batch_rows=args.max_batch_rows,
        max_batch_tokens=args.max_batch_tokens,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        seed=args.seed,
        chat_template=template,
        prefix_cache_mb=args.prefix_cache_mb,
        kv_budget_mb=args.kv_budget_mb,
    ), policy_dir


def serve_policy(args: argparse.Namespace, token: str | None) -> int:
    """Run the gateway of ``args.policy`` in the foreground until interrupted."""
    from shifu.http.runner import bind_socket, serve_forever, socket_url
    from shifu.parallel.threads import return_freed_memory

    return_freed_memory()  # memory that follows the requests held, not their high-water mark
    gateway, policy_dir = load_gateway(args, token)
    sock = bind_socket(args.host, args.port)
    print(
        f"shifu serve: policy {policy_dir} as {args.name!r} on {socket_url(sock)}/v1 "
        f"(token {'required' if token else 'off'}; stop with Ctrl-C)",
        flush=True,
    )
    serve_forever(gateway.app(), sock, args.log_level, args.access_log)
    return 0

"""How many positions a model holds: the one answer every caller asks for (the sampler, the episode and agent
sources, the gateway, evaluation, the trainers' length checks, served reward models)."""

from __future__ import annotations

from typing import Any


def position_limit(model: Any) -> int | None:
    """The most positions one row of ``model`` may use, as its config states them: GPT-2's ``n_positions``, else
    ``max_position_embeddings`` (past it a model with learned positions has no embedding, and a rotary one was
    never trained); read through a scalar model's ``backbone``, and for an ensemble (``members``) its smallest
    member's. None when the config states none."""
    members = getattr(model, "members", None)
    if members is not None:
        found = [n for m in members if (n := position_limit(m)) is not None]
        return min(found) if found else None
    config = getattr(getattr(model, "backbone", model), "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        n = getattr(config, name, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None

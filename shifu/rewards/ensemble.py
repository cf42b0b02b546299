"""Reward-model ensembles and the one loader for any trained reward model: :func:`load_reward`.

An ensemble directory holds ``ensemble.json``::

    {"kind": "ensemble", "members": ["../member-0/final", ...], "aggregate": "mean", "std_coef": 1.0}

(member paths relative to that file). ``load_reward`` turns it, or a single ``ScalarModel`` directory, or
a run directory holding either in ``final/``, into an object with ``score_texts(prompts, responses)`` and
``score(input_ids, attention_mask)``.

Aggregation over K member scores ``s`` (K, N), each member already normalised by its own gain/bias:
``mean``; ``median`` (the mean of the two middle scores when K is even); ``min``; ``mean_minus_std``
= ``mean - std_coef * std`` with the population std (divisor K), penalising what the judges disagree on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shifu.errors import ConfigError, ShifuError
from shifu.models.scalar import META_FILE, ScalarModel

ENSEMBLE_FILE = "ensemble.json"
AGGREGATIONS = ("mean", "median", "min", "mean_minus_std")


def aggregate(scores: torch.Tensor, how: str = "mean", std_coef: float = 1.0) -> torch.Tensor:
    """(K, N) member scores -> (N,) ensemble score (see the module docstring for each rule)."""
    if how == "mean":
        return scores.mean(0)
    if how == "median":
        return scores.quantile(0.5, dim=0)  # linear interpolation: mean of the middle two for even K
    if how == "min":
        return scores.min(0).values
    if how == "mean_minus_std":
        return scores.mean(0) - std_coef * scores.std(0, correction=0)
    raise ConfigError(f"unknown ensemble aggregation '{how}'; use one of {', '.join(AGGREGATIONS)}")


class RewardEnsemble(nn.Module):
    """K scalar reward models scored together and aggregated; same scoring API as ``ScalarModel``."""

    def __init__(self, members: list[ScalarModel], how: str = "mean", std_coef: float = 1.0):
        super().__init__()
        if how not in AGGREGATIONS:
            raise ConfigError(f"unknown ensemble aggregation '{how}'; use one of {', '.join(AGGREGATIONS)}")
        self.members = nn.ModuleList(members)
        self.how, self.std_coef = how, std_coef

    @property
    def tokenizer(self):
        return self.members[0].tokenizer

    @property
    def is_causal(self) -> bool:
        return self.members[0].is_causal

    def encode(
        self, prompts: list[str], responses: list[str], max_length: int = 512
    ) -> dict[str, torch.Tensor]:
        """Token ids for :meth:`score` (all members must share a tokenizer; otherwise use score_texts)."""
        return self.members[0].encode(prompts, responses, max_length)

    def text_length(self, max_length: int) -> int:
        """``max_length`` capped at the shortest member's positions."""
        return min(m.text_length(max_length) for m in self.members)

    def member_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(K, B) each member's normalised score of the same token ids."""
        return torch.stack([m.score(input_ids, attention_mask) for m in self.members])

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) aggregated score of right- or left-padded token ids."""
        return aggregate(self.member_scores(input_ids, attention_mask), self.how, self.std_coef)

    @torch.no_grad()
    def score_texts(
        self, prompts: list[str], responses: list[str], batch_size: int = 32, max_length: int = 512
    ) -> torch.Tensor:
        """(N,) aggregated score of text pairs; each member tokenises with its own tokenizer."""
        per_member = [m.score_texts(prompts, responses, batch_size, max_length) for m in self.members]
        return aggregate(torch.stack(per_member), self.how, self.std_coef)


def write_manifest(path: str | Path, member_dirs: list[str | Path], how: str, std_coef: float) -> Path:
    """Write ``path/ensemble.json`` listing ``member_dirs`` (stored relative to ``path``)."""
    import os

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    rel = [os.path.relpath(Path(m).resolve(), d.resolve()) for m in member_dirs]
    manifest = {"kind": "ensemble", "members": rel, "aggregate": how, "std_coef": std_coef}
    (d / ENSEMBLE_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return d / ENSEMBLE_FILE


def load_reward(
    path: str | Path, aggregate_how: str | None = None, std_coef: float | None = None
) -> ScalarModel | RewardEnsemble:
    """Load a trained reward model: a ScalarModel dir, an ensemble dir, or a run dir with ``final/``.

    ``aggregate_how`` / ``std_coef`` override an ensemble's stored aggregation. The result is in eval
    mode; both types offer ``score_texts``, ``score``, ``encode`` and ``tokenizer``.
    """
    p = Path(path)
    if not p.exists():
        raise ShifuError(
            f"reward model directory '{path}' does not exist; give a `shifu rm` run directory, its final/, "
            "or an ensemble directory (shifu never downloads from a hub)"
        )
    if not (p / ENSEMBLE_FILE).exists() and not (p / META_FILE).exists() and (p / "final").is_dir():
        p = p / "final"
    if (p / ENSEMBLE_FILE).exists():
        from shifu.models.loading import read_json_file

        manifest = read_json_file(
            p / ENSEMBLE_FILE, "ensemble manifest", "train the ensemble again or restore a copy"
        )
        names = manifest.get("members") if isinstance(manifest, dict) else None
        if not (isinstance(names, list) and names and all(isinstance(m, str) for m in names)):
            raise ShifuError(
                f"ensemble manifest '{p / ENSEMBLE_FILE}': 'members' must be a non-empty list of member "
                "directory names; train the ensemble again or restore a copy"
            )
        members = [ScalarModel.from_pretrained(p / m) for m in names]
        how = aggregate_how or manifest.get("aggregate", "mean")
        k = std_coef if std_coef is not None else manifest.get("std_coef", 1.0)
        return RewardEnsemble(members, how, k).eval()
    if (p / META_FILE).exists():
        return ScalarModel.from_pretrained(p).eval()
    raise ShifuError(
        f"'{path}' is not a reward model: expected {META_FILE} (one model) or {ENSEMBLE_FILE} (an ensemble), "
        "or a `shifu rm` run directory with final/"
    )

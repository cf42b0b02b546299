"""What one ``shifu serve`` scores (:class:`Served`): a reward model, an ensemble or a reward function, loaded
from the command's SOURCE (:func:`load_served`), with its ``/v1/metadata`` description and its limits (the
vocabulary rows token ids must stay below, the positions a row's real tokens must fit). A request becomes
blocks of token ids for the batcher (:meth:`Served.blocks`) or one call on the scoring thread
(:meth:`Served.call`: reward functions, ensembles whose members tokenise differently).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shifu.errors import ConfigError, UserCodeError, function_name, user_code
from shifu.models.positions import position_limit
from shifu.rewards.remote import tokenizer_fingerprint
from shifu.serve.validation import RequestError, ScoreRequest, unprocessable

API_VERSION = 1
MAX_LENGTH = 512  # tokens of a text pair, the in-process default of ScalarModel.encode / score_texts


class ScoringError(Exception):
    """The served reward failed on a valid request (a reward function raised, returned the wrong count)."""


def _tokenizer_meta(tok) -> dict | None:
    if tok is None:
        return None
    return {
        "name": str(getattr(tok, "name_or_path", "") or ""),
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "fingerprint": tokenizer_fingerprint(tok),
    }


def _members(model) -> list:
    return list(model.members) if hasattr(model, "members") else [model]


def shares_one_tokenizer(model) -> bool:
    """True when every member of an ensemble tokenises text the same way (then text is encoded once)."""
    from shifu.rewards.sources import same_tokenizer

    members = _members(model)
    first = members[0]
    return all(
        same_tokenizer(m.tokenizer, first.tokenizer) and m.is_causal == first.is_causal for m in members
    )


def _is_steps(x) -> bool:
    """A response's process reward in shifu's steps format: ``[[end, reward], ...]`` (possibly empty)."""
    return isinstance(x, (list, tuple)) and all(isinstance(s, (list, tuple)) for s in x)


def function_scores(out, n: int) -> dict[str, list]:
    """A reward function's return value -> the answer: ``{"scores"}`` for one number per response;
    ``{"scores", "steps"}`` when some responses get shifu's process-reward steps ``[[end, reward], ...]``
    (:mod:`shifu.rewards.sources`; the others a number, their steps empty, a stepped response's score 0);
    ``{"token_scores"}`` for one list of numbers per response. ScoringError when it is none of these."""
    try:
        items = list(out)
    except TypeError:
        raise ScoringError(
            f"reward function returned a {type(out).__name__}, expected a list of {n}"
        ) from None
    if len(items) != n:
        raise ScoringError(f"reward function returned {len(items)} scores for {n} responses")
    try:
        if any(isinstance(x, (list, tuple)) and x and _is_steps(x) for x in items):
            steps = [
                [[int(e), float(r)] for e, r in x] if isinstance(x, (list, tuple)) else [] for x in items
            ]
            scores = [0.0 if isinstance(x, (list, tuple)) else float(x) for x in items]
            return {"scores": scores, "steps": steps}
        if items and all(isinstance(x, (list, tuple)) for x in items):
            return {"token_scores": [[float(v) for v in x] for x in items]}
        return {"scores": [float(x) for x in items]}
    except (TypeError, ValueError) as e:
        raise ScoringError(f"reward function returned something that is not a number ({e})") from None


@dataclass
class Served:
    """What one server scores: a reward ``model`` (ScalarModel / RewardEnsemble) or a ``function``."""

    source: str
    model: object | None = None
    function: Callable | None = None
    device: str = "cpu"
    one_tokenizer: bool = True
    vocab_rows: int = 0  # ids must be < this: rows of the input embedding (the smallest member's)
    positions: int | None = None  # real tokens a row may hold: the model's positions (None: no limit)

    @property
    def pad_id(self) -> int:
        """The id that pads merged batches (any id works under mask 0; the tokenizer's pad for tidiness)."""
        tok = getattr(self.model, "tokenizer", None)
        return int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0

    @property
    def kind(self) -> str:
        if self.function is not None:
            return "function"
        return "ensemble" if hasattr(self.model, "members") else "model"

    def metadata(self) -> dict:
        """The ``/v1/metadata`` description (without the server's limits)."""
        from shifu import __version__

        meta = {"api": API_VERSION, "shifu_version": __version__, "kind": self.kind, "source": self.source}
        if self.function is not None:
            return meta | {"is_causal": False, "accepts": ["text"], "tokenizer": None, "normalisation": None}
        members = _members(self.model)
        norm = [{"gain": float(m.gain), "bias": float(m.bias)} for m in members]
        meta |= {
            "is_causal": bool(self.model.is_causal),
            "accepts": ["text", "tokens"] if self.model.is_causal else ["text"],
            "tokenizer": _tokenizer_meta(self.model.tokenizer),
            "normalisation": norm[0] if self.kind == "model" else norm,
            "max_length": self.model.text_length(MAX_LENGTH),
            "max_positions": self.positions,
            "vocab_rows": self.vocab_rows,
        }
        if self.kind == "ensemble":
            meta["ensemble"] = {
                "members": len(members),
                "aggregate": self.model.how,
                "std_coef": float(self.model.std_coef),
                "one_tokenizer": self.one_tokenizer,
            }
        return meta

    @torch.no_grad()
    def score_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) float32 CPU scores of (B, T) ids, as ``RewardSource``'s token path computes them."""
        return self.model.score(input_ids.to(self.device), attention_mask.to(self.device)).float().cpu()

    def blocks(self, req: ScoreRequest) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The request as (ids, mask) blocks for the batcher, or None when it must be a single call."""
        if self.function is not None:
            if req.prompts is None:
                raise RequestError(
                    422,
                    "prompts",
                    "prompts: missing: a reward function scores text; send prompts and responses",
                )
            return None
        if req.input_ids is not None:
            if not self.model.is_causal:
                raise unprocessable(
                    "input_ids",
                    "this reward model is an encoder with its own tokenizer; send prompts and responses",
                )
            if req.size == 0:
                return []
            bad = (req.input_ids < 0) | (req.input_ids >= self.vocab_rows)
            if bad.any():  # parse_score_request checked this already when given vocab_rows
                i, j = (int(x) for x in bad.nonzero()[0])
                raise unprocessable(
                    f"input_ids[{i}][{j}]",
                    f"{int(req.input_ids[i, j])} is outside the reward model's vocabulary "
                    f"0..{self.vocab_rows - 1}; send text when the policy's tokenizer differs "
                    "(compare /v1/metadata tokenizer.fingerprint)",
                )
            if self.positions is not None:  # positions count the real tokens (position_ids_from_mask)
                real = req.attention_mask.sum(1)
                over = (real > self.positions).nonzero()
                if len(over):
                    i = int(over[0])
                    raise unprocessable(
                        f"input_ids[{i}]",
                        f"has {int(real[i])} real tokens (attention_mask 1s), more than the reward "
                        f"model's {self.positions} positions (/v1/metadata max_positions); send shorter "
                        "sequences, or text (which keeps the end of a pair that is too long)",
                    )
            return [(req.input_ids, req.attention_mask)]
        if not self.one_tokenizer:
            return None
        if req.size == 0:
            return []
        enc = self.model.encode(self.prompts(req), req.responses, self.model.text_length(MAX_LENGTH))
        return [(enc["input_ids"], enc["attention_mask"])]

    def prompts(self, req: ScoreRequest) -> list[str]:
        """The prompts as a causal reward model saw them in training: a user message through its chat
        template, when its tokenizer has one (:func:`shifu.data.rows.prompt_text`)."""
        if not getattr(self.model, "is_causal", False):
            return req.prompts
        from shifu.data.rows import prompt_text

        return [prompt_text(self.model.tokenizer, {"prompt": p}) for p in req.prompts]

    @torch.no_grad()
    def call(self, req: ScoreRequest) -> tuple[list[float] | None, list[list[float]] | None]:
        """Score a request in one call: a reward function, or an ensemble whose members' tokenizers differ."""
        if self.function is None:
            return {
                "scores": self.model.score_texts(
                    self.prompts(req), req.responses, max(1, req.size), MAX_LENGTH
                ).tolist()
            }
        rows = req.rows if req.rows is not None else [{} for _ in req.prompts]
        try:
            with user_code(f"reward function {function_name(self.function)}"):
                out = self.function(req.prompts, req.responses, rows)
        except UserCodeError as e:  # the user's function: its name, file:line (the cause: the traceback)
            raise ScoringError(str(e)) from e
        return function_scores(out, req.size)


def load_served(
    source: str, device: str = "cpu", aggregate: str | None = None, std_coef: float | None = None
) -> Served:
    """A reward model / ensemble / run directory, or ``package.module:function`` (errors say which)."""
    if Path(source).is_dir():
        from shifu.models.loading import fuse_tanh_gelu
        from shifu.rewards.ensemble import load_reward

        # the kernels a trainer scores with in process (one fused tanh-GELU): the same scores, bit for bit
        model = fuse_tanh_gelu(load_reward(source, aggregate, std_coef)).to(device).eval()
        members = _members(model)
        rows = min(m.backbone.get_input_embeddings().num_embeddings for m in members)
        return Served(
            source,
            model=model,
            device=device,
            one_tokenizer=shares_one_tokenizer(model),
            vocab_rows=rows,
            positions=position_limit(model),
        )
    if ":" in source and not Path(source).exists():
        from shifu.config.imports import load_callable

        return Served(source, function=load_callable(source, "reward function"))
    raise ConfigError(
        f"'{source}' is neither a reward model directory nor a reward function: give a `shifu rm` output "
        "directory (a model, an ensemble, or a run with final/) or 'package.module:function'"
    )

"""Where a score comes from: a reward model (same or different tokenizer), an ensemble, or a Python function.

A reward *function* has the signature ``fn(prompts: list[str], responses: list[str], rows: list[dict])
-> list[float]`` and is named in configs as ``"package.module:function"``; ``rows`` are the prompt rows of
the data file, so extra fields (e.g. an ``answer``) reach it. Gold judges use the same signature.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from shifu.errors import ConfigError, ShifuError

RewardFn = Callable[[list[str], list[str], list[dict]], list[float]]


def load_function(spec: str, what: str = "reward function") -> RewardFn:
    """Import ``"package.module:function"``; errors say what to write instead."""
    if ":" not in spec:
        raise ConfigError(f"{what} '{spec}' must look like 'package.module:function'")
    mod_name, fn_name = spec.split(":", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{what} '{spec}': cannot import module '{mod_name}' ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{what} '{spec}': module '{mod_name}' has no function '{fn_name}'")
    return fn


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map text to the same ids (then a reward model can score token ids)."""
    if a is None or b is None:
        return False
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


class RewardSource:
    """Scores finished responses. ``model`` is a ScalarModel-like object (``score``, ``score_texts``,
    ``tokenizer``, ``is_causal``) or ``None``; ``function`` a reward function or ``None`` (exactly one).

    With a causal reward model that shares the policy's tokenizer, the token ids of the rollout are scored
    directly (prompt ids + response ids, the EOS the policy emitted being the last real token); otherwise
    the decoded text is re-tokenised with the reward model's own tokenizer.
    """

    def __init__(
        self, model=None, function: RewardFn | None = None, policy_tokenizer=None, micro_batch: int = 32
    ):
        if (model is None) == (function is None):
            raise ConfigError("give exactly one of reward.model_path and reward.function")
        self.model, self.function, self.micro_batch = model, function, micro_batch
        self.token_path = (
            model is not None
            and getattr(model, "is_causal", False)
            and same_tokenizer(getattr(model, "tokenizer", None), policy_tokenizer)
        )

    @torch.no_grad()
    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        rows: list[dict],
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B,) float32 scores on CPU. Non-finite values are passed through (the trainer drops them)."""
        if self.function is not None:
            try:
                out = self.function(prompts, responses, rows)
            except Exception as e:  # a user's function: say whose fault it is
                raise ShifuError(f"reward function raised {type(e).__name__}: {e}") from e
            scores = torch.tensor([float(x) for x in out], dtype=torch.float32)
            if scores.shape[0] != len(prompts):
                raise ShifuError(
                    f"reward function returned {scores.shape[0]} scores for {len(prompts)} responses"
                )
            return scores
        if self.token_path and input_ids is not None:
            dev = next(self.model.parameters()).device
            outs = []
            for i in range(0, input_ids.shape[0], self.micro_batch):
                ids = input_ids[i : i + self.micro_batch].to(dev)
                mask = attention_mask[i : i + self.micro_batch].to(dev)
                outs.append(self.model.score(ids, mask).float().cpu())
            return torch.cat(outs)
        return self.model.score_texts(prompts, responses, batch_size=self.micro_batch).float()


def load_reward_model(path: str | Path):
    """A saved reward model or ensemble directory (ensembles resolved by shifu.ensemble when present)."""
    p = Path(path)
    try:
        from shifu.ensemble import load_reward  # written alongside the RM trainer

        return load_reward(p)
    except ImportError:
        from shifu.models import ScalarModel

        return ScalarModel.from_pretrained(p)

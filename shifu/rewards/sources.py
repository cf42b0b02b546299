"""Where a score comes from: a reward model (same or different tokenizer), an ensemble, or a Python function.

A reward *function* has the signature ``fn(prompts: list[str], responses: list[str], rows: list[dict])
-> list[float]`` and is named in configs as ``"package.module:function"``; ``rows`` are the prompt rows of
the data file, so extra fields (e.g. an ``answer``) reach it. Gold judges use the same signature.

**Process rewards.** Instead of a number, a reward function may return for a response a list of steps
``[[end, reward], ...]``: ``end`` is a character offset into the response text (the step is
``response[previous end:end]``), and ``shifu ppo`` places the step's reward on the response token that holds
character ``end - 1`` (:meth:`RewardSource.score_with_steps`). A response's score is then the sum of its
step rewards; an outcome reward goes on a last step ending at ``len(response)``.

**Dense rewards from a reward model** (``reward.dense``): a causal reward model that shares the policy's
tokenizer gives a score for every prefix (its head at each position). Response token ``t`` then gets
``s(<= t) - s(< t)``, the change of the prefix score it caused (:meth:`RewardSource.dense_rewards`); the sum
over the response is the score minus the prompt's own prefix score, which every response to that prompt
shares, so with ``gamma = 1`` the KL-regularised objective and its optimum are those of the outcome score
(potential-based shaping, Ng et al. 1999) while each token's credit lands on it. For the bag-of-tokens model
(:mod:`shifu.models.bag_of_tokens`) the change is exactly the token's own weight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shifu.data.rows import prompt_text
from shifu.errors import ConfigError, ShifuError, function_name, user_code

RewardFn = Callable[[list[str], list[str], list[dict]], list[float]]


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
    the decoded text is re-tokenised with the reward model's own tokenizer, a causal model's prompt rendered
    by :func:`shifu.data.rows.prompt_text` as ``shifu rm`` rendered it in training.
    """

    def __init__(
        self,
        model=None,
        function: RewardFn | None = None,
        policy_tokenizer=None,
        micro_batch: int = 32,
        chat_template: bool = True,
        dense: bool = False,
    ):
        if (model is None) == (function is None):
            raise ConfigError("give exactly one of reward.model_path and reward.function")
        self.model, self.function, self.micro_batch = model, function, micro_batch
        self.chat_template = chat_template
        self.token_path = (
            model is not None
            and getattr(model, "is_causal", False)
            and same_tokenizer(getattr(model, "tokenizer", None), policy_tokenizer)
        )
        self.dense = dense
        if dense and not (self.token_path and callable(getattr(model, "read_score", None))):
            why = (
                "a reward function gives no prefix scores"
                if model is None
                else "this reward model is not one causal model with the policy's tokenizer (an encoder, an "
                "ensemble, or another tokenizer)"
            )
            raise ConfigError(
                f"reward.dense needs the prefix scores of a causal reward model that reads the policy's token "
                f"ids, but {why}; train one with rm.model.path=bag-of-tokens (model.tokenizer: the policy's) "
                "or on the SFT policy's trunk, or set reward.dense=false"
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
        """(B,) float32 scores on CPU (a process reward's: the sum of its steps). Non-finite values are
        passed through (the trainer drops them)."""
        return step_totals(*self.score_with_steps(prompts, responses, rows, input_ids, attention_mask))

    @torch.no_grad()
    def score_with_steps(
        self,
        prompts: list[str],
        responses: list[str],
        rows: list[dict],
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[list[tuple[int, float]]] | None]:
        """``(scores (B,), steps)``: ``steps`` is None unless the reward function returned process rewards
        for some response; then ``steps[i]`` is response i's ``[(end, reward), ...]`` (empty for a response
        scored by a number) and ``scores[i]`` its number (0 for a response given steps). With ``dense`` the
        scores are 0: the whole reward is :meth:`dense_rewards`."""
        if self.dense:  # the score is all in :meth:`dense_rewards`, token by token
            return torch.zeros(len(prompts)), None
        if self.function is None:
            return self._model_scores(prompts, responses, rows, input_ids, attention_mask), None
        with user_code(f"reward function {function_name(self.function)}"):  # a loaded one names itself
            out = list(self.function(prompts, responses, rows))
        if len(out) != len(prompts):
            raise ShifuError(f"reward function returned {len(out)} scores for {len(prompts)} responses")
        if not any(isinstance(x, (list, tuple)) for x in out):
            return torch.tensor([float(x) for x in out], dtype=torch.float32), None
        steps = [
            check_steps(x, i, len(responses[i])) if isinstance(x, (list, tuple)) else []
            for i, x in enumerate(out)
        ]
        scores = [0.0 if isinstance(x, (list, tuple)) else float(x) for x in out]
        return torch.tensor(scores, dtype=torch.float32), steps

    @torch.no_grad()
    def dense_rewards(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
    ) -> torch.Tensor:
        """(B, R) float32 on CPU: response token ``t`` (column ``prompt_len + t`` of the left-padded prompt +
        right-padded response) gets ``s(<= t) - s(< t)``, ``s`` the model's normalised score of a prefix;
        0 on padding. A row's sum is its score minus its prompt's prefix score."""
        dev = next(self.model.parameters()).device
        outs = []
        for i in range(0, input_ids.shape[0], self.micro_batch):
            ids = input_ids[i : i + self.micro_batch].to(dev)
            mask = attention_mask[i : i + self.micro_batch].to(dev)
            # (b, T) prefix scores; the normalisation's bias cancels in the differences
            prefix = self.model(ids, mask).float() * self.model.gain
            delta = prefix[:, prompt_len:] - prefix[:, prompt_len - 1 : -1]
            outs.append((delta * mask[:, prompt_len:]).cpu())
        return torch.cat(outs)

    def _model_scores(self, prompts, responses, rows, input_ids, attention_mask) -> torch.Tensor:
        if self.token_path and input_ids is not None:
            dev = next(self.model.parameters()).device
            outs = []
            for i in range(0, input_ids.shape[0], self.micro_batch):
                ids = input_ids[i : i + self.micro_batch].to(dev)
                mask = attention_mask[i : i + self.micro_batch].to(dev)
                outs.append(self.model.score(ids, mask).float().cpu())
            return torch.cat(outs)
        if getattr(self.model, "is_causal", False):  # the prompt as the reward model saw it in training
            # a row without its own prompt (a caller's bare rows) is prompted with the string given
            prompts = [
                prompt_text(self.model.tokenizer, {"prompt": p} | r, self.chat_template)
                for p, r in zip(prompts, rows)
            ]
        return self.model.score_texts(prompts, responses, batch_size=self.micro_batch).float()


def step_totals(scores: torch.Tensor, steps: list[list[tuple[int, float]]] | None) -> torch.Tensor:
    """(B,) each response's total: its score plus the sum of its process-reward steps (``steps`` as
    :meth:`RewardSource.score_with_steps` returns them; None: the scores as they are)."""
    if steps is None:
        return scores
    return scores + torch.tensor([sum(r for _, r in row) for row in steps], dtype=torch.float32)


def check_steps(x, i: int, length: int) -> list[tuple[int, float]]:
    """Response ``i``'s process reward ``[[end, reward], ...]`` checked: ends are increasing character
    offsets in ``1..length``."""
    out, last = [], 0
    for j, step in enumerate(x):
        try:
            end, reward = step
            end, reward = int(end), float(reward)
        except (TypeError, ValueError):
            raise ShifuError(
                f"reward function: response {i}, step {j}: expected [end, reward] (end: a character offset "
                f"into the response), got {step!r}"
            ) from None
        if not last < end <= length:
            raise ShifuError(
                f"reward function: response {i}, step {j}: end {end} must be after the previous step's "
                f"({last}) and at most the response's length ({length} characters)"
            )
        out.append((end, reward))
        last = end
    return out


def load_reward_model(path: str | Path):
    """A saved reward model or ensemble directory (ensembles resolved by shifu.rewards.ensemble when present)."""
    from shifu.rewards.ensemble import load_reward

    return load_reward(Path(path))

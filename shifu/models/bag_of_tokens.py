"""The bag-of-tokens reward backbone (``rm.model.path=bag-of-tokens``): one learned weight per token id.

A :class:`shifu.models.scalar.ScalarModel` on this backbone scores a sequence as the sum of its tokens' weights
(times the scalar head's weight, plus its bias): the linear Bradley-Terry model over token counts, the
classic bag-of-words sentiment classifier (Maas et al. 2011 report it as the IMDB baseline) trained on
preference pairs. It has no positions and no attention, costs microseconds to train and to score, and its
value at position ``t`` (``ScalarModel.forward``) is the score of the prefix ``ids[:t + 1]``: the model is
causal, and the change of the prefix score at a token is exactly that token's weight, so PPO's
``reward.dense`` puts every token's share of the score on it (see :mod:`shifu.rewards.sources`).

What it cannot do: see order, negation or context ("not good" scores as "not" + "good"). Where the
preference is carried by words (a lexicon judge like the imdb task's VADER) it ranks a policy's optimised
samples as well as a small transformer; elsewhere prefer a transformer backbone.

It is a ``transformers`` model (``model_type`` ``shifu_bag_of_tokens``, registered with ``AutoConfig`` and
``AutoModel`` by :func:`register`), so ``save_pretrained`` / ``from_pretrained`` and every shifu path that
loads a reward model work on it unchanged.
"""

from __future__ import annotations

from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

MODEL_TYPE = "shifu_bag_of_tokens"
NAME = "bag-of-tokens"  # the value of rm.model.path that builds a fresh one


class BagOfTokensConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size: int = 2, pad_token_id: int | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = 1  # the scalar head reads a 1-dim "hidden state": the running sum
        super().__init__(pad_token_id=pad_token_id, **kwargs)


class BagOfTokensModel(PreTrainedModel):
    """``last_hidden_state[b, t, 0]`` = sum of ``weight[ids[b, s]]`` over the real tokens ``s <= t``."""

    config_class = BagOfTokensConfig
    base_model_prefix = "bag_of_tokens"
    main_input_name = "input_ids"

    def __init__(self, config: BagOfTokensConfig):
        super().__init__(config)
        self.weight = nn.Embedding(config.vocab_size, 1)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):  # untrained: every response scores 0
            nn.init.zeros_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.weight

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.weight = value

    def forward(self, input_ids=None, attention_mask=None, **_) -> BaseModelOutput:
        w = self.weight(input_ids)  # (B, T, 1)
        if attention_mask is not None:
            w = w * attention_mask.unsqueeze(-1).to(w.dtype)
        return BaseModelOutput(last_hidden_state=w.cumsum(dim=1))


_registered = False


def register() -> None:
    """Make ``AutoConfig`` / ``AutoModel`` know the architecture (idempotent; called before loading)."""
    global _registered
    if not _registered:
        AutoConfig.register(MODEL_TYPE, BagOfTokensConfig, exist_ok=True)
        AutoModel.register(BagOfTokensConfig, BagOfTokensModel, exist_ok=True)
        _registered = True


def fresh(tokenizer) -> BagOfTokensModel:
    """An untrained backbone with a weight for every id of ``tokenizer`` (zeros)."""
    register()
    return BagOfTokensModel(BagOfTokensConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))

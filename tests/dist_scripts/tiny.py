"""Tiny real components shared by the distributed and LoRA tests: a character-level tokenizer built
locally (no hub), a 2-layer HF GPT-2 sized to it, and a right-padded batch with uneven lengths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHARS = "0123456789+= abcdefghijklmnopqrstuvwxyz"


def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` over single characters, with ``<eos>`` (also pad) and ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"
    )


def tiny_model(tokenizer, seed: int = 0, n_layer: int = 2):
    from shifu.models.loading import build_tiny_gpt2

    return build_tiny_gpt2(tokenizer, n_layer=n_layer, n_embd=32, n_head=2, n_positions=64, seed=seed)


def batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` (B, T) of ``text + <eos>``."""
    from shifu.models.padding import pad_right

    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    return pad_right(rows, tokenizer.pad_token_id)


# Four sequences of very different lengths: rank 0 of 2 gets the two long ones, rank 1 the two short.
TEXTS = ["12+34=46 and some more", "7+8=15 the quick brown", "1+1=2", "9+0=9"]


def nll_sum_and_count(model, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL over real target tokens, and their number (token-mean = sum / count)."""
    ids, mask = b["input_ids"], b["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    m = mask[:, 1:].to(nll.dtype)
    return (nll * m).sum(), m.sum()

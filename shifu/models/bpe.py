"""A byte-level BPE tokenizer (GPT-2 style) trained locally on a list of texts in seconds, with ``tokenizers``:
the imdb task's tokenizer and the one ``shifu init-model`` fits to a user's own data."""

from __future__ import annotations

from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<pad>"


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path):
    """Byte-level BPE (GPT-2 style) trained on ``texts``, wrapped as ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=EOS, eos_token=EOS, pad_token=PAD)
    tok.save_pretrained(str(out_dir))
    return tok

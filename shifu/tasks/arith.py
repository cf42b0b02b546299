"""Task ``arith``: additions (``"37+48="`` -> ``"85"``) with a character tokenizer and a tiny GPT-2.

The fast built-in task: a sub-million-parameter policy, SFT stopped early on purpose so the policy is
only partly right, and the rule-based reward :func:`shifu.tasks.judges.exact_match` (1.0 when the
stripped response equals the sum) used both as the PPO reward and as the gold judge. No reward model.

Data (all deterministic). The ``(a, b)`` operand pairs with ``0 <= a, b <= max_operand`` are shuffled
once with a fixed split seed (independent of the run seed, so every seed is judged on the same prompts)
and cut into three disjoint sets:

- ``prompts_eval.jsonl``: ``n_heldout`` pairs, the held-out gold prompts; never trained on;
- ``sft_eval.jsonl``: ``n_sft_eval`` pairs for the SFT held-out loss (and, as ``prompts_val.jsonl``,
  PPO's periodic validation prompts);
- the rest: SFT demonstrations (``sft_train.jsonl``, a run-seeded sample of ``n_sft`` pairs) and PPO
  prompts (``prompts_train.jsonl``, all of them).

Prompt rows carry ``answer`` (the reward function reads it).

Preset ``smollm2`` asks SmolLM2-135M-Instruct in its chat format (``"What is 37+48? Answer with only the
number."``, rendered with the chat template) and is judged by :func:`shifu.tasks.judges.final_number_match`
(the last number of the reply must equal the sum exactly: the model answers ``"37 + 48 = 85"``).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from shifu.runs.jsonfile import write_jsonl
from shifu.tasks.common import data_paths, preset_of, read_presets, write_base
from shifu.tasks.judges import exact_match

__all__ = [
    "PRESETS",
    "ArithPreset",
    "build_tokenizer",
    "build_model",
    "make_splits",
    "prepare",
    "exact_match",
]

SPLIT_SEED = 1234  # fixed: the held-out set does not depend on the run seed
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = "0123456789+="


@dataclasses.dataclass(frozen=True)
class ArithPreset:
    max_operand: int
    n_heldout: int
    n_sft_eval: int
    n_sft: int
    n_layer: int
    n_embd: int
    n_head: int
    # "smollm2": SmolLM2-135M-Instruct (its own tokenizer) asked in a chat turn, judged on its final number
    pretrained: str | None = None
    prompt_template: str = "{a}+{b}="


# the presets: shifu/presets/tasks/arith.yaml, each checked against ArithPreset's fields
PRESETS: dict[str, ArithPreset] = read_presets("arith", ArithPreset)


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_splits(max_operand: int, n_heldout: int, n_sft_eval: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint ``heldout`` / ``sft_eval`` / ``train`` operand pairs, shuffled with :data:`SPLIT_SEED`."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    if n_heldout + n_sft_eval >= len(pairs):
        raise ValueError(f"max_operand={max_operand} gives only {len(pairs)} pairs; too few to split")
    return {
        "heldout": pairs[:n_heldout],
        "sft_eval": pairs[n_heldout : n_heldout + n_sft_eval],
        "train": pairs[n_heldout + n_sft_eval :],
    }


def build_tokenizer(out_dir: str | Path, alphabet: str = ALPHABET):
    """Character-level ``PreTrainedTokenizerFast`` over ``alphabet`` (one token per character after
    :data:`SPECIALS`: ``<pad>``/``<bos>``/``<eos>``/``<unk>``), saved to ``out_dir``. Decoding joins characters
    without spaces (``Fuse`` decoder)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(alphabet)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(str(out_dir))
    return tok


def build_model(tokenizer, preset: ArithPreset, seed: int):
    """Untrained GPT-2 (sub-million parameters for ``tiny``) sized to the character vocabulary."""
    from shifu.models.loading import build_tiny_gpt2

    n_positions = 4 * len(str(preset.max_operand)) + 8  # "a+b=" + answer + eos, with room to spare
    return build_tiny_gpt2(
        tokenizer,
        n_layer=preset.n_layer,
        n_embd=preset.n_embd,
        n_head=preset.n_head,
        n_positions=n_positions,
        seed=seed,
    )


def prepare(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> dict[str, str]:
    """Write the data files, the tokenizer (``tokenizer/``) and an untrained model (``base/``).

    Returns name -> path for ``sft_train``, ``sft_eval``, ``prompts_train``, ``prompts_val``, ``prompts_eval``,
    ``tokenizer``, ``base``.
    """
    p = preset_of("arith", PRESETS, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(p.max_operand, p.n_heldout, p.n_sft_eval)
    rng = random.Random(seed)
    sft_pairs = rng.sample(splits["train"], min(p.n_sft, len(splits["train"])))

    def prompt_row(a: int, b: int) -> dict:
        return {"prompt": p.prompt_template.format(a=a, b=b), "answer": str(a + b)}

    def sft_row(a: int, b: int) -> dict:
        return {"prompt": p.prompt_template.format(a=a, b=b), "response": str(a + b)}

    write_jsonl(out / "sft_train.jsonl", [sft_row(a, b) for a, b in sft_pairs])
    write_jsonl(out / "sft_eval.jsonl", [sft_row(a, b) for a, b in splits["sft_eval"]])
    write_jsonl(out / "prompts_train.jsonl", [prompt_row(a, b) for a, b in splits["train"]])
    write_jsonl(out / "prompts_eval.jsonl", [prompt_row(a, b) for a, b in splits["heldout"]])
    # validation prompts for PPO's periodic evaluation (never the held-out gold prompts)
    write_jsonl(out / "prompts_val.jsonl", [prompt_row(a, b) for a, b in splits["sft_eval"]])

    def untrained() -> tuple:
        tok = build_tokenizer(out / "tokenizer")
        return tok, build_model(tok, p, seed)

    write_base(out, p.pretrained, untrained)
    return data_paths(out, ["sft_train", "sft_eval", "prompts_train", "prompts_val", "prompts_eval"])

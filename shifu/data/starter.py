"""``shifu init-model``: a small model to start one's own task with, in seconds.

A byte-level BPE tokenizer is trained on the text of the user's data files (every ``prompt``, ``response``,
``chosen``, ``rejected`` and message ``content`` of their rows, read and validated as the trainers read them)
and a small GPT-2 with random weights is sized to it. The directory is a Hugging Face model directory:
``shifu sft model.path=DIR`` starts from it, and sft -> rm -> ppo on a few thousand rows runs in minutes on a
CPU. The model knows nothing before SFT: it is for trying the pipeline on one's own data, not for quality.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shifu.data.rows import KINDS, load_rows
from shifu.errors import DataError, ShifuError

TEXT_FIELDS = ("prompt", "response", "chosen", "rejected")


def row_texts(row: dict) -> list[str]:
    """The texts of a validated row of any kind (its strings, its response's segments and its messages'
    contents)."""
    texts = [row[k] for k in TEXT_FIELDS if isinstance(row.get(k), str)]
    if isinstance(row.get("response"), list):
        texts += [seg["text"] for seg in row["response"]]
    for key in ("messages", "prompt"):
        if isinstance(row.get(key), list):
            texts += [
                m["content"] for m in row[key] if isinstance(m, dict) and isinstance(m.get("content"), str)
            ]
    return texts


def read_texts(path: str) -> list[str]:
    """Every text of ``path``, whichever kind of rows it holds (sft, preference or prompt rows)."""
    errors = []
    for kind in KINDS:
        try:
            return [t for row in load_rows(path, kind) for t in row_texts(row)]
        except DataError as e:
            errors.append(str(e))
    raise ShifuError(f"{path} holds no sft, preference or prompt rows: {errors[0]}")


def build(
    files: list[str],
    out: Path,
    vocab_size: int,
    layers: int,
    width: int,
    heads: int,
    positions: int,
    seed: int,
) -> dict[str, int]:
    """Tokenizer and random GPT-2 in ``out`` (which must be missing or empty); returns their sizes."""
    from shifu.models.bpe import train_tokenizer
    from shifu.models.loading import build_tiny_gpt2

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShifuError(f"{out} exists and is not empty: give a new --out (nothing there is overwritten)")
    if width % heads:
        raise ShifuError(f"--width {width} must be a multiple of --heads {heads}")
    texts = [t for f in files for t in read_texts(f)]
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, vocab_size, out)
    model = build_tiny_gpt2(tok, n_layer=layers, n_embd=width, n_head=heads, n_positions=positions, seed=seed)
    model.save_pretrained(str(out))
    return {"texts": len(texts), "vocab": len(tok), "parameters": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shifu init-model",
        description="A small random GPT-2 with a BPE tokenizer trained on your data files, to run sft -> rm -> "
        "ppo on your own task in minutes (a starting point for trying shifu, not a pretrained model).",
    )
    ap.add_argument("files", nargs="+", help="JSONL/Parquet files of sft, preference or prompt rows")
    ap.add_argument("--out", required=True, help="the model directory to write (must be new or empty)")
    ap.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary (default 2000)")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    ap.add_argument("--width", type=int, default=128, help="hidden size (default 128)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--positions", type=int, default=512, help="longest sequence in tokens (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    sizes = build(a.files, out, a.vocab_size, a.layers, a.width, a.heads, a.positions, a.seed)
    print(
        f"shifu init-model: {sizes['parameters']:,} parameters, a {sizes['vocab']}-token BPE fitted to "
        f"{sizes['texts']} texts, in {out}. Next: shifu sft --out runs/sft model.path={out} data.train=...",
        file=sys.stderr,
    )
    return 0

"""Training data as validated rows: reading files, checking each row, held-out splits, a row's prompt text.

Three row kinds, from JSONL (one JSON object per line), Parquet, or a directory written by
``datasets.Dataset.save_to_disk``:

- ``"sft"``: ``prompt`` + ``response``, or ``messages`` (a chat: a list of ``{"role", "content"}`` whose last
  message is the assistant's, with the ``tools`` it offered as an agent's chat log), or an ATIF trajectory
  (:mod:`shifu.data.atif`; a ``.json`` file holds one document or a list of them: a ``.json`` file of other
  rows is read as JSONL). ``response`` is a string, or a list of segments ``{"text", "train"}`` (``train``
  defaults to true; ``false`` marks text the model reads but is not trained to write, such as a tool's output).
  In ``messages`` every assistant message is trained unless it says ``"train": false``; an assistant message may
  carry ``tool_calls`` (then its ``content`` may be empty or absent).
- ``"preference"``: ``prompt``, ``chosen``, ``rejected`` strings (``chosen != rejected``), optional
  numeric ``margin``.
- ``"prompt"``: ``prompt`` string; every other field is kept and reaches reward functions unchanged.

Every problem is a :class:`shifu.errors.DataError` naming the file, the 1-based line (JSONL) or 0-based
row (Parquet / datasets) and the field (each field's checks: :mod:`shifu.data.checks`). With
``skip_bad=True`` bad rows are skipped instead and counted by reason (``LoadedRows.skipped``); a missing or
unreadable file is always an error.

A row's text (:func:`prompt_text`, :func:`sft_texts`) renders ``messages`` and, when the tokenizer has one,
a ``prompt`` string through the chat template. An SFT row's ids and what of them is trained are
:mod:`shifu.data.demonstrations`; tokenising and batching are in :mod:`shifu.data.batches`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from shifu.config.sections import DataConfig
from shifu.data.atif import atif_row, check_tools, is_atif, read_json_documents
from shifu.data.checks import check_messages, check_prompt, check_segments, check_text, trained
from shifu.errors import DataError

KINDS = ("sft", "preference", "prompt")


class Row(dict):
    """A validated SFT row that remembers where it was read (``where``: the file text and its line, as
    :class:`DataError` takes them), for the errors found when it is tokenised."""

    def __init__(self, row: dict, where: tuple[str, int | None]):
        super().__init__(row)
        self.where = where


class LoadedRows(list):
    """A list of validated rows (dicts) that also knows where they came from and what was skipped."""

    def __init__(self, rows: list[dict], path: str, skipped: Counter | None = None):
        super().__init__(rows)
        self.path = path
        self.skipped: Counter = skipped if skipped is not None else Counter()

    def skip_report(self) -> str:
        """One line: how many rows were skipped and why (empty string when none were)."""
        if not self.skipped:
            return ""
        why = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
        return f"{self.path}: skipped {sum(self.skipped.values())} bad rows ({why})"


# --------------------------------------------------------------------------------------------------
# reading files


def _where(path: str, fmt: str, i: int) -> tuple[str, int | None]:
    """(path text, line) for DataError: JSONL rows carry a 1-based line, table rows a 0-based row index."""
    if fmt == "jsonl":
        return path, i
    return f"{path}, row {i}", None


def _read_raw(path: str, split: str) -> tuple[str, list[tuple[int, Any, DataError | None]]]:
    """-> (format, [(line or row index, parsed row or None, read error or None)])."""
    p = Path(path)
    if not p.exists():
        raise DataError(path, None, None, "file does not exist", "check the path in data.train / data.eval")
    if p.is_dir():
        return "datasets", _read_datasets_dir(path, split)
    if p.suffix == ".parquet":
        return "parquet", _read_parquet(path)
    documents = read_json_documents(p.read_bytes()) if p.suffix.lower() == ".json" else None
    if documents is not None:
        return "json", documents
    return "jsonl", _read_jsonl(path)


UTF8_BOM = b"\xef\xbb\xbf"  # written at the start of a file by Windows editors ("UTF-8 with BOM")
# (magic bytes, what the file is, what to do): files that are not UTF-8 JSONL, named before any line is read
NOT_JSONL = (
    (b"\xff\xfe", "UTF-16 text (it starts with a UTF-16 byte-order mark)", "re-save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text (it starts with a UTF-16 byte-order mark)", "re-save it as UTF-8"),
    (b"\x1f\x8b", "gzip-compressed", "decompress it first (gunzip)"),
    (b"PK\x03\x04", "a zip archive", "unpack it and give the .jsonl file inside"),
    (b"PAR1", "a Parquet file without the .parquet suffix", "rename it to end in .parquet"),
)
TABLE_SUFFIXES = {".csv", ".tsv", ".xlsx", ".xls"}


def _read_jsonl(path: str) -> list[tuple[int, Any, DataError | None]]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(path, None, None, f"cannot read the file: {e.strerror or e}") from None
    for magic, what, fix in NOT_JSONL:
        if data.startswith(magic):
            raise DataError(path, None, None, f"is {what}, not JSONL", fix)
    if Path(path).suffix.lower() in TABLE_SUFFIXES:
        raise DataError(
            path,
            None,
            None,
            f"is a {Path(path).suffix} table, not JSONL",
            "convert it, e.g. datasets.Dataset.from_csv(path).to_json('data.jsonl'), or save it as Parquet",
        )
    if data[:4096].lstrip(UTF8_BOM + b" \t\r\n").startswith(b"["):
        _refuse_json_array(path, data)
    out = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.removeprefix(UTF8_BOM)  # a BOM starts the file (or a file concatenated into it)
        if not raw.strip():
            continue  # blank lines (including the one after a final newline) carry no row
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            err = DataError(
                path, lineno, None, f"invalid UTF-8 at byte {e.start}", "re-save the file as UTF-8"
            )
            out.append((lineno, None, err))
            continue
        try:
            out.append((lineno, json.loads(text), None))
        except json.JSONDecodeError as e:
            err = DataError(
                path,
                lineno,
                None,
                f"not valid JSON ({e.msg} at column {e.colno})",
                "each line must be one JSON object",
            )
            out.append((lineno, None, err))
    return out


def _refuse_json_array(path: str, data: bytes) -> None:
    """A file holding one JSON array of rows (``.json`` style) rather than one object per line."""
    try:
        value = json.loads(data.removeprefix(UTF8_BOM).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # not one JSON document: the lines are reported one by one
    if isinstance(value, list):
        raise DataError(
            path,
            None,
            None,
            f"holds one JSON array of {len(value)} items, not one JSON object per line (JSONL)",
            "convert it, e.g. jq -c '.[]' file.json > file.jsonl",
        )


def _read_parquet(path: str) -> list[tuple[int, Any, DataError | None]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for a damaged file
        raise DataError(path, None, None, f"not a readable Parquet file ({e})") from None
    return [(i, row, None) for i, row in enumerate(table.to_pylist())]


def _read_datasets_dir(path: str, split: str) -> list[tuple[int, Any, DataError | None]]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # FileNotFoundError, ValueError, ... depending on what is missing
        raise DataError(
            path,
            None,
            None,
            f"not a saved HF datasets directory ({e})",
            "write one with Dataset.save_to_disk, or give a .jsonl/.parquet file",
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(path, None, None, f"has no split '{split}' (splits: {', '.join(ds)})")
        ds = ds[split]
    return [(i, row, None) for i, row in enumerate(ds)]


# --------------------------------------------------------------------------------------------------
# validation


def _sft_row(row: dict, where: tuple[str, int | None]) -> Row:
    """An SFT row checked (an ATIF document read first as its row, :mod:`shifu.data.atif`)."""
    path, line = where
    if is_atif(row):
        row = atif_row(row, where)
        if "token_ids" in row:  # as recorded: ids and their trained mask
            return Row(row, where)
    if row.get("tools") is not None:
        check_tools(row, where)
    if "messages" in row and row["messages"] is not None:
        check_messages(row, where)
    else:
        if "prompt" not in row and "response" not in row:
            raise DataError(
                path,
                line,
                "prompt",
                "missing field",
                "SFT rows need 'prompt' and 'response', or 'messages'",
            )
        check_text(row, "prompt", where)
        if isinstance(row.get("response"), list):
            check_segments(row, where)
        else:
            check_text(row, "response", where)
    return Row(row, where)


def validate_row(row: Any, kind: str, where: tuple[str, int | None]) -> dict:
    """Check one parsed row of ``kind``; return it (as a dict) or raise DataError."""
    path, line = where
    if not isinstance(row, dict):
        raise DataError(path, line, None, f"expected a JSON object, got {type(row).__name__}")
    if kind == "sft":
        row = _sft_row(row, where)
    elif kind == "preference":
        check_prompt(row, where)
        for key in ("chosen", "rejected"):
            check_text(row, key, where)
        if row["chosen"] == row["rejected"]:
            raise DataError(path, line, "rejected", "chosen == rejected: the pair carries no preference")
        m = row.get("margin")
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)):
            raise DataError(path, line, "margin", f"expected a finite number, got {m!r}")
    elif kind == "prompt":
        check_prompt(row, where)
    else:
        raise ValueError(f"unknown row kind {kind!r}; expected one of {KINDS}")
    return row


def _reason(err: DataError) -> str:
    return f"{err.problem} in '{err.field}'" if err.field else err.problem


def load_rows(path: str | Path, kind: str, skip_bad: bool = False, split: str = "train") -> LoadedRows:
    """Read and validate every row of ``path`` (JSONL, Parquet or a datasets dir) as ``kind`` rows.

    ``split`` picks the split of a saved ``DatasetDict``. Raises DataError on the first bad row, or with
    ``skip_bad`` skips bad rows and counts them by reason in ``.skipped`` (also printed to stderr). An
    input with no valid rows is always an error.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown row kind {kind!r}; expected one of {KINDS}")
    path = str(path)
    fmt, raw = _read_raw(path, split)
    rows, skipped = [], Counter()
    for i, row, err in raw:
        where = _where(path, fmt, i)
        try:
            if err is not None:
                raise err
            rows.append(validate_row(row, kind, where))
        except DataError as e:
            if not skip_bad:
                raise
            skipped[_reason(e)] += 1
    if not rows:
        hint = f"{sum(skipped.values())} rows were skipped as bad" if skipped else "the file holds no rows"
        raise DataError(path, None, None, f"no valid {kind} rows", hint)
    out = LoadedRows(rows, path, skipped)
    if skipped and os.environ.get("RANK", "0") == "0":  # under torchrun every rank reads; rank 0 reports
        print(f"shifu: {out.skip_report()}", file=sys.stderr)
    return out


def split_rows(rows: list[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Deterministic held-out split: -> (train, held_out) with ``max(1, round(fraction*N))`` held out.

    The same rows, fraction and seed always give the same split (a torch.Generator permutation).
    """
    n = len(rows)
    n_eval = max(1, round(fraction * n))
    if n_eval >= n:
        raise DataError(
            getattr(rows, "path", "data"),
            None,
            None,
            f"only {n} rows: holding out {n_eval} leaves nothing to train on",
            "add rows, lower data.eval_fraction, or give data.eval",
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(perm[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def load_train_eval(cfg: DataConfig, kind: str) -> tuple[LoadedRows, list[dict]]:
    """Train and held-out rows as ``cfg`` says: a separate eval file, or a deterministic fraction."""
    train = load_rows(cfg.train, kind, skip_bad=cfg.skip_bad)
    if cfg.eval:
        return train, load_rows(cfg.eval, kind, skip_bad=cfg.skip_bad)
    kept, held = split_rows(train, cfg.eval_fraction, cfg.split_seed)
    return LoadedRows(kept, train.path, train.skipped), held


def split_prompts(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """PPO's held-out prompts when no eval file is given: ``max(1, int(fraction * N))`` rows of a
    ``randperm`` seeded with ``seed`` (in that order), the rest kept in file order -> (train, held_out)."""
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, int(len(rows) * fraction)) if len(rows) > 1 else 0
    return [rows[i] for i in sorted(perm[n_eval:])], [rows[i] for i in perm[:n_eval]]


# --------------------------------------------------------------------------------------------------
# a row's text


def _render(tokenizer, history: list[dict]) -> str:
    """A conversation up to the model's turn as prompt text: the tokenizer's chat template with the
    generation prompt added, or without one a plain ``"{role}: {content}\\n"`` per message, then
    ``"assistant: "``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in history) + "assistant: "


def render_messages(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """An SFT chat -> (prompt text, response text); the response is the last (assistant) message and the
    prompt the conversation before it (:func:`_render`)."""
    return _render(tokenizer, messages[:-1]), messages[-1].get("content") or ""


def prompt_text(tokenizer, row: dict, chat_template: bool = True) -> str:
    """The text a model is prompted with for a validated row: its ``messages`` rendered up to the model's
    turn; else its ``prompt`` string as one user message through the tokenizer's chat template when
    ``chat_template`` and the tokenizer has one (an instruct model answers a bare string with EOS), else the
    string verbatim."""
    if row.get("messages") is not None:
        return _render(tokenizer, row["messages"])
    if chat_template and getattr(tokenizer, "chat_template", None):
        return _render(tokenizer, [{"role": "user", "content": row["prompt"]}])
    return row["prompt"]


def response_segments(row: dict) -> list[tuple[str, bool]]:
    """A validated plain SFT row's response as ``[(text, trained)]``: one trained segment for a string."""
    response = row["response"]
    if isinstance(response, str):
        return [(response, True)]
    return [(seg["text"], trained(seg)) for seg in response]


def sft_texts(tokenizer, row: dict, chat_template: bool = True) -> tuple[str, str]:
    """(prompt, response) text of a validated SFT row, as a scorer reads it (``messages`` rendered by
    :func:`render_messages`; a ``prompt`` string by :func:`prompt_text`; a response's segments joined,
    untrained ones included). What SFT trains on is :mod:`shifu.data.demonstrations`."""
    if row.get("messages") is not None:
        return render_messages(tokenizer, row["messages"])
    return prompt_text(tokenizer, row, chat_template), "".join(t for t, _ in response_segments(row))

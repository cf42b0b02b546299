"""Loading and validating training data; tokenising SFT rows; a resumable shuffled batch stream.

Three row kinds, from JSONL (one JSON object per line), Parquet, or a directory written by
``datasets.Dataset.save_to_disk``:

- ``"sft"``: ``prompt`` + ``response`` strings, or ``messages`` (a chat: a list of ``{"role", "content"}``
  whose last message is the assistant's reply).
- ``"preference"``: ``prompt``, ``chosen``, ``rejected`` strings (``chosen != rejected``), optional
  numeric ``margin``.
- ``"prompt"``: ``prompt`` string; every other field is kept and reaches reward functions unchanged.

Every problem is a :class:`shifu.errors.DataError` naming the file, the 1-based line (JSONL) or 0-based
row (Parquet / datasets) and the field. With ``skip_bad=True`` bad rows are skipped instead and counted by
reason (``LoadedRows.skipped``); a missing or unreadable file is always an error.

Tokenisation conventions (``encode_sft``, ``encode_prompts``): prompt and response are tokenised
separately without special tokens; EOS is appended to every response that fits; prompts longer than
``max_prompt_len`` are cut from the left (``truncate_left``) or the row is dropped (``drop``), and both are
counted.

Streams: :class:`BatchStream` (shuffled micro-batches, sft/rm/dpo), :class:`PromptStream` (full rollout
batches across epochs, ppo) and :func:`ptx_batches` (PPO-ptx demonstrations), each resumable from a
position.
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

from shifu.config.schema import DataConfig
from shifu.errors import ConfigError, DataError, ShifuError

KINDS = ("sft", "preference", "prompt")


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
            path, None, None, f"is a {Path(path).suffix} table, not JSONL",
            "convert it, e.g. datasets.Dataset.from_csv(path).to_json('data.jsonl'), or save it as Parquet",
        )  # fmt: skip
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
            path, None, None, f"holds one JSON array of {len(value)} items, not one JSON object per line (JSONL)",
            "convert it, e.g. jq -c '.[]' file.json > file.jsonl",
        )  # fmt: skip


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


def _check_text(row: dict, key: str, where: tuple[str, int | None], required: bool = True) -> None:
    path, line = where
    if key not in row or row[key] is None:
        if required:
            raise DataError(path, line, key, "missing field", f"every row needs a '{key}' string")
        return
    value = row[key]
    if not isinstance(value, str):
        raise DataError(path, line, key, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(path, line, key, "empty string", "remove the row or fill in the text")
    _check_unicode(value, path, line, key)


def _check_unicode(value: str, path: str, line: int | None, key: str) -> None:
    """A JSON escape of half a UTF-16 surrogate pair (``"\\ud83d"`` alone) is no character: tokenizers fail
    on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            path, line, key, f"invalid Unicode escape at character {e.start} (a lone surrogate "
            f"\\u{ord(value[e.start]):04x})", "write the character itself, or escape the whole surrogate pair",
        ) from None  # fmt: skip


def _check_messages(row: dict, where: tuple[str, int | None], reply: bool = True) -> None:
    path, line = where
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(path, line, "messages", "expected a non-empty list of {role, content} objects")
    for j, m in enumerate(msgs):
        field = f"messages[{j}]"
        if not isinstance(m, dict):
            raise DataError(path, line, field, f"expected an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise DataError(path, line, f"{field}.{key}", "missing or not a string")
        if not m["content"].strip():
            raise DataError(path, line, f"{field}.content", "empty string")
        _check_unicode(m["content"], path, line, f"{field}.content")
    last = f"messages[{len(msgs) - 1}].role"
    if reply and msgs[-1]["role"] != "assistant":
        raise DataError(
            path, line, last, f"the last message must be the assistant's reply (got '{msgs[-1]['role']}')"
        )
    if not reply and msgs[-1]["role"] == "assistant":
        raise DataError(
            path,
            line,
            last,
            "the last message is the assistant's: a prompt's conversation ends on the user's turn",
        )


def _check_prompt(row: dict, where: tuple[str, int | None]) -> None:
    """A prompt is a ``prompt`` string or a ``messages`` conversation up to the user's turn; with only
    ``messages``, ``prompt`` becomes its last message's text (what reward functions and judges read)."""
    if row.get("messages") is not None:
        _check_messages(row, where, reply=False)
        row.setdefault("prompt", row["messages"][-1]["content"])
        return
    _check_text(row, "prompt", where)


def validate_row(row: Any, kind: str, where: tuple[str, int | None]) -> dict:
    """Check one parsed row of ``kind``; return it (as a dict) or raise DataError."""
    path, line = where
    if not isinstance(row, dict):
        raise DataError(path, line, None, f"expected a JSON object, got {type(row).__name__}")
    if kind == "sft":
        if "messages" in row and row["messages"] is not None:
            _check_messages(row, where)
        else:
            if "prompt" not in row and "response" not in row:
                raise DataError(
                    path,
                    line,
                    "prompt",
                    "missing field",
                    "SFT rows need 'prompt' and 'response', or 'messages'",
                )
            _check_text(row, "prompt", where)
            _check_text(row, "response", where)
    elif kind == "preference":
        _check_prompt(row, where)
        for key in ("chosen", "rejected"):
            _check_text(row, key, where)
        if row["chosen"] == row["rejected"]:
            raise DataError(path, line, "rejected", "chosen == rejected: the pair carries no preference")
        m = row.get("margin")
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)):
            raise DataError(path, line, "margin", f"expected a finite number, got {m!r}")
    elif kind == "prompt":
        _check_prompt(row, where)
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


# --------------------------------------------------------------------------------------------------
# tokenisation


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
    return _render(tokenizer, messages[:-1]), messages[-1]["content"]


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


def sft_texts(tokenizer, row: dict, chat_template: bool = True) -> tuple[str, str]:
    """(prompt, response) text of a validated SFT row (``messages`` rendered by :func:`render_messages`;
    a ``prompt`` string by :func:`prompt_text`)."""
    if row.get("messages") is not None:
        return render_messages(tokenizer, row["messages"])
    return prompt_text(tokenizer, row, chat_template), row["response"]


def encode_sft(
    tokenizer,
    rows: list[dict],
    max_prompt_len: int,
    max_len: int,
    prompt_policy: str = "truncate_left",
    chat_template: bool = True,
) -> tuple[list[dict[str, list[int]]], Counter]:
    """Tokenise SFT rows -> ([{"prompt_ids", "response_ids"}], counts).

    ``response_ids`` end with EOS, except when ``prompt + response + EOS`` exceeds ``max_len``: the response
    is then cut on the right and carries no EOS (it did not end there; teaching the model to stop would be
    wrong). ``counts`` has ``truncated_prompts``, ``dropped_prompts`` and ``truncated_responses``.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no EOS token; SFT appends EOS to every response")
    counts: Counter = Counter()
    out = []
    for row in rows:
        prompt, response = sft_texts(tokenizer, row, chat_template)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [eos]
        if len(p_ids) > max_prompt_len:
            if prompt_policy == "drop":
                counts["dropped_prompts"] += 1
                continue
            p_ids = p_ids[-max_prompt_len:]
            counts["truncated_prompts"] += 1
        room = max_len - len(p_ids)
        if len(r_ids) > room:
            r_ids = r_ids[:room]
            counts["truncated_responses"] += 1
        out.append({"prompt_ids": p_ids, "response_ids": r_ids})
    return out, counts


def encode_reward_pairs(
    scorer, rows: list[dict], max_len: int, max_prompt_len: int, policy: str, chat_template: bool = True
):
    """Preference rows, tokenised as the reward model ``scorer`` scores them (``ScalarModel.encode``) ->
    ([{"chosen", "rejected" (token ids), "margin", "chosen_len", "rejected_len"}], counts)."""
    tok, counts, kept = scorer.tokenizer, {}, []
    for r in rows:
        r = {**r, "prompt_text": prompt_text(tok, r, chat_template) if scorer.is_causal else r["prompt"]}
        if (
            policy == "drop"
            and len(tok(r["prompt_text"], add_special_tokens=False)["input_ids"]) > max_prompt_len
        ):
            counts["dropped_prompts"] = counts.get("dropped_prompts", 0) + 1
        else:
            kept.append(r)
    out = []
    for i in range(0, len(kept), 256):
        chunk = kept[i : i + 256]
        ids = {}
        for side in ("chosen", "rejected"):
            enc = scorer.encode([r["prompt_text"] for r in chunk], [r[side] for r in chunk], max_len)
            ids[side] = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"])]
        for j, r in enumerate(chunk):
            if max(len(ids["chosen"][j]), len(ids["rejected"][j])) >= max_len:
                counts["truncated_pairs"] = counts.get("truncated_pairs", 0) + 1
            out.append(
                {
                    "chosen": ids["chosen"][j],
                    "rejected": ids["rejected"][j],
                    "margin": float(r.get("margin") or 0.0),
                    "chosen_len": len(r["chosen"]),
                    "rejected_len": len(r["rejected"]),
                }
            )
    return out, counts


def collate_sft(examples: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response -> ``input_ids``, ``attention_mask`` (B,T) and ``loss_mask`` (B,T) bool.

    ``loss_mask[b, t]`` is True where token t is a response token (EOS included). The NLL of token t is
    read from the logits at position t-1, so the loss uses ``loss_mask[:, 1:]`` against ``logits[:, :-1]``.
    """
    T = max(len(e["prompt_ids"]) + len(e["response_ids"]) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    for b, e in enumerate(examples):
        P, R = len(e["prompt_ids"]), len(e["response_ids"])
        input_ids[b, : P + R] = torch.tensor(e["prompt_ids"] + e["response_ids"], dtype=torch.long)
        attention_mask[b, : P + R] = 1
        loss_mask[b, P : P + R] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


# --------------------------------------------------------------------------------------------------
# batching


class BatchStream:
    """Endless shuffled micro-batches of indices into ``n`` examples, resumable from ``(epoch, index)``.

    Epoch e's order is ``randperm(n)`` from a dedicated generator seeded with ``seed + e``, so the data
    position is fully described by ``(epoch, index)`` (index = examples of epoch e already served). The
    last batch of an epoch may be smaller; the next batch starts the next epoch.

    With ``lengths`` (each example's padded length), batches are of similar length (:func:`length_grouped`):
    the same examples per epoch, a different order, still a function of ``(seed, epoch)``.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        epoch: int = 0,
        index: int = 0,
        shuffle: bool = True,
        lengths: list[int] | None = None,
    ):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"lengths has {len(lengths)} entries for {n} examples")
        self.lengths = lengths
        self.epoch, self.index = epoch, index
        self._perm = self._order(epoch)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        return perm if self.lengths is None else length_grouped(perm, self.lengths, self.batch_size, g)

    def next(self) -> list[int]:
        if self.index >= self.n:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._order(self.epoch)
        batch = self._perm[self.index : self.index + self.batch_size]
        self.index += len(batch)
        return batch

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def batches_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)


LENGTH_GROUP_BATCHES = 50  # batches per length-sorted chunk of the shuffled order


def length_grouped(perm: list[int], lengths: list[int], batch_size: int, g: torch.Generator) -> list[int]:
    """``perm`` reordered so that each batch holds examples of similar length, the batches in random order.

    The shuffled order is cut into chunks of ``LENGTH_GROUP_BATCHES * batch_size`` examples; each chunk is
    sorted by length (longest first) and cut into batches; all full batches are then shuffled with ``g``
    (the short last batch, if any, stays last). As in Hugging Face's length-grouped sampler, the randomness
    of which examples meet in a batch is kept within a chunk, and padding nearly vanishes.
    """
    chunk = LENGTH_GROUP_BATCHES * batch_size
    batches = []
    for i in range(0, len(perm), chunk):
        part = sorted(perm[i : i + chunk], key=lambda j: -lengths[j])  # stable: ties keep shuffled order
        batches += [part[k : k + batch_size] for k in range(0, len(part), batch_size)]
    tail = [batches.pop()] if batches and len(batches[-1]) < batch_size else []
    order = torch.randperm(len(batches), generator=g).tolist()
    return [j for b in [batches[o] for o in order] + tail for j in b]


class PromptStream:
    """Endless rollout batches of exactly ``batch_size`` prompt indices: epoch e's order is ``randperm(n)``
    seeded with ``seed * 1000 + e``, and a batch that runs past an epoch's end continues into the next, so
    the data position is just ``(epoch, index)``."""

    def __init__(self, n: int, batch_size: int, seed: int, epoch: int = 0, index: int = 0):
        self.n, self.bs, self.seed, self.epoch, self.index = n, batch_size, seed, epoch, index

    def _perm(self) -> list[int]:
        return torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        ).tolist()

    def next(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.bs:
            perm = self._perm()
            take = perm[self.index : self.index + self.bs - len(out)]
            out += take
            self.index += len(take)
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


def split_prompts(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """PPO's held-out prompts when no eval file is given: ``max(1, int(fraction * N))`` rows of a
    ``randperm`` seeded with ``seed`` (in that order), the rest kept in file order -> (train, held_out)."""
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, int(len(rows) * fraction)) if len(rows) > 1 else 0
    return [rows[i] for i in sorted(perm[n_eval:])], [rows[i] for i in perm[:n_eval]]


def encode_prompts(
    tokenizer, rows: list[dict], max_len: int, policy: str, path: str, chat_template: bool = True
) -> tuple[list[list[int]], list[dict], int]:
    """Token ids of each row's :func:`prompt_text` (no special tokens added), over-long ones truncated from the
    left or dropped -> (ids, the rows kept, how many were dropped)."""
    ids, kept, dropped = [], [], 0
    for r in rows:
        x = tokenizer(prompt_text(tokenizer, r, chat_template), add_special_tokens=False)["input_ids"]
        if not x:
            raise ShifuError(f"{path}: a prompt encodes to zero tokens: {r['prompt']!r}")
        if len(x) > max_len:
            if policy == "drop":
                dropped += 1
                continue
            x = x[-max_len:]
        ids.append(x), kept.append(r)
    if not ids:
        raise ShifuError(f"{path}: no prompts left after applying data.max_prompt_len={max_len} ({policy})")
    return ids, kept, dropped


class Counted:
    """An iterator that counts the items it served, so a resumed run skips exactly that many."""

    def __init__(self, it):
        self.it, self.served = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.served += 1
        return next(self.it)


def ptx_batches(
    tokenizer,
    path: str,
    rows_per_batch: int,
    max_prompt_len: int,
    max_new_tokens: int,
    seed: int,
    skip_bad: bool,
    chat_template: bool = True,
) -> Counted:
    """Endless right-padded batches of SFT demonstrations for the PPO-ptx term: ``input_ids``,
    ``attention_mask`` and ``loss_mask`` (True on response tokens and the appended EOS), shuffled by a
    generator seeded with ``seed``; prompts keep their last ``max_prompt_len`` tokens, responses their first
    ``max_new_tokens``."""
    from shifu.models.loading import pad_right

    rows = [sft_texts(tokenizer, r, chat_template) for r in load_rows(path, "sft", skip_bad=skip_bad)]

    def batches():
        gen = torch.Generator().manual_seed(seed)
        while True:
            for i in torch.randperm(len(rows), generator=gen).tolist():
                seqs, masks = [], []
                for prompt, response in (rows[(i + j) % len(rows)] for j in range(rows_per_batch)):
                    p = tokenizer(prompt, add_special_tokens=False)["input_ids"][-max_prompt_len:]
                    r = tokenizer(response, add_special_tokens=False)["input_ids"][:max_new_tokens]
                    seqs.append(p + r + [tokenizer.eos_token_id])
                    masks.append([0] * len(p) + [1] * (len(r) + 1))
                b = pad_right(seqs, tokenizer.pad_token_id)
                b["loss_mask"] = pad_right(masks, 0)["input_ids"]
                yield b

    return Counted(batches())

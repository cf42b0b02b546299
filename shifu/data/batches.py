"""Rows to model inputs: tokenising and collating SFT and preference rows, and the resumable streams of
micro-batches, rollout prompts and PPO-ptx demonstrations.

Tokenisation conventions (``encode_sft``, ``encode_prompts``): no special tokens are added; a demonstration's
ids and the mask of its trained tokens are :func:`shifu.data.demonstrations.encode_demonstration`'s (prompt
and response tokenised separately, EOS appended and trained); prompts longer than ``max_prompt_len`` are cut
from the left (``truncate_left``) or the row is dropped (``drop``), and both are counted.

Streams: :class:`BatchStream` (shuffled micro-batches, sft/rm/dpo), :class:`PromptStream` (full rollout
batches across epochs, ppo) and :func:`ptx_batches` (PPO-ptx demonstrations), each resumable from a
position. The rows come validated from :mod:`shifu.data.rows`.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from shifu.data.demonstrations import encode_demonstration
from shifu.data.rows import load_rows, prompt_text
from shifu.errors import ConfigError, DataError, ShifuError

UNKNOWN_SHARE = 0.05  # a larger share of the tokenizer's unknown token in training text is refused

# --------------------------------------------------------------------------------------------------
# tokenisation


def check_unknown_share(tokenizer, id_lists: list[list[int]], path: str | None) -> None:
    """DataError naming ``path`` when more than ``UNKNOWN_SHARE`` of the tokens of its text are the tokenizer's
    unknown token: the tokenizer cannot spell the text (another script or language), and training on it would
    only teach ``<unk>``. Tokenizers without an unknown token (byte-level BPE) spell everything."""
    unk = tokenizer.unk_token_id
    total = sum(len(x) for x in id_lists)
    if unk is None or path is None or not total:
        return
    share = sum(x.count(unk) for x in id_lists) / total
    if share > UNKNOWN_SHARE:
        raise DataError(
            path,
            None,
            None,
            f"{share:.0%} of its tokens are the tokenizer's unknown token {tokenizer.unk_token!r}: the tokenizer "
            "cannot spell this text",
            "use a model whose tokenizer covers its language and script, or `shifu init-model` to fit one to it",
        )


def encode_sft(
    tokenizer,
    rows: list[dict],
    max_prompt_len: int,
    max_len: int,
    prompt_policy: str = "truncate_left",
    chat_template: bool = True,
) -> tuple[list[dict[str, list[int]]], Counter]:
    """Tokenise SFT rows -> ([{"prompt_ids", "response_ids", "response_mask"}], counts).

    ``response_mask`` (one bool per response id) is True on the tokens trained on (:func:`encode_demonstration`:
    the response segments not marked ``"train": false``, the assistant turns of ``messages``, and EOS).
    ``response_ids`` end with EOS, except when ``prompt + response`` exceeds ``max_len``: the response is then
    cut on the right and carries no EOS (it did not end there; teaching the model to stop would be wrong).
    ``counts`` has ``truncated_prompts``, ``dropped_prompts`` and ``truncated_responses``.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no EOS token; SFT appends EOS to every response")
    counts: Counter = Counter()
    out = []
    for row in rows:
        p_ids, r_ids, r_mask = encode_demonstration(tokenizer, row, chat_template)
        if len(p_ids) > max_prompt_len:
            if prompt_policy == "drop":
                counts["dropped_prompts"] += 1
                continue
            p_ids = p_ids[-max_prompt_len:]
            counts["truncated_prompts"] += 1
        room = max_len - len(p_ids)
        if len(r_ids) > room:
            r_ids, r_mask = r_ids[:room], r_mask[:room]
            counts["truncated_responses"] += 1
        out.append({"prompt_ids": p_ids, "response_ids": r_ids, "response_mask": r_mask})
    check_unknown_share(
        tokenizer, [x["prompt_ids"] + x["response_ids"][:-1] for x in out], getattr(rows, "path", None)
    )
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
    check_unknown_share(tok, [x["chosen"] + x["rejected"] for x in out], getattr(rows, "path", None))
    return out, counts


def trained_tokens(example: dict) -> int:
    """The tokens the NLL of one encoded example sums over: its trained response tokens, less the sequence's
    first token when that is one (no position predicts it)."""
    mask = example["response_mask"]
    return sum(mask) - bool(not example["prompt_ids"] and mask and mask[0])


def collate_sft(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response -> ``input_ids``, ``attention_mask`` (B,T) and ``loss_mask`` (B,T) bool.

    ``loss_mask[b, t]`` is True where token t is a trained response token (``response_mask``, EOS included).
    The NLL of token t is read from the logits at position t-1, so the loss uses ``loss_mask[:, 1:]`` against
    ``logits[:, :-1]``.
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
        loss_mask[b, P : P + R] = torch.tensor(e["response_mask"], dtype=torch.bool)
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
    check_unknown_share(tokenizer, ids, path)
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
    ``attention_mask`` and ``loss_mask`` (1 on the trained response tokens and the closing EOS, as SFT trains
    them: :func:`encode_demonstration`), shuffled by a generator seeded with ``seed``; prompts keep their last
    ``max_prompt_len`` tokens, responses their first ``max_new_tokens`` and then the EOS."""
    from shifu.models.padding import pad_right

    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no EOS token; PPO-ptx appends EOS to every response")
    rows = [
        encode_demonstration(tokenizer, r, chat_template) for r in load_rows(path, "sft", skip_bad=skip_bad)
    ]

    def batches():
        gen = torch.Generator().manual_seed(seed)
        while True:
            for i in torch.randperm(len(rows), generator=gen).tolist():
                seqs, masks = [], []
                for p, r, m in (rows[(i + j) % len(rows)] for j in range(rows_per_batch)):
                    p, body, trained = p[-max_prompt_len:], r[:-1][:max_new_tokens], m[:-1][:max_new_tokens]
                    seqs.append(p + body + r[-1:])  # (r[-1] is the EOS: encode_demonstration ends there)
                    masks.append([0] * len(p) + [int(t) for t in trained] + [1])
                b = pad_right(seqs, tokenizer.pad_token_id)
                b["loss_mask"] = pad_right(masks, 0)["input_ids"]
                yield b

    return Counted(batches())

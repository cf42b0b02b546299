"""``shifu sample MODEL``: generate from a policy, optionally scoring each response with a reward model or
a reward function, to see what the reward model thinks of what the policy says.

``MODEL`` is the run directory of any policy stage (``shifu sft|ppo|dpo --out``: its ``final/`` is used;
a ``shifu quickstart`` run: its last policy, ``soup/final``, ``ppo/final``, ``dpo/final`` then ``sft/final``) or any
local Hugging Face causal-LM directory. Prompts come from ``--prompt`` (repeatable), ``--prompts FILE``
(JSONL rows with ``prompt`` or ``messages``; any other file: one prompt per line) or ``--interactive``
(one prompt per line of standard input until EOF).

When the tokenizer has a chat template, a plain prompt is rendered as one user message with the generation
prompt added (``--no-chat-template`` feeds the text as is); ``messages`` rows are rendered with the
template, or as ``"{role}: {content}\\n" ... "assistant: "`` without one (the SFT stage's plain format).

Generation is shifu's own (:func:`shifu.generation.rollout.generate`, left-padded prompts), the same sampler PPO
uses. Scores come from :class:`shifu.rewards.sources.RewardSource`, exactly as PPO scores a rollout: a causal reward
model that shares the policy's tokenizer scores the token ids, any other re-tokenises the decoded text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from shifu.errors import DataError, ShifuError
from shifu.models.positions import position_limit
from shifu.runs import jsonfile
from shifu.runs.files import resolve_policy


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Prompt rows of a file: ``.jsonl``/``.json`` lines are objects with a ``prompt`` string or a
    ``messages`` list (extra fields reach a reward function); any other file has one prompt per line.
    Blank lines are skipped; bad rows raise :class:`DataError` with the line and field."""
    p = Path(path)
    if not p.is_file():
        raise DataError(
            str(p), None, None, "no such file", "pass a .jsonl file of prompt rows or a text file"
        )
    lines = p.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if p.suffix not in (".jsonl", ".json"):
            rows.append({"prompt": line})
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(str(p), i, None, f"not valid JSON ({e.msg})") from None
        rows.append(_check_row(row, str(p), i))
    if not rows:
        raise DataError(str(p), None, None, "no prompts", "the file is empty")
    return rows


def _check_row(row: Any, path: str, line: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(path, line, None, f"expected a JSON object, got {type(row).__name__}")
    msgs = row.get("messages")
    if msgs is not None:
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not ok:
            raise DataError(path, line, "messages", "expected a non-empty list of {role, content} objects")
        return row
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise DataError(path, line, "prompt", "missing or not a non-empty string", "or give 'messages'")
    return row


def render_prompt(tokenizer, row: dict[str, Any], chat_template: bool = True) -> str:
    """The text the policy continues: a plain prompt as one user turn of the chat template (when the
    tokenizer has one and ``chat_template``), else as is; ``messages`` with the template or plainly."""
    has_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
    msgs = row.get("messages")
    if msgs is None:
        if not has_template:
            return row["prompt"]
        msgs = [{"role": "user", "content": row["prompt"]}]
    if has_template:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "


def prompt_text(row: dict[str, Any]) -> str:
    """The prompt as a reward function sees it: ``prompt``, or the last user message of ``messages``."""
    if row.get("messages") is None:
        return row["prompt"]
    users = [m["content"] for m in row["messages"] if m["role"] == "user"]
    return users[-1] if users else row["messages"][-1]["content"]


def encode(tokenizer, texts: list[str], max_prompt_len: int | None) -> list[list[int]]:
    """Token ids of each rendered prompt, no special tokens added (a chat template writes its own); an
    over-long prompt keeps its last ``max_prompt_len`` tokens."""
    rows = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ShifuError(f"the prompt {t!r} encodes to zero tokens; give some text")
        rows.append(ids[-max_prompt_len:] if max_prompt_len else ids)
    return rows


class Sampler:
    """A loaded policy (and optional scorer) that turns prompt rows into result rows."""

    def __init__(self, args: argparse.Namespace):
        from shifu.generation.rollout import SamplingParams
        from shifu.models.loading import load_causal_lm, load_tokenizer

        self.args = args
        self.policy_dir = resolve_policy(args.model)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tok = load_tokenizer(self.policy_dir)
        self.model = load_causal_lm(self.policy_dir, dropout=False).to(self.device).eval()
        if args.temperature < 0:
            raise ShifuError(f"--temperature must be >= 0 (got {args.temperature}; 0 means greedy)")
        if not 0 < args.top_p <= 1:
            raise ShifuError(f"--top-p must be in (0, 1] (got {args.top_p})")
        if args.max_new_tokens < 1:
            raise ShifuError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
        self.params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature if args.temperature > 0 else 1.0,
            top_k=args.top_k,
            top_p=args.top_p,
            greedy=args.greedy or args.temperature == 0,
        )
        self.max_prompt_len = args.max_prompt_len
        limit = position_limit(self.model)
        if limit is not None:
            room = limit - args.max_new_tokens
            if room < 1:
                raise ShifuError(
                    f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                    f"{limit} positions; lower --max-new-tokens"
                )
            self.max_prompt_len = min(self.max_prompt_len or room, room)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.reward = self._load_reward(args)
        if self.reward is not None and self.reward.model is not None:
            self.reward.model.to(self.device)

    def _load_reward(self, args: argparse.Namespace):
        from shifu.config.imports import load_callable
        from shifu.rewards.sources import RewardSource, load_reward_model

        if args.reward_model:
            return RewardSource(model=load_reward_model(args.reward_model), policy_tokenizer=self.tok)
        if args.reward_function:
            return RewardSource(
                function=load_callable(args.reward_function, "--reward-function"), policy_tokenizer=self.tok
            )
        return None

    @torch.no_grad()
    def run(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One result per (row, sample): prompt, rendered prompt, response, token count, whether the
        response ended with EOS, and the score when a scorer is loaded."""
        from shifu.generation.rollout import decode_responses, generate
        from shifu.models.padding import pad_left

        rows = [r for r in rows for _ in range(self.args.num_samples)]
        out = []
        for i in range(0, len(rows), self.args.batch_size):
            part = rows[i : i + self.args.batch_size]
            rendered = [render_prompt(self.tok, r, not self.args.no_chat_template) for r in part]
            enc = pad_left(encode(self.tok, rendered, self.max_prompt_len), self.tok.pad_token_id)
            pids, pmask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
            rids, rmask = generate(
                self.model,
                pids,
                pmask,
                self.params,
                self.tok.eos_token_id,
                self.tok.pad_token_id,
                generator=self.generator,
            )
            texts = decode_responses(self.tok, rids, rmask)
            finished = [
                bool(m.any()) and int(ids[m][-1]) == self.tok.eos_token_id for ids, m in zip(rids, rmask)
            ]
            results = [
                {
                    "prompt": prompt_text(r),
                    "rendered_prompt": t,
                    "response": y,
                    "response_tokens": int(m.sum()),
                    "finished": f,
                }
                for r, t, y, m, f in zip(part, rendered, texts, rmask, finished)
            ]
            if self.reward is not None:
                full = torch.cat([pids, rids], 1)
                mask = torch.cat([pmask, rmask.long()], 1)
                scores = self.reward([x["prompt"] for x in results], texts, part, full, mask)
                for x, s in zip(results, scores.tolist()):
                    x["score"] = s
            out += results
        return out


def format_result(i: int, r: dict[str, Any]) -> str:
    """A result for the terminal: the prompt, then the response with its length and score."""
    info = f"{r['response_tokens']} tokens" + ("" if r["finished"] else ", no EOS")
    if "score" in r:
        info += f", score {r['score']:.4f}"
    return f"### {i} prompt\n{r['prompt']}\n### response ({info})\n{r['response']}\n"


def stdin_prompts(stream: TextIO, show_prompt: bool) -> Iterator[dict[str, Any]]:
    """One prompt row per non-blank line of ``stream`` until EOF (``> `` on stderr at a terminal). Lines
    are read one at a time, so each prompt is answered before the next is asked for."""
    while True:
        if show_prompt:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line:
            return
        if line.strip():
            yield {"prompt": line.rstrip("\n")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shifu sample",
        description="generate from a policy (any stage's run directory or a local HF model), optionally "
        "scoring each response with a reward model or a reward function",
    )
    p.add_argument("model", help="run directory of shifu sft/ppo/dpo/quickstart, or a local HF model dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument(
        "--prompts", metavar="FILE", help="JSONL rows with 'prompt' or 'messages', or text lines"
    )
    src.add_argument("--interactive", action="store_true", help="read prompts from stdin, one per line")
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature (default 0.7; 0: greedy)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    p.add_argument("--max-new-tokens", type=int, default=64, help="response length limit (default 64)")
    p.add_argument("--max-prompt-len", type=int, default=None, help="keep each prompt's last N tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0): same seed, same responses")
    p.add_argument("-n", "--num-samples", type=int, default=1, help="responses per prompt (default 1)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts generated together (default 16)")
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="feed prompts as is even if the tokenizer has a template",
    )
    score = p.add_mutually_exclusive_group()
    score.add_argument(
        "--reward-model", metavar="DIR", help="score with a `shifu rm` run or final/ directory"
    )
    score.add_argument(
        "--reward-function", metavar="PKG.MOD:FN", help="score with fn(prompts, responses, rows)"
    )
    p.add_argument("--out", metavar="FILE.jsonl", help="also write one JSON row per response")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: SHIFU_THREADS)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``shifu sample MODEL (--prompt TEXT | --prompts FILE | --interactive) [options]``."""
    from shifu.parallel.threads import set_threads

    args = parser().parse_args(argv)
    if args.num_samples < 1 or args.batch_size < 1:
        raise ShifuError("--num-samples and --batch-size must be >= 1")
    set_threads(args.threads)
    rows = read_prompts(args.prompts) if args.prompts else [{"prompt": t} for t in args.prompt or []]
    sampler = Sampler(args)
    print(f"shifu sample: policy {sampler.policy_dir}", file=sys.stderr)
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115
    try:
        batches: Iterable[list[dict[str, Any]]]
        if args.interactive:  # one prompt at a time, answered before the next line is read
            batches = ([r] for r in stdin_prompts(sys.stdin, sys.stdin.isatty()))
        else:
            batches = [rows]
        n, scores = 0, []
        for batch in batches:
            results = sampler.run(batch)
            k = args.num_samples  # each prompt's samples are consecutive
            if sampler.reward is not None:
                scores += [[r["score"] for r in results[i : i + k]] for i in range(0, len(results), k)]
            for r in results:
                n += 1
                print(format_result(n, r), flush=True)
                if out is not None:
                    out.write(jsonfile.dumps(r, ensure_ascii=False) + "\n")
                    out.flush()
    finally:
        if out is not None:
            out.close()
    if sampler.reward is not None and n:
        print(score_line(scores, args), flush=True)
    if out is not None:
        print(f"shifu sample: wrote {n} responses to {args.out}", file=sys.stderr)
    return 0


def score_line(scores: list[list[float]], args: argparse.Namespace) -> str:
    """The mean score ± its standard error over the prompts (``scores``: each prompt's samples; with several
    samples a prompt counts once, by its mean: the prompts are what is drawn independently); non-finite
    scores left out, and said."""
    import math

    from shifu.core.stats import mean_se

    finite = [[x for x in row if math.isfinite(x)] for row in scores]
    per_prompt = [sum(row) / len(row) for row in finite if row]
    dropped = sum(len(row) for row in scores) - sum(len(row) for row in finite)
    judge = (
        f"reward model {args.reward_model}"
        if args.reward_model
        else f"reward function {args.reward_function}"
    )
    if not per_prompt:
        return f"### mean score: none of the {sum(map(len, scores))} scores is finite ({judge})"
    mean, se = mean_se(per_prompt)
    each = f", each the mean of its {args.num_samples} responses" if args.num_samples > 1 else ""
    text = f"### mean score {mean:.4f}" + (f" ± {se:.4f} (standard error)" if se is not None else "")
    text += f" over {len(per_prompt)} prompts{each} ({judge})"
    return text + (f"; {dropped} non-finite scores left out" if dropped else "")


if __name__ == "__main__":
    raise SystemExit(main())

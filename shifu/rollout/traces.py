"""A run's episodes as records, and as ATIF: ``shifu traces export RUN --format atif --out FILE``.

**Recording.** With ``traces.episodes=true`` (or ``traces.atif=true``) every rollout of a PPO run appends one
record per trajectory to ``RUN/episodes/rank-R.jsonl`` (R: the process's rank), whatever made it (single-turn
responses, episodes with an environment, an agent's calls on the gateway): the iteration, the prompt row's
``prompt``, the first input's ids and text, then per turn the ids the policy sampled with their log-probs (the
sampler's own; else the trainer's forward at logits / T, the same in fp32), the text, the tool calls parsed from
it in the model's syntax (:func:`shifu.models.tool_calls.parse_tool_calls`), the turn's reward, and the ids and
text of what the policy read after it (an observation, a tool's result, the template's turn change); and the
episode's return and whether it was truncated or failed. Records are plain JSON: exporting needs no model.

**ATIF.** Harbor's Agent Trajectory Interchange Format (:data:`ATIF_VERSION`): one trajectory document per
record, one per line of the exported JSON Lines file. Step 1 (``source: "user"``) is the first input as the
policy read it (its ids in ``extra.token_ids``); then one ``source: "agent"`` step per turn: ``message`` its
text without special tokens and without the tool calls, ``tool_calls``, ``metrics`` with the turn's context as
``prompt_token_ids`` (the first input and every id before the turn), ``completion_token_ids`` and ``logprobs``,
``observation`` what the policy read after the turn (its ids in the result's ``extra.token_ids``; linked to the
call by ``source_call_id`` when the turn made exactly one) and ``extra.reward`` the turn's reward. The return,
truncation and failure are the document's ``extra``. ATIF has no field for rewards: ``extra`` is its place for
what a producer adds.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from torch import Tensor

import shifu
from shifu.errors import ShifuError
from shifu.models.tool_calls import parse_tool_calls, tool_format
from shifu.rollout.batch import Trajectories
from shifu.runs.jsonfile import dumps, keep_rows, read_jsonl

ATIF_VERSION = "ATIF-v1.8"  # the newest schema of harbor 0.25.0's models
EPISODES_DIR = "episodes"  # RUN/episodes/rank-R.jsonl (records), RUN/episodes/atif-rank-R.jsonl (ATIF)
FORMATS = ("atif",)


def _syntax(tokenizer) -> str:
    """The syntax the policy writes tool calls in (Hermes without a chat template)."""
    return tool_format(tokenizer).syntax if getattr(tokenizer, "chat_template", None) else "hermes"


def _turns(ids: list[int], trainable: list[bool], ends: list[bool]) -> list[tuple[int, int, int]]:
    """``(start, end, read_end)`` per turn of one trajectory's ids after its first input: the turn's sampled
    tokens ``[start, end)`` (a turn ends at a ``turn_ends`` token, or where its sampled run stops) and what the
    policy read after it, ``[end, read_end)``, up to the next turn."""
    out, k, n = [], 0, len(ids)
    while k < n:
        if not trainable[k]:
            k += 1
            continue
        start = k
        while k < n and trainable[k] and not ends[k]:
            k += 1
        end = min(k + 1, n) if k < n and ends[k] else k
        k = end
        while k < n and not trainable[k]:
            k += 1
        out.append((start, end, k))
    return out


def _log_probs(values: list[float]) -> list[float] | None:
    """The log-probs of a turn, or None when one is not finite (ATIF's list holds numbers only)."""
    return values if all(math.isfinite(v) for v in values) else None


def episode_records(
    t: Trajectories, tokenizer, log_probs: Tensor | None, iteration: int | None, source: str
) -> list[dict[str, Any]]:
    """One record per trajectory of ``t`` (module docstring); ``log_probs``: ``(B, R)`` per sampled token, else
    ``t.log_probs``."""
    lp = t.log_probs if t.log_probs is not None else log_probs
    syntax, out = _syntax(tokenizer), []
    ends = t.turn_ends if t.turn_ends is not None else t.trainable & ~t.trainable.roll(-1, dims=1)
    for i in range(len(t)):
        real = t.attention[i].tolist()
        n = len(real) - real[::-1].index(True) if any(real) else 0
        ids, trainable = t.ids[i, :n].tolist(), t.trainable[i, :n].tolist()
        first = t.prompt_ids[i][t.prompt_mask[i].bool()].tolist()
        row_lp = lp[i, :n].float().tolist() if lp is not None else None
        turns = []
        for start, end, read_end in _turns(ids, trainable, ends[i, :n].tolist()):
            sampled = ids[start:end]
            content, calls = parse_tool_calls(tokenizer.decode(sampled, skip_special_tokens=True), syntax)
            turns.append(
                {
                    "ids": sampled,
                    "log_probs": _log_probs(row_lp[start:end]) if row_lp is not None else None,
                    "text": tokenizer.decode(sampled),
                    "content": content or "",
                    "tool_calls": calls,
                    "reward": float(t.rewards[i, start:end].sum()),
                    "read_ids": ids[end:read_end],
                    "read": tokenizer.decode(ids[end:read_end]),
                }
            )
        out.append(
            {
                "iteration": iteration,
                "source": source,
                "prompt": t.rows[i].get("prompt") if isinstance(t.rows[i], dict) else None,
                "input_ids": first,
                "input": tokenizer.decode(first),
                "turns": turns,
                "return": float(t.returns[i]),
                "truncated": bool(t.truncated[i]),
                "failed": bool(t.failed[i]),
            }
        )
    return out


def _tool_call(call: dict, k: int, prefix: str) -> dict[str, Any]:
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"_raw": args}
    return {
        "tool_call_id": call.get("id") or f"{prefix}-call-{k}",
        "function_name": fn["name"],
        "arguments": args if isinstance(args, dict) else {"_value": args},
    }


def _agent_step(step_id: int, turn: dict, context: list[int], model: str | None, prefix: str) -> dict:
    """A turn as an ATIF agent step (module docstring); ``context``: every id the policy read before it."""
    calls = [_tool_call(c, k, f"{prefix}-{step_id}") for k, c in enumerate(turn["tool_calls"])]
    metrics = {
        "prompt_tokens": len(context),
        "completion_tokens": len(turn["ids"]),
        "prompt_token_ids": context,
        "completion_token_ids": turn["ids"],
    }
    if turn["log_probs"] is not None:
        metrics["logprobs"] = turn["log_probs"]
    step = {
        "step_id": step_id,
        "source": "agent",
        "message": turn["content"],
        "metrics": metrics,
        "llm_call_count": 1,
        "extra": {"reward": turn["reward"], "text": turn["text"]},
    }
    if model:
        step["model_name"] = model
    if calls:
        step["tool_calls"] = calls
    if turn["read_ids"]:
        result = {"content": turn["read"], "extra": {"token_ids": turn["read_ids"]}}
        if len(calls) == 1:
            result["source_call_id"] = calls[0]["tool_call_id"]
        step["observation"] = {"results": [result]}
    return step


def atif_trajectory(record: dict, trajectory_id: str, session_id: str, model: str | None) -> dict[str, Any]:
    """One record (:func:`episode_records`) as an ATIF trajectory document (module docstring)."""
    steps: list[dict[str, Any]] = [
        {
            "step_id": 1,
            "source": "user",
            "message": record["input"],
            "extra": {"token_ids": record["input_ids"], "prompt": record["prompt"]},
        }
    ]
    context = list(record["input_ids"])
    for turn in record["turns"]:
        steps.append(_agent_step(len(steps) + 1, turn, list(context), model, trajectory_id))
        context += turn["ids"] + turn["read_ids"]
    agent: dict[str, Any] = {
        "name": "shifu",
        "version": shifu.__version__,
        "extra": {"source": record["source"]},
    }
    if model:
        agent["model_name"] = model
    summary = {k: record[k] for k in ("return", "truncated", "failed", "iteration")}
    return {
        "schema_version": ATIF_VERSION,
        "session_id": session_id,
        "trajectory_id": trajectory_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(s["metrics"]["prompt_tokens"] for s in steps[1:]),
            "total_completion_tokens": sum(len(t["ids"]) for t in record["turns"]),
            "total_steps": len(steps),
        },
        "extra": summary,
    }


class TraceWriter:
    """Appends a run's rollouts to ``RUN/episodes/`` as records and, with ``atif``, as ATIF documents: this
    rank's files only (each rank records its own trajectories)."""

    def __init__(self, run_dir: str | Path, rank: int, tokenizer, model: str | None, atif: bool):
        self.dir = Path(run_dir) / EPISODES_DIR
        self.records = self.dir / f"rank-{rank}.jsonl"
        self.atif = self.dir / f"atif-rank-{rank}.jsonl" if atif else None
        self.tokenizer, self.model, self.rank = tokenizer, model, rank
        self.session = Path(run_dir).name

    def write(self, t: Trajectories, log_probs: Tensor | None, iteration: int | None, source: str) -> None:
        records = episode_records(t.to("cpu"), self.tokenizer, log_probs, iteration, source)
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.records, "a", encoding="utf-8") as f:
            f.writelines(dumps(r) + "\n" for r in records)
        if self.atif is not None:
            with open(self.atif, "a", encoding="utf-8") as f:
                for k, r in enumerate(records):
                    name = f"{self.session}-it{iteration}-rank{self.rank}-{k}"
                    f.write(dumps(atif_trajectory(r, name, self.session, self.model)) + "\n")


def trim(run_dir: str | Path, rank: int, last_iteration: int) -> None:
    """Resuming: drop what this rank recorded after ``last_iteration`` (an interrupted run's later rollouts)."""

    def kept(row: dict) -> bool:
        it = row["iteration"] if "iteration" in row else row.get("extra", {}).get("iteration")
        return it is None or it <= last_iteration

    for path in (Path(run_dir) / EPISODES_DIR).glob(f"*rank-{rank}.jsonl"):
        keep_rows(path, kept)


def _run_model(run: Path) -> str | None:
    """The policy a run started from, as its config names it (the model's directory name)."""
    try:
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, ValueError):
        return None
    path = (cfg.get("model") or {}).get("path")
    return Path(path).name if isinstance(path, str) and path else None


def read_records(run: str | Path) -> list[tuple[str, int, dict]]:
    """Every record of the run directory ``run`` as ``(file name, index in it, record)``, ranks in order; a
    :class:`ShifuError` saying how to record them when the run recorded none."""
    run = Path(run)
    if not run.is_dir():
        raise ShifuError(f"{run}: no such run directory")
    files = sorted((run / EPISODES_DIR).glob("rank-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
    out = [(p.stem, k, r) for p in files for k, r in enumerate(read_jsonl(p))]
    if not out:
        raise ShifuError(
            f"{run}: the run recorded no episodes ({EPISODES_DIR}/rank-*.jsonl is missing or empty); run "
            "shifu ppo with traces.episodes=true (or traces.atif=true) to record them"
        )
    return out


def export(run: str | Path, fmt: str, out: str | Path) -> int:
    """Write the episodes ``run`` recorded to ``out`` in ``fmt`` (``atif``: one trajectory document per line);
    returns how many."""
    if fmt not in FORMATS:
        raise ShifuError(f"--format {fmt}: unknown format; the formats are {', '.join(FORMATS)}")
    run = Path(run)
    records, model = read_records(run), _run_model(run)
    docs = [
        atif_trajectory(r, f"{run.name}-it{r['iteration']}-{name}-{k}", run.name, model)
        for name, k, r in records
    ]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(dumps(d) + "\n" for d in docs), encoding="utf-8")
    return len(docs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shifu traces", description="a run's recorded episodes, exported")
    sub = p.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export", help="write a run's recorded episodes in an interchange format")
    ex.add_argument("run", help="the run directory (shifu ppo --out DIR, with traces.episodes=true)")
    ex.add_argument("--format", default="atif", choices=FORMATS, help="atif: Harbor's ATIF, one per line")
    ex.add_argument("--out", required=True, help="the file to write (JSON Lines)")
    args = p.parse_args(argv)
    n = export(args.run, args.format, args.out)
    print(f"shifu traces: {n} trajectories written to {args.out} ({ATIF_VERSION})")
    return 0

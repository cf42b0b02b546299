"""Built-in tasks (``arith``, ``arith_tool``, ``arith_chain``, ``imdb``) and the helpers they share for sampling
and evaluation.

A task module exposes ``PRESETS``, ``prepare(out_dir, preset, seed) -> dict[str, str]`` (paths of its data
files, ``tokenizer`` and ``base`` model dirs) and its judges in :mod:`shifu.tasks.judges`.

Helpers here work on any local causal LM and its tokenizer:

- :func:`sample_responses`: decoded responses (text after the prompt, up to but excluding EOS), the samples of
  preference pairs (evaluations go through :func:`shifu.evaluation.evaluate.evaluate`);
- :func:`link_pretrained`: a task's ``base/`` and ``tokenizer/`` for a converted pretrained model, without
  copying its weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shifu.models.positions import position_limit

TASKS = ("imdb", "arith", "arith_tool", "arith_chain")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".index.json")


def link_pretrained(src, out) -> None:
    """``out/base`` as a symbolic link to the model directory ``src`` (the cached conversion: its weights
    exist once on disk, whatever the number of runs), ``out/tokenizer`` a copy of its tokenizer files
    only (no weights). Nothing ever writes into ``base/``; deleting a run (``rm -r``, ``--overwrite``, a
    stage that starts again) removes the link, never the cache it points to. Where links cannot be made
    (some filesystems), the directory is copied as before."""
    import os
    import shutil
    from pathlib import Path

    src, out = Path(src).resolve(), Path(out)
    base, tok = out / "base", out / "tokenizer"
    for p in (base, tok):
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            shutil.rmtree(p)
    try:
        os.symlink(src, base, target_is_directory=True)
    except OSError:
        shutil.copytree(src, base)
    tok.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, tok / f.name)


def sample_responses(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
    greedy: bool = False,
    on_batch: Callable[[int], object] | None = None,
) -> list[str]:
    """Decoded sampled (or greedy) responses, one per prompt, in order: each prompt as a user message through
    the chat template when the tokenizer has one, cut to leave room for the response in the model's positions
    (:func:`shifu.models.positions.position_limit`); ``on_batch(n)`` (a progress bar's ``update``) after each batch."""
    from shifu.evaluation.evaluate import encode_prompts, prompt_batches
    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.sources import Policy, SingleTurn

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy)
    n_positions = position_limit(model)
    room = n_positions - max_new_tokens if n_positions is not None else None
    rows = [{"prompt": p} for p in prompts]
    policy, source, texts = Policy(model, tokenizer), SingleTurn(None), []
    for batch in prompt_batches(tokenizer, rows, encode_prompts(tokenizer, rows, room, True), batch_size):
        with torch.no_grad():
            texts += [t.response for t in source.collect(policy, batch, params, generator).transcripts]
        if on_batch is not None:
            on_batch(len(batch.rows))
    return texts

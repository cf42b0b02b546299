"""Built-in tasks (``arith``, ``arith_tool``, ``imdb``) and the helpers they share for sampling and evaluation.

A task module exposes ``PRESETS``, ``prepare(out_dir, preset, seed) -> dict[str, str]`` (paths of its data
files, ``tokenizer`` and ``base`` model dirs) and its judges in :mod:`shifu.tasks.judges`.

Helpers here work on any local causal LM and its tokenizer (left-padded prompts, the rollout engine's
conventions):

- :func:`sample_responses`: decoded responses (text after the prompt, up to but excluding EOS);
- :func:`evaluate_policy`: responses, their token ids and masks, and per-response sums of log-probs;
- :func:`link_pretrained`: a task's ``base/`` and ``tokenizer/`` for a converted pretrained model, without
  copying its weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TASKS = ("imdb", "arith", "arith_tool")
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


def encode_prompts(
    tokenizer, prompts: list[str], max_prompt_len: int | None = None, chat_template: bool = True
) -> dict[str, torch.Tensor]:
    """Left-padded prompt ids (B, P) without special tokens (the SFT convention: prompt ids + response ids).

    ``max_prompt_len`` keeps each prompt's last tokens (the trainers' ``truncate_left``), so prompt +
    response fits the model's positions exactly as in training.
    """
    from shifu.data.rows import prompt_text
    from shifu.models.padding import pad_left

    # as the trainers prompt: a user message through the chat template when the tokenizer has one (and the
    # run's data.chat_template is on)
    rows = [
        tokenizer(prompt_text(tokenizer, {"prompt": p}, chat_template), add_special_tokens=False)["input_ids"]
        for p in prompts
    ]
    if max_prompt_len:
        rows = [r[-max_prompt_len:] for r in rows]
    return pad_left(rows, tokenizer.pad_token_id)


@torch.no_grad()
def generate_batches(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    batch_size: int = 64,
    greedy: bool = False,
    max_prompt_len: int | None = None,
    chat_template: bool = True,
    on_batch: Callable[[int], object] | None = None,
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Per batch of prompts: (left-padded prompt tensors, response_ids (B,R), response_mask (B,R)).
    ``on_batch(n)`` (e.g. a progress bar's ``update``) is called after each batch with its number of prompts."""
    from shifu.generation.rollout import SamplingParams, generate

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy)
    # a model with learned positions (GPT-2: n_positions) fits prompt + response: keep the prompt's tail
    n_positions = getattr(model.config, "n_positions", None)
    if n_positions is not None:
        room = n_positions - max_new_tokens
        max_prompt_len = room if max_prompt_len is None else min(max_prompt_len, room)
    out = []
    for i in range(0, len(prompts), batch_size):
        enc = encode_prompts(tokenizer, prompts[i : i + batch_size], max_prompt_len, chat_template)
        ids, mask = generate(
            model,
            enc["input_ids"],
            enc["attention_mask"],
            params,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=generator,
        )
        out.append((enc, ids, mask))
        if on_batch is not None:
            on_batch(ids.shape[0])
    return out


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
    """Decoded sampled (or greedy) responses, one per prompt, in order (``on_batch``: as
    :func:`generate_batches`)."""
    from shifu.generation.rollout import decode_responses

    texts: list[str] = []
    for _, ids, mask in generate_batches(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        temperature,
        generator,
        batch_size,
        greedy,
        on_batch=on_batch,
    ):
        texts.extend(decode_responses(tokenizer, ids, mask))
    return texts


@torch.no_grad()
def response_kl(
    model,
    ref,
    enc: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    T: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,), (B,): the k1 and k3 estimates of KL(pi || pi_ref) per response (nats), summed over its real
    tokens, with both models' logits divided by T; k3 = (r - 1) - log r >= 0, r = pi_ref / pi per token."""
    from shifu.core import kl_estimate, masked_sum
    from shifu.generation.rollout import policy_forward

    input_ids = torch.cat([enc["input_ids"], response_ids], dim=1)
    attn = torch.cat([enc["attention_mask"], response_mask.long()], dim=1)
    P = enc["input_ids"].shape[1]
    lp, lp_ref = (policy_forward(m, input_ids, attn, P, temperature=T)[0] for m in (model, ref))  # (B, R)
    k1 = masked_sum(kl_estimate(lp, lp_ref, "k1"), response_mask, dim=1)
    return k1, masked_sum(kl_estimate(lp, lp_ref, "k3"), response_mask, dim=1)


def evaluate_policy(
    policy_dir: str,
    reference_dir: str | None,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 64,
    greedy: bool = False,
    max_prompt_len: int | None = None,
    chat_template: bool = True,
    on_batch: Callable[[int], object] | None = None,
) -> dict:
    """Sample one response per prompt from ``policy_dir`` and measure the KL to ``reference_dir``.

    Returns ``responses`` (decoded), ``kl`` (list, nats per response: sum over the response's real
    tokens of ``log pi(a_t|s_t) - log pi_ref(a_t|s_t)``, both at temperature T, on the policy's own
    samples, i.e. the k1 estimate of KL(pi || pi_ref) per response), ``kl_k3`` (the k3 estimate, never
    negative: :func:`response_kl`) and ``lengths`` (real tokens, EOS included). ``kl`` and ``kl_k3`` are
    None without a reference. ``max_prompt_len`` keeps each prompt's last tokens; ``chat_template`` as
    the run's ``data.chat_template`` (prompts rendered as PPO rendered them). ``on_batch(n)`` is called
    after each batch of ``n`` prompts is sampled (a progress bar's ``update``).
    """
    from shifu.generation.rollout import decode_responses
    from shifu.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).eval()
    ref = load_causal_lm(reference_dir, dropout=False).eval() if reference_dir else None
    gen = torch.Generator().manual_seed(seed)
    responses: list[str] = []
    kl: list[float] = []
    kl_k3: list[float] = []
    lengths: list[int] = []
    for enc, ids, mask in generate_batches(
        model,
        tok,
        prompts,
        max_new_tokens,
        temperature,
        gen,
        batch_size,
        greedy,
        max_prompt_len,
        chat_template,
        on_batch,
    ):
        responses.extend(decode_responses(tok, ids, mask))
        lengths.extend(mask.sum(1).tolist())
        if ref is not None and ids.shape[1] > 0:
            k1, k3 = response_kl(model, ref, enc, ids, mask, temperature)
            kl.extend(k1.tolist()), kl_k3.extend(k3.tolist())
        elif ref is not None:
            kl.extend([0.0] * ids.shape[0]), kl_k3.extend([0.0] * ids.shape[0])
    with_ref = ref is not None
    return {
        "responses": responses,
        "kl": kl if with_ref else None,
        "kl_k3": kl_k3 if with_ref else None,
        "lengths": lengths,
    }

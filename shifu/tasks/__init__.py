"""Built-in tasks (``arith``, ``imdb``) and the helpers they share for sampling and evaluation.

A task module exposes ``PRESETS``, ``prepare(out_dir, preset, seed) -> dict[str, str]`` (paths of its data
files, ``tokenizer`` and ``base`` model dirs) and its judges in :mod:`shifu.tasks.judges`.

Helpers here work on any local causal LM and its tokenizer (left-padded prompts, the rollout engine's
conventions):

- :func:`sample_responses`: decoded responses (text after the prompt, up to but excluding EOS);
- :func:`evaluate_policy`: responses, their token ids and masks, and per-response sums of log-probs.
"""

from __future__ import annotations

import torch

TASKS = ("imdb", "arith")


def encode_prompts(
    tokenizer, prompts: list[str], max_prompt_len: int | None = None
) -> dict[str, torch.Tensor]:
    """Left-padded prompt ids (B, P) without special tokens (the SFT convention: prompt ids + response ids).

    ``max_prompt_len`` keeps each prompt's last tokens (the trainers' ``truncate_left``), so prompt +
    response fits the model's positions exactly as in training.
    """
    from shifu.models import pad_left

    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if max_prompt_len:
        rows = [r[-max_prompt_len:] for r in rows]
    return pad_left(rows, tokenizer.pad_token_id)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of each response: its real tokens minus a final EOS (EOS ends the response, it is not text)."""
    out = []
    for ids, mask in zip(response_ids.tolist(), response_mask.tolist()):
        real = [t for t, m in zip(ids, mask) if m]
        if real and real[-1] == tokenizer.eos_token_id:
            real = real[:-1]
        out.append(tokenizer.decode(real, skip_special_tokens=True))
    return out


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
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Per batch of prompts: (left-padded prompt tensors, response_ids (B,R), response_mask (B,R))."""
    from shifu.rollout import SamplingParams, generate

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy)
    # a model with learned positions (GPT-2: n_positions) fits prompt + response: keep the prompt's tail
    n_positions = getattr(model.config, "n_positions", None)
    if n_positions is not None:
        room = n_positions - max_new_tokens
        max_prompt_len = room if max_prompt_len is None else min(max_prompt_len, room)
    out = []
    for i in range(0, len(prompts), batch_size):
        enc = encode_prompts(tokenizer, prompts[i : i + batch_size], max_prompt_len)
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
) -> list[str]:
    """Decoded sampled (or greedy) responses, one per prompt, in order."""
    texts: list[str] = []
    for _, ids, mask in generate_batches(
        model, tokenizer, prompts, max_new_tokens, temperature, generator, batch_size, greedy
    ):
        texts.extend(decode_responses(tokenizer, ids, mask))
    return texts


@torch.no_grad()
def response_log_prob_sums(
    models: list,
    enc: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
) -> list[torch.Tensor]:
    """For each model: (B,) sum over real response tokens of log pi(a_t | s_t), logits divided by T."""
    from shifu.rollout import policy_forward

    input_ids = torch.cat([enc["input_ids"], response_ids], dim=1)
    attn = torch.cat([enc["attention_mask"], response_mask.long()], dim=1)
    P = enc["input_ids"].shape[1]
    sums = []
    for m in models:
        log_probs, _, _ = policy_forward(m, input_ids, attn, P, temperature=temperature)  # (B, R)
        sums.append((log_probs * response_mask).sum(dim=1))
    return sums


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
) -> dict:
    """Sample one response per prompt from ``policy_dir`` and measure the KL to ``reference_dir``.

    Returns ``responses`` (decoded), ``kl`` (list, nats per response: sum over the response's real
    tokens of ``log pi(a_t|s_t) - log pi_ref(a_t|s_t)``, both at temperature T, on the policy's own
    samples, i.e. the k1 estimate of KL(pi || pi_ref) per response) and ``lengths`` (real tokens,
    EOS included). ``kl`` is None without a reference. ``max_prompt_len`` keeps each prompt's last tokens.
    """
    from shifu.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir, dropout=False).eval()
    ref = load_causal_lm(reference_dir, dropout=False).eval() if reference_dir else None
    gen = torch.Generator().manual_seed(seed)
    responses: list[str] = []
    kl: list[float] = []
    lengths: list[int] = []
    for enc, ids, mask in generate_batches(
        model, tok, prompts, max_new_tokens, temperature, gen, batch_size, greedy, max_prompt_len
    ):
        responses.extend(decode_responses(tok, ids, mask))
        lengths.extend(mask.sum(1).tolist())
        if ref is not None and ids.shape[1] > 0:
            lp, lp_ref = response_log_prob_sums([model, ref], enc, ids, mask, temperature)
            kl.extend((lp - lp_ref).tolist())
        elif ref is not None:
            kl.extend([0.0] * ids.shape[0])
    return {"responses": responses, "kl": kl if ref is not None else None, "lengths": lengths}

"""``shifu rm``'s normalisation fit after training (``normalize.responses`` or ``normalize.policy``): the
rows or policy samples whose scores each member's gain and bias map to mean 0 and std 1."""

from __future__ import annotations

import random
import sys

import torch

from shifu.config.schema import RMConfig
from shifu.data.rows import prompt_text, sft_texts
from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.models.padding import pad_left
from shifu.models.scalar import ScalarModel


@torch.no_grad()
def sample_policy(cfg: RMConfig, rows: list[dict], device) -> list[str]:
    """Responses of ``normalize.policy`` to the prompts of ``rows`` (:func:`shifu.data.rows.prompt_text`): HF
    ``generate`` on left-padded prompts."""
    n = cfg.normalize
    tok = load_tokenizer(n.policy)
    policy = load_causal_lm(n.policy, dropout=False).to(device).eval()
    torch.manual_seed(cfg.seed)
    out = []
    for i in range(0, len(rows), n.batch_size):
        texts = [prompt_text(tok, r, cfg.data.chat_template) for r in rows[i : i + n.batch_size]]
        ids = [tok(t, add_special_tokens=False)["input_ids"][-cfg.data.max_prompt_len :] for t in texts]
        batch = pad_left(ids, tok.pad_token_id)
        gen = policy.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            do_sample=True,
            temperature=n.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        out += tok.batch_decode(gen[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def normalisation_rows(rows: list[dict], max_rows: int, seed: int) -> list[dict]:
    """``max_rows`` of ``rows`` drawn without replacement with ``seed``, in file order (all for 0 or more
    than there are). A mean and a std need ~1000 scores (the std to ~2 %), not every sample of a file."""
    if max_rows <= 0 or max_rows >= len(rows):
        return rows
    keep = sorted(random.Random(seed).sample(range(len(rows)), max_rows))
    return [rows[i] for i in keep]


def normalise(
    cfg: RMConfig, members: list[ScalarModel], norm_rows: list[dict], train_rows: list[dict], device
):
    """Each member's gain and bias fitted so that its scores of the normalisation set have mean 0 and std 1:
    the ``normalize.responses`` rows, or ``normalize.policy``'s samples on the first training prompts."""
    scorer, chat = members[0], cfg.data.chat_template
    if cfg.normalize.responses:
        pairs = [sft_texts(scorer.tokenizer, r, chat) for r in norm_rows]
        prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
    else:
        rows = train_rows[: cfg.normalize.num_prompts]
        responses = sample_policy(cfg, rows, device)  # (the prompts as encode_reward_pairs saw them)
        prompts = [prompt_text(scorer.tokenizer, r, chat) if scorer.is_causal else r["prompt"] for r in rows]
    for m, model in enumerate(members):
        mean, std = model.fit_normalisation(prompts, responses)
        print(
            f"shifu rm: member {m}: normalised raw scores of mean {mean:.3f}, std {std:.3f}", file=sys.stderr
        )

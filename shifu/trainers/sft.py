"""Stage 1, ``shifu sft``: supervised fine-tuning on (prompt, response) demonstrations.

Loss: mean next-token negative log-likelihood over the trained response tokens of the whole (accumulated,
global) batch, EOS included; prompt, read-only spans (:mod:`shifu.data.demonstrations`: tool outputs, the
non-assistant turns of a chat) and padding positions are masked out. Output: ``OUT/final/``, an HF model +
tokenizer directory (``AutoModelForCausalLM.from_pretrained`` loads it). The loop (resume, signals,
cadence, skipped steps) is :mod:`shifu.trainers.loop`; this module gives it the loss and the held-out loss.
"""

from __future__ import annotations

import sys

import torch

from shifu.config.schema import SFTConfig, check_world_size
from shifu.core import masked_sum
from shifu.data.batches import collate_sft, encode_sft, trained_tokens
from shifu.data.rows import load_train_eval
from shifu.errors import ConfigError
from shifu.generation.lm_head import sequence_log_probs
from shifu.models.loading import (
    check_length,
    check_own_tokenizer,
    fuse_tanh_gelu,
    load_causal_lm,
    load_tokenizer,
)
from shifu.parallel import build_strategy
from shifu.parallel.strategy import Strategy
from shifu.trainers import common, loop
from shifu.trainers.common import autocast, report_counts, seed_everything

Config = SFTConfig


def sft_nll_sum(model, batch: dict[str, torch.Tensor], device, bf16: bool) -> tuple[torch.Tensor, int]:
    """(sum of the trained response tokens' NLL, number of those tokens) of one right-padded batch."""
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    target_mask = batch["loss_mask"][:, 1:].to(device)  # (B, T-1): token t+1 is a trained response token
    with autocast(bf16, device):  # without the (B, T, V) logits
        log_probs = sequence_log_probs(model, input_ids, attention_mask)  # (B, T-1) float32
    return -masked_sum(log_probs, target_mask), int(target_mask.sum())


@torch.no_grad()
def evaluate(model, examples: list[dict], pad_id: int, cfg: SFTConfig, strategy: Strategy) -> float:
    """Token-mean NLL of the trained response tokens of ``examples`` (the held-out loss). Each rank scores its
    share of every ``eval.batch_size`` chunk; sums and counts are added over ranks."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), cfg.eval.batch_size):
        mine, real = strategy.share(examples[i : i + cfg.eval.batch_size])
        nll_sum, n = sft_nll_sum(model, collate_sft(mine, pad_id), strategy.device, cfg.bf16)
        if real:
            total, count = total + float(nll_sum), count + n
    model.train()
    summed = strategy.batch_sums({"total": total, "count": count})
    return summed["total"] / max(int(summed["count"]), 1)


def with_lora(model, cfg: SFTConfig, is_main: bool):
    """``model`` with LoRA adapters when ``cfg.lora.enabled`` (adapters only train: no gradient or optimiser
    state for the frozen weights), else ``model`` itself."""
    if not cfg.lora.enabled:
        return model
    from shifu.models.lora import trainable_summary, wrap_lora

    model = wrap_lora(model, cfg.lora)
    if is_main:
        print(f"shifu sft: LoRA, {trainable_summary(model)}", file=sys.stderr)
    return model


def train(cfg: SFTConfig, resume: bool = False, overwrite: bool = False) -> dict[str, float]:
    """Run SFT as ``cfg`` says; returns the final metrics (``eval/sft/loss``, ``sft/loss``)."""
    strategy = build_strategy(cfg.distributed)
    # 1. data: read and validate everything before the output directory is touched
    train_rows, eval_rows = load_train_eval(cfg.data, "sft")
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
    d = cfg.data
    encode = (d.max_prompt_len, d.max_len, d.prompt_policy, d.chat_template)
    train_ex, counts = encode_sft(tokenizer, train_rows, *encode)
    eval_ex, eval_counts = encode_sft(tokenizer, eval_rows, *encode)
    if not train_ex or not eval_ex:
        raise ConfigError("no SFT examples left after the prompt policy; raise data.max_prompt_len")

    # 2. model, optimiser, schedule (the same seed on every rank: the same model, the same data order)
    seed_everything(cfg.seed)
    device = strategy.launch(cfg.device)
    check_world_size(cfg, strategy.world)
    report_counts(d.train, counts, strategy.is_main)
    report_counts(d.eval or d.train + " (held out)", eval_counts, strategy.is_main)
    model = load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code).to(device)
    fuse_tanh_gelu(model)  # GPT-2's gelu_new as one fused kernel: the same function, as PPO trains it
    check_own_tokenizer(
        tokenizer,
        model,
        cfg.model.tokenizer or cfg.model.path,
        "model.tokenizer" if cfg.model.tokenizer else "model.path",
    )
    check_length(
        model, max(len(x["prompt_ids"]) + len(x["response_ids"]) for x in train_ex + eval_ex), d.train
    )
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
    model = with_lora(model, cfg, strategy.is_main)
    model.train()
    lengths = [len(x["prompt_ids"]) + len(x["response_ids"]) for x in train_ex]
    run = common.with_bf16_decision(cfg, model, lengths, strategy, "sft")
    model = strategy.wrap(model)  # before the optimiser (FSDP2 shards the parameters)
    strategy.seed_per_rank(cfg.seed)  # dropout: a different stream per rank
    # (the optimiser takes only what requires grad: with LoRA, the adapters)
    trained = strategy.optimize(model, model.parameters(), cfg.optim, loop.steps_of(cfg, len(train_ex)))
    pad = tokenizer.pad_token_id

    def loss(rows: list[int], divisor: torch.Tensor):
        batch = collate_sft([train_ex[i] for i in rows], pad)
        nll_sum, _ = sft_nll_sum(model, batch, device, run.bf16)
        loss = nll_sum / divisor
        return loss, {"loss": float(loss.detach())}, int(batch["attention_mask"].sum())

    def n_tokens(rows: list[int]) -> int:  # the tokens the NLL sums over (see sft_nll_sum)
        return sum(trained_tokens(train_ex[i]) for i in rows)

    job = loop.Job(
        name="sft",
        trained=trained,
        modules={"policy": strategy.unwrap(model)},
        n_rows=len(train_ex),
        stat_keys=("loss",),
        count=n_tokens,
        loss=loss,
        evaluate=lambda: {"eval/sft/loss": evaluate(model, eval_ex, pad, run, strategy)},
        seed=cfg.seed,
        lengths=lengths,
    )

    def fresh():  # the model unsharded, to gather the trained weights into
        plain = load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        if len(tokenizer) > plain.get_input_embeddings().num_embeddings:
            plain.resize_token_embeddings(len(tokenizer))
        return plain

    def closing(summary: dict) -> str:
        loss = summary.get("eval/sft/loss", float("nan"))
        return f"shifu sft: {summary['step']} steps, eval/sft/loss {loss:.4f}"

    # 3. the loop, in the run directory (--resume continues its latest checkpoint); 4. the fine-tuned model
    # in final/, loadable by transformers
    return loop.train_policy(
        job, cfg, strategy, resume, overwrite, run.bf16, (model, fresh, tokenizer), closing
    )

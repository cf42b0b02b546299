"""Token log-probs and entropy of a causal LM without its ``(B, R, V)`` logits: the model runs up to its
output layer, and the layer is applied in chunks by :func:`shifu.core.log_probs_from_hidden` (forward and
backward), so the vocabulary-wide tensor never exists whole.

This is the model-specific part: which models' logits are exactly ``output_layer(hidden)``, and how to get
``hidden``. A forward pre-hook on the output layer (``get_output_embeddings()``, which is the tied input
embedding's weight where a model ties them) records what the model hands it at the positions asked for
with ``logits_to_keep`` (the final, normed hidden states) and lets it compute logits of no position. Models
that do anything between that layer and their logits (Gemma 2's soft-capping, Cohere's and Granite's
scaling), an output layer that is not a plain ``nn.Linear`` (LoRA adapters on it), an unknown
architecture, and runs under torchrun (where a wrapper, DDP, FSDP2 or DeepSpeed, must see the whole
forward) take the HF forward with its full logits instead: the same numbers up to float rounding, at that
memory cost.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shifu import core
from shifu.parallel import distributed

# Model types whose logits are exactly ``lm_head(final hidden state)`` (transformers' modeling files end in
# ``logits = self.lm_head(hidden_states)`` with nothing after it)
PLAIN_OUTPUT_LAYER = frozenset(
    {"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "smollm3", "olmo2"}
)
# logits per chunk of the output layer (core's default: 16 MiB of float32 per temporary)
CHUNK_ELEMENTS = core.logprobs.DEFAULT_CHUNK_ELEMENTS


def output_layer(model: nn.Module) -> nn.Linear | None:
    """``model``'s output layer when shifu may apply it itself (see the module's docstring), else None."""
    if distributed.is_distributed():
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    get = getattr(model, "get_output_embeddings", None)
    if model_type not in PLAIN_OUTPUT_LAYER or not callable(get):
        return None
    head = get()
    return head if type(head) is nn.Linear else None


def head_input(model: nn.Module, head: nn.Linear, keep: Tensor | int, **inputs) -> Tensor:
    """``(B, len(keep), d)``: what ``head`` reads in ``model(**inputs, logits_to_keep=keep)``, the final
    hidden states at positions ``keep`` (0: every position) (differentiable as the model is); the head
    computes no logits."""
    seen: list[Tensor] = []

    def record(module: nn.Module, args: tuple):
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])  # no position: logits (B, 0, V)

    handle = head.register_forward_pre_hook(record)
    try:
        model(**inputs, logits_to_keep=keep, use_cache=False)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"{type(model).__name__} called its output layer {len(seen)} times in one forward")
    return seen[0]


def token_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor | None,
    start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    value_head: nn.Module | None = None,
    log_softmax: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None] | tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Log-probs ``(B, R)`` of ``input_ids[:, start:]`` under ``logits / temperature``, read at positions
    ``start-1 .. T-2``; their entropies if asked (outside the graph with ``entropy_grad=False``);
    ``value_head`` of the final hidden states there if given; with ``log_softmax`` a fourth output, the whole
    ``log_softmax(logits / T)`` ``(B, R, V)`` float32 (which takes the full-logits forward). ``position_ids``
    None: the model's own (``arange``). What :func:`shifu.generation.rollout.policy_forward` returns."""
    keep = torch.arange(start - 1, input_ids.shape[1] - 1, device=input_ids.device)  # (R,)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    tokens = input_ids[:, start:]
    head = None if log_softmax else output_layer(model)
    if head is None:
        out = model(
            **inputs, logits_to_keep=keep, output_hidden_states=value_head is not None, use_cache=False
        )
        return _from_logits(
            out, start, tokens, temperature, with_entropy, entropy_grad, value_head, log_softmax
        )
    hidden = head_input(model, head, keep, **inputs)
    args = (hidden, head.weight, tokens, temperature, head.bias, CHUNK_ELEMENTS)
    entropy = None
    if with_entropy:
        log_probs, entropy = core.log_probs_and_entropy_from_hidden(*args, entropy_grad=entropy_grad)
    else:
        log_probs = core.log_probs_from_hidden(*args)
    values = None if value_head is None else value_head(hidden).squeeze(-1)
    return log_probs, entropy, values


def _from_logits(out, start, tokens, temperature, with_entropy, entropy_grad, value_head, log_softmax):
    """:func:`token_log_probs` from the HF forward's output ``out``, its logits ``(B, R, V)``."""
    logits = out.logits  # (B, R, V)
    entropy = None
    if with_entropy:  # one pass over the logits for both
        log_probs, entropy = core.log_probs_and_entropy(
            logits, tokens, temperature, entropy_grad=entropy_grad
        )
    else:
        log_probs = core.log_probs_from_logits(logits, tokens, temperature)
    values = None
    if value_head is not None:
        hidden = out.hidden_states[-1][:, start - 1 : -1]  # (B, R, d), after the final norm
        values = value_head(hidden).squeeze(-1)
    if log_softmax:
        return log_probs, entropy, values, torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs, entropy, values


def sequence_log_probs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Log-probs ``(B, T-1)`` of ``input_ids[:, 1:]`` at positions ``0 .. T-2`` under the model's own position
    ids: the SFT and ptx losses. The output layer reads every position, as in the model's own forward (the
    last position's log-prob, of a stand-in token, is dropped: no gradient reaches it), so its weight's
    gradient sums over the same rows."""
    head = output_layer(model)
    if head is None:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits  # (B, T, V)
        return core.log_probs_from_logits(logits[:, :-1], input_ids[:, 1:])
    hidden = head_input(model, head, 0, input_ids=input_ids, attention_mask=attention_mask)  # (B, T, d)
    tokens = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], 1)
    return core.log_probs_from_hidden(hidden, head.weight, tokens, 1.0, head.bias, CHUNK_ELEMENTS)[:, :-1]

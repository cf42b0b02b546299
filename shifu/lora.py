"""LoRA adapters through ``peft`` (``pip install shifu-rlhf[lora]``), and the reference model for free.

With LoRA the actor is ``W x + (alpha / r) * B A x`` on the targeted linear layers, with only ``A``, ``B``
trained (``B`` starts at 0, so the wrapped actor starts equal to the base model). The PPO reference is the
frozen SFT policy, i.e. the *same* network with the adapters switched off: :func:`reference` gives it
without a second copy of the weights (one model fewer in memory). Its log-probs equal a real frozen copy's
exactly, before and after training (tested in ``tests/test_lora.py``).

Outputs stay plain Hugging Face directories: :func:`merged_copy` folds ``B A`` into ``W`` for
``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

from torch import nn

from shifu.config import opt
from shifu.errors import ConfigError, ShifuError


@dataclasses.dataclass
class LoraConfig:
    enabled: bool = opt(False, "train LoRA adapters instead of all weights; the reference is then the actor "
                               "with adapters disabled (no separate reference model)")  # fmt: skip
    r: int = opt(16, "adapter rank")
    alpha: float = opt(32.0, "scale numerator: the update is (alpha / r) * B A")
    dropout: float = opt(0.0, "dropout on the adapter input (keep 0 for PPO: ratios must start at 1)")
    target_modules: list[str] | None = opt(
        None, "names of the linear layers to adapt (e.g. [q_proj, v_proj]); null: peft's default for the "
        "architecture (c_attn for GPT-2, q_proj/v_proj for Llama-style models)"
    )  # fmt: skip

    def validate(self, prefix: str = "lora") -> None:
        if self.r < 1:
            raise ConfigError(f"{prefix}.r must be >= 1 (got {self.r})")
        if self.alpha <= 0:
            raise ConfigError(f"{prefix}.alpha must be > 0 (got {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{prefix}.dropout must be in [0, 1) (got {self.dropout})")


def _peft():
    try:
        import peft
    except ImportError:
        raise ShifuError(
            "LoRA needs peft: pip install 'shifu-rlhf[lora]' (or set lora.enabled=false)"
        ) from None
    return peft


def wrap_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """The causal LM wrapped in a ``peft.PeftModel``: base weights frozen, adapters trainable.

    Wrap *before* :func:`shifu.distributed.wrap_trainable` (DDP/FSDP2 then see only adapter gradients).
    """
    peft = _peft()
    cfg.validate()
    lcfg = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
        bias="none",
    )
    try:
        return peft.get_peft_model(model, lcfg)
    except ValueError as e:  # unknown architecture without target_modules, or names that match nothing
        raise ConfigError(f"lora.target_modules: {e} — name the linear layers to adapt") from None


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_lora(model: nn.Module) -> bool:
    """True for a peft-wrapped model (also inside a DDP wrapper)."""
    return hasattr(_inner(model), "disable_adapter") and hasattr(_inner(model), "peft_config")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block ``model`` computes the base (SFT) network: every adapter is bypassed."""
    if not is_lora(model):
        raise ShifuError("adapters_disabled needs a LoRA model (wrap it with shifu.lora.wrap_lora)")
    with _inner(model).disable_adapter():
        yield model


@contextlib.contextmanager
def reference(actor: nn.Module, ref_model: nn.Module | None) -> Iterator[nn.Module]:
    """The model to compute reference log-probs with: ``ref_model`` when given, else the LoRA actor with
    its adapters disabled. Call it under ``torch.no_grad()``::

        with torch.no_grad(), lora.reference(actor, ref_model) as ref:
            ref_logits = ref(input_ids=..., attention_mask=..., position_ids=...).logits
    """
    if ref_model is not None:
        yield ref_model
        return
    if not is_lora(actor):
        raise ShifuError("no reference model was given and the actor has no LoRA adapters to disable")
    with adapters_disabled(actor) as m:
        yield m


def trainable_summary(model: nn.Module) -> str:
    """``"trainable 12,288 / 1,234,567 parameters (1.00%)"`` for the start-up log."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"trainable {train:,} / {total:,} parameters ({100 * train / max(total, 1):.2f}%)"


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain HF model with ``W + (alpha/r) B A`` folded in, for ``save_pretrained`` (the actor is left
    untouched; costs one more copy of the weights in host memory while it exists)."""
    if not is_lora(model):
        raise ShifuError("merged_copy needs a LoRA model")
    return copy.deepcopy(_inner(model)).merge_and_unload()

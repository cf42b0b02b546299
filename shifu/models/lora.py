"""LoRA adapters through ``peft`` (``pip install shifu-rlhf[lora]``), and the reference model for free.

With LoRA the actor is ``W x + (alpha / r) * B A x`` on the targeted linear layers, with only ``A``, ``B``
trained (``B`` starts at 0, so the wrapped actor starts equal to the base model). The PPO reference is the
frozen SFT policy, i.e. the *same* network with the adapters switched off: :func:`reference` gives it
without a second copy of the weights (one model fewer in memory). Its log-probs equal a real frozen copy's
exactly, before and after training (tested in ``tests/test_lora.py``).

The critic can be trained the same way (``lora.critic``): :func:`wrap_lora_critic` adapts the trunk of a
:class:`~shifu.models.scalar.ScalarModel` and keeps its value head fully trained. A checkpoint then holds only
what trains (adapters, the value head; :func:`shifu.runs.checkpoint.trained_state_dict`), never the frozen base.

Outputs stay plain Hugging Face directories: :func:`merged_copy` folds ``B A`` into ``W`` for
``save_pretrained`` (also for a ScalarModel critic, whose backbone is merged).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from shifu.config.sections import LoraConfig
from shifu.errors import ConfigError, ShifuError


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

    Wrap *before* :func:`shifu.parallel.torchrun.wrap_trainable` (DDP/FSDP2 then see only adapter gradients).
    """
    return _adapted(model, cfg, task_type="CAUSAL_LM")


def wrap_lora_critic(critic: nn.Module, cfg: LoraConfig) -> nn.Module:
    """A :class:`~shifu.models.scalar.ScalarModel` critic whose trunk (``critic.backbone``) carries LoRA adapters:
    trunk weights frozen, adapters and the scalar head trained. In place; returns ``critic``.

    The adapters start at ``B = 0``, so the wrapped critic starts with exactly the values of the unwrapped
    one; the layers adapted are ``cfg.target_modules`` (peft's default for the architecture when null)."""
    # (no task type: the trunk is called with input ids, mask and positions as it is)
    critic.backbone = _adapted(critic.backbone, cfg)
    return critic


def _adapted(model: nn.Module, cfg: LoraConfig, **task) -> nn.Module:
    """``model`` as a ``peft.PeftModel`` with ``cfg``'s adapters (``task``: peft's ``task_type``, if any)."""
    peft = _peft()
    cfg.validate()
    lcfg = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        **task,
    )
    try:
        return peft.get_peft_model(model, lcfg)
    except ValueError as e:  # unknown architecture without target_modules, or names that match nothing
        raise ConfigError(f"lora.target_modules: {e} — name the linear layers to adapt") from None


def share_frozen_trunk(actor: nn.Module, critic: nn.Module) -> int:
    """Make a LoRA critic's frozen trunk weights *be* the LoRA actor's where they are equal (a critic
    started from the SFT model: the same trunk), so actor, reference and critic hold one copy of the base
    between them. Only frozen tensors equal in name, shape, dtype and value are shared (neither optimiser
    moves them; :func:`merged_copy` deep-copies). Returns the number of elements shared."""
    if not (is_lora(actor) and is_lora_critic(critic)):
        return 0
    actor_trunk = _inner(actor).get_base_model().base_model  # the HF trunk inside the causal LM
    critic_trunk = _inner(critic).backbone.get_base_model()
    theirs = dict(actor_trunk.named_parameters())
    shared = 0
    for name, p in list(critic_trunk.named_parameters()):
        q = theirs.get(name)
        if p.requires_grad or q is None or q.requires_grad or q.shape != p.shape or q.dtype != p.dtype:
            continue
        if q.device == p.device and torch.equal(p, q):
            owner, _, leaf = name.rpartition(".")
            critic_trunk.get_submodule(owner)._parameters[leaf] = q
            shared += q.numel()
    return shared


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _is_peft(m: nn.Module) -> bool:
    return hasattr(m, "disable_adapter") and hasattr(m, "peft_config")


def is_lora(model: nn.Module) -> bool:
    """True for a peft-wrapped model (also inside a DDP wrapper)."""
    return _is_peft(_inner(model))


def is_lora_critic(model: nn.Module) -> bool:
    """True for a ScalarModel whose trunk carries LoRA adapters (:func:`wrap_lora_critic`)."""
    return _is_peft(getattr(_inner(model), "backbone", None) or nn.Module())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block ``model`` computes the base (SFT) network: every adapter is bypassed."""
    if not is_lora(model):
        raise ShifuError("adapters_disabled needs a LoRA model (wrap it with shifu.models.lora.wrap_lora)")
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
    untouched; costs one more copy of the weights in host memory while it exists). A LoRA critic
    (:func:`wrap_lora_critic`) comes back as a plain ScalarModel with its trunk merged."""
    if is_lora_critic(model):
        critic = _inner(model)
        trunk, critic.backbone = critic.backbone, None  # (deep-copy the rest without the trunk)
        try:
            plain = copy.deepcopy(critic)
        finally:
            critic.backbone = trunk
        plain.backbone = copy.deepcopy(trunk).merge_and_unload()
        return plain
    if not is_lora(model):
        raise ShifuError("merged_copy needs a LoRA model")
    return copy.deepcopy(_inner(model)).merge_and_unload()


# ------------------------------------------------------------------ what shifu's own decoders read of an adapted model
def decodable(model: nn.Module) -> bool:
    """Whether :func:`linear` describes every adapted layer of ``model`` (a peft model) exactly: plain LoRA on
    linear layers only (no DoRA or other variant, none on an embedding), the adapter input's dropout off or the
    layer in eval mode. The output layer is never adapted by shifu; one that is, is not decodable either (the
    decoders read the output embedding as it is)."""
    peft = _peft()
    for name, m in _inner(model).named_modules():
        if not isinstance(m, peft.tuners.lora.LoraLayer):
            continue
        if not isinstance(m, peft.tuners.lora.Linear) or name.endswith("lm_head"):
            return False
        for a in m.active_adapters:
            if a in m.lora_variant or (m.training and not isinstance(m.lora_dropout[a], nn.Identity)):
                return False
    return True


def base_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft model (whose adapted layers are peft's wrappers), or ``model``
    itself (unwrapped from DDP) when it has no adapters."""
    inner = _inner(model)
    return inner.get_base_model() if _is_peft(inner) else inner


# an adapted layer's low-rank terms: (A (r, in), B (out, r), alpha / r) per active adapter
LowRank = tuple[tuple[torch.Tensor, torch.Tensor, float], ...]


def linear(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, LowRank]:
    """What ``layer`` computes, for a decoder that applies it itself: its base weight and bias (the layer's own
    for a plain one; the same tensors, never a copy) and the low-rank terms of its active adapters, ``x ->
    base(x) + sum (x A^T) B^T * scale`` as peft computes it (none for a plain layer, nor with the adapters
    switched off or merged into the weight). Check :func:`decodable` first."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    if base is layer or layer.disable_adapters or layer.merged:
        return base.weight, base.bias, ()
    low = tuple(
        (layer.lora_A[a].weight, layer.lora_B[a].weight, float(layer.scaling[a]))
        for a in layer.active_adapters
        if a in layer.lora_A
    )
    return base.weight, base.bias, low


def add_low_rank(y: torch.Tensor, x: torch.Tensor, low: LowRank) -> torch.Tensor:
    """``y`` (a layer's base output for inputs ``x``) plus the adapters' terms ``low`` (:func:`linear`)."""
    for a, b, scale in low:
        y = y + F.linear(F.linear(x, a), b) * scale
    return y

"""Loading policies, tokenizers, and scalar-head models (reward model and critic).

Conventions pinned here (and tested in tests/test_models.py):

- A tokenizer without a pad token gets one: the EOS token when it has one (so pad may equal EOS), else a
  new ``<pad>`` token. Positions are therefore *always* found from attention masks, never by comparing ids.
- A :class:`ScalarModel` is a backbone (``AutoModel``: a causal LM trunk or an encoder) plus a linear head
  ``d_model -> 1`` initialised N(0, 1/sqrt(d_model+1)), bias 0. ``forward`` gives one value per position
  (the critic); ``score`` gives the head output at the **last real token** of each row, then
  ``gain * s + bias`` (the reward model's normalisation, identity until fitted).
- Nothing is ever downloaded: every ``from_pretrained`` runs with ``local_files_only=True``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shifu.errors import ShifuError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

HEAD_FILE = "scalar_head.safetensors"
META_FILE = "shifu_scalar.json"


def _require_dir(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not (p / "config.json").exists():
        raise ShifuError(
            f"{what} '{p}' is not a model directory (no config.json). Give the path of a directory "
            "written by `save_pretrained` (shifu never downloads from a hub)"
        )
    return p


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """AutoTokenizer from a local directory; adds a pad token when missing (EOS if any, else ``<pad>``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            tok.add_special_tokens({"pad_token": "<pad>"})
    return tok


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0 (PPO: ratios must be 1 before the first step)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for k in (
            "dropout",
            "attention_dropout",
            "hidden_dropout",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
        ):
            if hasattr(cfg, k) and isinstance(getattr(cfg, k), float):
                setattr(cfg, k, 0.0)
    return model


def load_causal_lm(
    path: str | Path, dtype: torch.dtype | None = None, trust_remote_code: bool = False, dropout: bool = True
):
    """AutoModelForCausalLM from a local HF directory (any architecture)."""
    from transformers import AutoModelForCausalLM

    p = _require_dir(path, "policy model")
    model = AutoModelForCausalLM.from_pretrained(
        str(p), local_files_only=True, trust_remote_code=trust_remote_code, dtype=dtype or torch.float32
    )
    if not dropout:
        disable_dropout(model)
    return model


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last position whose mask is 1 — works for left- and right-padding alike."""
    T = attention_mask.shape[1]
    pos = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), pos, torch.full_like(pos, -1)).max(dim=1).values


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token (left padding gets position 0, unused)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _is_causal_backbone(config) -> bool:
    return not getattr(config, "is_encoder_decoder", False) and config.model_type not in {
        "bert",
        "roberta",
        "distilbert",
        "deberta",
        "deberta-v2",
        "electra",
        "xlm-roberta",
        "mpnet",
        "albert",
    }


class ScalarModel(nn.Module):
    """Backbone + scalar head. Used as the reward model (``score``) and as the critic (``forward``)."""

    def __init__(self, backbone: nn.Module, tokenizer=None, seed: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.tokenizer = tokenizer
        d = _hidden_size(backbone.config)
        self.head = nn.Linear(d, 1)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=gen) / (d + 1) ** 0.5)
            self.head.bias.zero_()
        # score normalisation r -> gain * r + bias (fitted after RM training; identity until then)
        self.register_buffer("gain", torch.ones(()))
        self.register_buffer("bias", torch.zeros(()))
        self.is_causal = _is_causal_backbone(backbone.config)

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_backbone(
        cls,
        path: str | Path,
        seed: int | None = None,
        trust_remote_code: bool = False,
        dtype: torch.dtype | None = None,
    ) -> ScalarModel:
        """A fresh scalar head on the backbone of any local HF model (causal LM or encoder)."""
        from transformers import AutoModel

        p = _require_dir(path, "backbone")
        backbone = AutoModel.from_pretrained(
            str(p), local_files_only=True, trust_remote_code=trust_remote_code, dtype=dtype or torch.float32
        )
        tok = load_tokenizer(p, trust_remote_code=trust_remote_code)
        return cls(backbone, tok, seed=seed)

    @classmethod
    def from_pretrained(cls, path: str | Path, trust_remote_code: bool = False) -> ScalarModel:
        """Reload a model written by :meth:`save_pretrained` (one call, identical scores)."""
        p = Path(path)
        if not (p / META_FILE).exists():
            raise ShifuError(f"'{p}' is not a shifu reward/value model directory ({META_FILE} missing)")
        model = cls.from_backbone(p, trust_remote_code=trust_remote_code)
        state = load_file(str(p / HEAD_FILE))
        model.head.load_state_dict({"weight": state["weight"], "bias": state["bias"]})
        model.gain.copy_(state["gain"])
        model.bias.copy_(state["norm_bias"])
        return model

    def save_pretrained(self, path: str | Path, extra: dict | None = None) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(p))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(p))
        save_file(
            {
                "weight": self.head.weight.detach().contiguous().cpu(),
                "bias": self.head.bias.detach().contiguous().cpu(),
                "gain": self.gain.detach().cpu().reshape(()),
                "norm_bias": self.bias.detach().cpu().reshape(()),
            },
            str(p / HEAD_FILE),
        )
        meta = {
            "kind": "scalar",
            "is_causal": self.is_causal,
            "gain": float(self.gain),
            "bias": float(self.bias),
        }
        meta.update(extra or {})
        (p / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B,T) raw head output at every position (values for the critic; no normalisation)."""
        kwargs = {}
        if self.is_causal:
            kwargs["position_ids"] = (
                position_ids if position_ids is not None else position_ids_from_mask(attention_mask)
            )
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out.last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) normalised score: head output at the last real token (from the mask), gain*s + bias."""
        values = self(input_ids, attention_mask)
        idx = last_token_index(attention_mask)
        raw = values.gather(1, idx.clamp(min=0).unsqueeze(1)).squeeze(1)
        return raw * self.gain + self.bias

    def encode(
        self, prompts: list[str], responses: list[str], max_length: int = 512
    ) -> dict[str, torch.Tensor]:
        """Tokenise (prompt, response) text pairs for scoring with this model's own tokenizer.

        Causal trunks see ``prompt_ids + response_ids + [eos]`` (the SFT convention); encoders see the
        tokenizer's pair encoding (``[CLS] prompt [SEP] response [SEP]`` for BERT). Right-padded. Longer
        than ``max_length``: tokens are dropped from the left (of the longer text, for encoders).
        """
        tok = self.tokenizer
        if tok is None:
            raise ShifuError("this scalar model has no tokenizer; it can only score token ids")
        if self.is_causal:
            rows = []
            for pr, rs in zip(prompts, responses):
                ids = (
                    tok(pr, add_special_tokens=False)["input_ids"]
                    + tok(rs, add_special_tokens=False)["input_ids"]
                )
                ids = ids[-(max_length - 1) :] + [tok.eos_token_id]
                rows.append(ids)
            return pad_right(rows, tok.pad_token_id)
        # Over-long pairs lose tokens from the left of the longer text first (usually the prompt), the
        # same "keep the end" policy as the causal branch; never an error for a long response.
        side, tok.truncation_side = tok.truncation_side, "left"
        try:
            enc = tok(
                prompts,
                responses,
                truncation="longest_first",
                max_length=max_length,
                padding=True,
                return_tensors="pt",
            )
        finally:
            tok.truncation_side = side
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    @torch.no_grad()
    def score_texts(
        self, prompts: list[str], responses: list[str], batch_size: int = 32, max_length: int = 512
    ) -> torch.Tensor:
        """(N,) scores of decoded text pairs (a reward model whose tokenizer differs from the policy's)."""
        device = self.head.weight.device
        out = []
        for i in range(0, len(prompts), batch_size):
            b = self.encode(prompts[i : i + batch_size], responses[i : i + batch_size], max_length)
            out.append(self.score(b["input_ids"].to(device), b["attention_mask"].to(device)).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)


def _hidden_size(config) -> int:
    for k in ("hidden_size", "n_embd", "d_model", "dim"):
        v = getattr(config, k, None)
        if isinstance(v, int):
            return v
    raise ShifuError(f"cannot find the hidden size of a {config.model_type} model")


def pad_right(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad lists of token ids -> input_ids, attention_mask (B,T)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def pad_left(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad lists of token ids -> input_ids, attention_mask (B,T) (prompts for generation)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, T - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, T - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def build_tiny_gpt2(
    tokenizer,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    n_positions: int = 256,
    seed: int = 0,
    dropout: float = 0.0,
):
    """A small random GPT-2 sized to ``tokenizer`` (built-in tasks, tests and benchmarks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


def fuse_tanh_gelu(model: nn.Module) -> nn.Module:
    """Swap transformers' Python ``gelu_new`` (GPT-2's NewGELUActivation: pow, mul, tanh as separate ops) for
    torch's fused ``GELU(approximate="tanh")`` — the same formula, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))),
    equal to ~2e-7, and about 2x faster forward+backward on CPU. In place; returns the model."""
    from transformers.activations import NewGELUActivation

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is NewGELUActivation:
                setattr(parent, name, nn.GELU(approximate="tanh"))
    return model

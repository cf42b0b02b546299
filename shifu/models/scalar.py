"""Scalar-head models: a backbone plus a linear head ``d_model -> 1``, the reward model and the critic.

Conventions pinned here (and tested in tests/test_models.py):

- A :class:`ScalarModel` is a backbone (``AutoModel``: a causal LM trunk or an encoder) plus a linear head
  ``d_model -> 1`` initialised N(0, 1/sqrt(d_model+1)), bias 0. ``forward`` gives one value per position
  (the critic); ``score`` gives the head output at the **last real token** of each row, then
  ``gain * s + bias`` (the reward model's normalisation, identity until fitted).
- A backbone may keep only its lowest blocks (``keep_layers``) or train only its upper ones
  (``freeze_layers``); the shared-trunk critic's head comes from :func:`new_value_head`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shifu.errors import ShifuError
from shifu.models.loading import _load_checked, check_own_tokenizer, load_tokenizer, read_json_file
from shifu.models.padding import last_token_index, pad_right, position_ids_from_mask
from shifu.models.positions import position_limit
from shifu.runs.files import check_safetensors

HEAD_FILE = "scalar_head.safetensors"
META_FILE = "shifu_scalar.json"


def _blocks(backbone: nn.Module, key: str) -> nn.ModuleList:
    """The backbone's ``nn.ModuleList`` of ``config.num_hidden_layers`` transformer blocks."""
    depth = getattr(backbone.config, "num_hidden_layers", None)
    lists = [m for m in backbone.modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if not lists:
        raise ShifuError(
            f"{key}: cannot find the {depth} transformer blocks of a {backbone.config.model_type} "
            f"backbone (no nn.ModuleList of config.num_hidden_layers modules); set {key}: 0"
        )
    return lists[0]


def keep_lower_layers(backbone: nn.Module, n: int) -> None:
    """Keep only the lowest ``n`` transformer blocks of an HF backbone (in place; 0 keeps all): the upper
    blocks are dropped and ``config.num_hidden_layers`` (with a per-layer ``layer_types`` list) says ``n``,
    so the model saves and reloads as an ``n``-block model. A cheaper backbone to train and to score with."""
    if n == 0:
        return
    blocks = _blocks(backbone, "keep_layers")
    if not 1 <= n <= len(blocks):
        raise ShifuError(
            f"keep_layers must be in [1, {len(blocks)}] for this backbone, or 0 for all (got {n})"
        )
    del blocks[n:]
    cfg = backbone.config
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]


def freeze_lower_layers(backbone: nn.Module, n: int) -> None:
    """Freeze the embeddings and the lowest ``n`` transformer blocks of an HF backbone (in place; 0 freezes
    nothing and looks at nothing, so any backbone loads).

    The blocks are the backbone's ``nn.ModuleList`` of ``config.num_hidden_layers`` modules; "the
    embeddings" are every parameter registered before the first block (HF models register token and
    position embeddings first). ``n`` may equal the number of blocks (only what follows them, the final
    norm, trains; with a scalar head on top that is a linear probe). The optimiser then holds only what
    still requires a gradient.
    """
    if n == 0:
        return
    blocks = _blocks(backbone, "freeze_layers")
    if not 1 <= n <= len(blocks):
        raise ShifuError(f"freeze_layers must be in [0, {len(blocks)}] for this backbone (got {n})")
    first = {id(p) for p in blocks[0].parameters()}
    frozen: list[nn.Parameter] = []
    for p in backbone.parameters():  # registration order: the embeddings come before block 0
        if id(p) in first:
            break
        frozen.append(p)
    frozen += [p for b in blocks[:n] for p in b.parameters()]
    for p in frozen:
        p.requires_grad_(False)


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

    def __init__(self, backbone: nn.Module, tokenizer=None, seed: int | None = None, zero_head: bool = False):
        super().__init__()
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.head = new_value_head(_hidden_size(backbone.config), seed, zero=zero_head)
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
        freeze_layers: int = 0,
        keep_layers: int = 0,
        zero_head: bool = False,
    ) -> ScalarModel:
        """A fresh scalar head on the backbone of any local HF model (causal LM or encoder); ``keep_layers``
        > 0: only its lowest blocks kept (:func:`keep_lower_layers`); ``freeze_layers`` > 0: its embeddings
        and lowest blocks frozen (:func:`freeze_lower_layers`); ``zero_head``: the head's weights 0."""
        from transformers import AutoModel

        backbone = _load_checked(AutoModel, path, "backbone", trust_remote_code, dtype)
        p = Path(path)
        tok = load_tokenizer(p, trust_remote_code=trust_remote_code)
        check_own_tokenizer(tok, backbone, p, "backbone")
        keep_lower_layers(backbone, keep_layers)
        freeze_lower_layers(backbone, freeze_layers)
        return cls(backbone, tok, seed=seed, zero_head=zero_head)

    @classmethod
    def bag_of_tokens(cls, tokenizer_dir: str | Path, seed: int | None = None) -> ScalarModel:
        """A fresh bag-of-tokens reward model (:mod:`shifu.models.bag_of_tokens`) over the ids of the tokenizer in
        ``tokenizer_dir`` (the policy's, so PPO scores the rollout's own ids); its head is frozen at weight 1,
        bias 0, so a token's weight is its score (and ``l2_coef`` shrinks the weights themselves)."""
        from shifu.models.bag_of_tokens import fresh

        tok = load_tokenizer(tokenizer_dir)
        model = cls(fresh(tok), tok, seed=seed)
        with torch.no_grad():  # the head fixed at the identity: the token weights are the model
            model.head.weight.fill_(1.0)
        model.head.requires_grad_(False)
        return model

    @classmethod
    def from_pretrained(cls, path: str | Path, trust_remote_code: bool = False) -> ScalarModel:
        """Reload a model written by :meth:`save_pretrained` (one call, identical scores)."""
        p = Path(path)
        if not (p / META_FILE).exists():
            raise ShifuError(f"'{p}' is not a shifu reward/value model directory ({META_FILE} missing)")
        hint = "the reward/value model directory is damaged; train it again or restore a copy"
        read_json_file(p / META_FILE, "shifu model file", hint)
        if not (p / HEAD_FILE).is_file():
            raise ShifuError(f"'{p}' has no scalar head ({HEAD_FILE} missing); {hint}")
        check_safetensors(p / HEAD_FILE, hint)
        model = cls.from_backbone(p, trust_remote_code=trust_remote_code)
        state = load_file(str(p / HEAD_FILE))
        need = {"weight": model.head.weight.shape, "bias": model.head.bias.shape, "gain": (), "norm_bias": ()}
        bad = [k for k, shape in need.items() if k not in state or tuple(state[k].shape) != tuple(shape)]
        if bad:
            raise ShifuError(
                f"'{p / HEAD_FILE}' lacks or misshapes {', '.join(bad)} for this backbone; {hint}"
            )
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
        return self.read_score(self(input_ids, attention_mask), attention_mask)

    def read_score(self, values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) ``gain * v + bias`` of the values (B, T) of :meth:`forward` at each row's last real token
        (for a forward that went through a wrapper, e.g. DDP, which syncs the gradients of forward only)."""
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
            p_ids = tok(list(prompts), add_special_tokens=False)["input_ids"] if prompts else []
            r_ids = tok(list(responses), add_special_tokens=False)["input_ids"] if responses else []
            rows = [(p + r)[-(max_length - 1) :] + [tok.eos_token_id] for p, r in zip(p_ids, r_ids)]
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

    def text_length(self, max_length: int) -> int:
        """``max_length`` capped at the model's positions (:func:`shifu.models.positions.position_limit`)."""
        positions = position_limit(self)
        return min(max_length, positions) if positions is not None else max_length

    @torch.no_grad()
    def score_texts(
        self, prompts: list[str], responses: list[str], batch_size: int = 32, max_length: int = 512
    ) -> torch.Tensor:
        """(N,) scores of decoded text pairs (a reward model whose tokenizer differs from the policy's). A pair
        longer than ``max_length`` or the model's positions keeps its end (:meth:`encode`). (Training data
        is not cut here: ``shifu rm`` refuses examples longer than the model's positions.)"""
        max_length = self.text_length(max_length)
        device = self.head.weight.device
        out = []
        for i in range(0, len(prompts), batch_size):
            b = self.encode(prompts[i : i + batch_size], responses[i : i + batch_size], max_length)
            out.append(self.score(b["input_ids"].to(device), b["attention_mask"].to(device)).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def fit_normalisation(self, prompts: list[str], responses: list[str]) -> tuple[float, float]:
        """Set ``gain``, ``bias`` so that ``gain * s + bias`` has mean 0, std 1 on these pairs (gain = 1/std,
        bias = -mean/std); returns the raw (mean, std). A constant score only has its mean removed."""
        self.gain.fill_(1.0)
        self.bias.fill_(0.0)
        s = self.score_texts(prompts, responses)
        mean, std = float(s.mean()), float(s.std()) if len(s) > 1 else 0.0
        if std < 1e-6:
            print(
                f"shifu rm: normalisation scores have std {std:.2e}; only the mean is removed",
                file=sys.stderr,
            )
            std = 1.0
        self.gain.fill_(1.0 / std)
        self.bias.fill_(-mean / std)
        return mean, std


def new_value_head(hidden_size: int, seed: int | None, zero: bool = False) -> nn.Linear:
    """Scalar head N(0, 1/sqrt(d+1)), bias 0 — the spec's initialisation, of a reward model, a critic or the
    shared-trunk critic (``seed`` None: torch's global generator); ``zero``: its weights 0 (every value starts
    at 0)."""
    head = nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / (hidden_size + 1) ** 0.5)
        if zero:
            head.weight.zero_()
        head.bias.zero_()
    return head


def _hidden_size(config) -> int:
    for k in ("hidden_size", "n_embd", "d_model", "dim"):
        v = getattr(config, k, None)
        if isinstance(v, int):
            return v
    raise ShifuError(f"cannot find the hidden size of a {config.model_type} model")

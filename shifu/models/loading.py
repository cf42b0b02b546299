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

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shifu.errors import ShifuError
from shifu.runs.checkpoint import check_safetensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

HEAD_FILE = "scalar_head.safetensors"
META_FILE = "shifu_scalar.json"


SAVE_HINT = (
    "give the path of a local directory written by `save_pretrained` (shifu never downloads from a hub)"
)
# what `from_pretrained` reads weights from (one file, or an index naming shards)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# files a saved tokenizer consists of (at least one of them is always written by `save_pretrained`)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "special_tokens_map.json")  # fmt: skip


def read_json_file(path: Path, what: str, hint: str) -> Any:
    """The JSON value in ``path``; a ShifuError naming the file, line and column when it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise ShifuError(
            f"{what} '{path}', line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); {hint}"
        ) from None
    except UnicodeDecodeError as e:
        raise ShifuError(f"{what} '{path}': not UTF-8 text (byte {e.start}); {hint}") from None
    except OSError as e:
        raise ShifuError(f"cannot read {what} '{path}': {e.strerror or e}") from None


def require_model_dir(path: str | Path, what: str, trust_remote_code: bool = False) -> Path:
    """``path`` as a model directory: it exists, holds a readable ``config.json`` with a ``model_type``
    transformers knows, and complete weight files; else a ShifuError naming what is wrong and where."""
    p = Path(path)
    if not p.exists():
        raise ShifuError(f"{what} '{p}' does not exist; {SAVE_HINT}")
    if not p.is_dir():
        raise ShifuError(f"{what} '{p}' is a file, not a model directory; {SAVE_HINT}")
    if not (p / "config.json").exists():
        raise ShifuError(f"{what} '{p}' is not a model directory (no config.json); {SAVE_HINT}")
    resave = "re-save the model with `save_pretrained`"
    config = read_json_file(p / "config.json", f"{what} config", resave)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise ShifuError(
            f"'{p / 'config.json'}' has no model_type, so no architecture can be built; {resave}"
        )
    from transformers import CONFIG_MAPPING

    if model_type == "shifu_bag_of_tokens":  # shifu's own architecture: registered on first use
        from shifu.models.bag_of_tokens import register

        register()
    if model_type not in CONFIG_MAPPING and not (trust_remote_code and "auto_map" in config):
        import transformers

        raise ShifuError(
            f"'{p / 'config.json'}': model_type '{model_type}' is not an architecture transformers "
            f"{transformers.__version__} knows; upgrade transformers, or set model.trust_remote_code=true if "
            "the model ships its own code (and you trust it)"
        )
    _require_weights(p, what)
    return p


def _require_weights(p: Path, what: str) -> None:
    """The weight files of a model directory exist and are complete (every shard an index names, too)."""
    present = [f for f in WEIGHT_FILES if (p / f).exists()]
    if not present:
        raise ShifuError(
            f"{what} '{p}' has no weights (none of {', '.join(WEIGHT_FILES[:2])}); copy the weight files "
            "too, or re-save the model with `save_pretrained`"
        )
    files = [p / f for f in present if not f.endswith(".json")]
    for index in (p / f for f in present if f.endswith(".json")):
        weight_map = read_json_file(index, "the weight index of " + what, "re-save the model").get(
            "weight_map"
        )
        shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        missing = [s for s in shards if not (p / s).is_file()]
        if not shards or missing:
            raise ShifuError(
                f"'{index}' names weight files that are not in '{p}': "
                f"{', '.join(missing[:3]) or 'none at all'}; copy every shard, or re-save the model"
            )
        files += [p / s for s in shards]
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)


@contextlib.contextmanager
def _loading(what: str, p: Path) -> Iterator[None]:
    """Turn whatever transformers, tokenizers or safetensors raise while reading ``p`` into one ShifuError
    naming the directory (their messages name neither it nor a fix)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would print before shifu's message (a failure says why)
    try:
        yield
    except ShifuError:
        raise
    except Exception as e:  # OSError, ValueError, RuntimeError, KeyError, SafetensorError, ... by library
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShifuError(
            f"cannot load the {what} in '{p}': {first} ({type(e).__name__}). The directory may be damaged or "
            "written by an incompatible library version; re-save it with `save_pretrained`"
        ) from e
    finally:
        hf_logging.set_verbosity(verbosity)


def _check_loaded(model: nn.Module, info: dict, what: str, p: Path) -> None:
    """Refuse a model whose weights did not all come from ``p`` (the rest would be random: the weight file
    belongs to another architecture) or do not fit the shapes its config.json declares."""
    mismatched = sorted(info.get("mismatched_keys") or [])  # (name, shape in the file, shape of the model)
    if mismatched:
        name, saved, built = (tuple(x) if i else x for i, x in enumerate(mismatched[0]))
        raise ShifuError(
            f"the weights in '{p}' do not fit the shapes its config.json declares ({len(mismatched)} tensors, "
            f"e.g. {name}: {saved} in the file, {built} in the model); the config and the weight files come "
            "from different models: copy the matching config.json, or re-save the model with `save_pretrained`"
        )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ShifuError(
            f"the weight files in '{p}' lack {len(missing)} of the {what}'s tensors (e.g. "
            f"{', '.join(missing[:3])}): they would start random. The weights belong to another model or "
            "are incomplete; re-save the model with `save_pretrained`"
        )


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """AutoTokenizer from a local directory; adds a pad token when missing (EOS if any, else ``<pad>``)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        problem = "is a file, not a directory" if p.exists() else "does not exist"
        raise ShifuError(f"'{p}' (a model or tokenizer directory) {problem}; {SAVE_HINT}")
    if not any((p / f).exists() for f in TOKENIZER_FILES):
        raise ShifuError(
            f"'{p}' holds no tokenizer (none of tokenizer.json, tokenizer_config.json, vocab.json, ...); save "
            "the tokenizer into it with `tokenizer.save_pretrained`, or name a directory that has one"
        )
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (p / f).exists():  # (AutoTokenizer reads the model's config.json too)
            what = "model config" if f == "config.json" else "tokenizer file"
            read_json_file(p / f, what, f"re-save the {what.split()[0]} with `save_pretrained`")
    with _loading("tokenizer", p):
        tok = AutoTokenizer.from_pretrained(
            str(p), local_files_only=True, trust_remote_code=trust_remote_code
        )
    if len(tok) <= len(set(tok.all_special_tokens)):
        raise ShifuError(
            f"the tokenizer in '{p}' has no vocabulary ({len(tok)} tokens, all special): its vocabulary files "
            "are missing; save the tokenizer into it with `tokenizer.save_pretrained`"
        )
    if tok.pad_token is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            tok.add_special_tokens({"pad_token": "<pad>"})
    return tok


def check_vocab(tokenizer, model: nn.Module, path: str | Path, key: str) -> None:
    """ShifuError unless ``model`` (loaded from ``path``, the value of config key ``key``) can read the ids of
    ``tokenizer`` (the policy's): its embedding has a row for every id, and a tokenizer saved in ``path``
    maps text to the same ids. Catches a reference, critic or DPO reference from another model family, which
    would otherwise crash with an index error mid-run (a smaller vocabulary) or compute a meaningless KL or
    value (a different one). Call after resizing the model for a pad token the trainer added."""
    trunk = getattr(model, "backbone", model)
    rows = trunk.get_input_embeddings().num_embeddings
    where = f"{key}={path}"
    if len(tokenizer) > rows:
        raise ShifuError(
            f"{where}: the model embeds {rows} token ids, but the policy's tokenizer has {len(tokenizer)}: "
            f"they come from different models; set {key} to a model trained with the policy's tokenizer"
        )
    p = Path(path)
    if any((p / f).exists() for f in TOKENIZER_FILES):
        own = load_tokenizer(p)
        if own.get_vocab() != tokenizer.get_vocab():
            raise ShifuError(
                f"{where}: its tokenizer ({len(own)} tokens) differs from the policy's ({len(tokenizer)} tokens), "
                f"so the same ids would mean other words; set {key} to a model trained with the policy's tokenizer"
            )


def check_own_tokenizer(tokenizer, model: nn.Module, path: str | Path, key: str) -> None:
    """ShifuError when ``tokenizer`` (the one a stage reads ``path`` with) has ids that ``model``'s embedding
    has no row for, beyond the one pad token :func:`load_tokenizer` may add (the trainers resize for it): a
    tokenizer file from another model, which would crash mid-run with an index error or silently grow the
    embedding by thousands of untrained rows."""
    trunk = getattr(model, "backbone", model)
    rows = trunk.get_input_embeddings().num_embeddings
    extra = len(tokenizer) - rows
    if extra > 1 or (extra == 1 and tokenizer.pad_token_id != len(tokenizer) - 1):
        raise ShifuError(
            f"{key}={path}: the tokenizer has {len(tokenizer)} token ids, but the model embeds only {rows}: the "
            "tokenizer belongs to another model; save the model's own tokenizer with it (`save_pretrained`)"
        )


def check_length(model: nn.Module, longest: int, path: str | Path) -> None:
    """ShifuError when the longest encoded example (``longest`` tokens, from data file ``path``) runs past a
    model with learned positions (GPT-2's ``n_positions``, a BERT-style encoder's absolute positions); the
    trainers of sft, rm and dpo call it before writing anything."""
    trunk = getattr(model, "backbone", model)
    config = getattr(trunk, "config", None)
    n = getattr(config, "n_positions", None)
    if n is None and getattr(config, "position_embedding_type", None) == "absolute":
        n = getattr(config, "max_position_embeddings", None)
    if isinstance(n, int) and longest > n:
        raise ShifuError(
            f"{path}: the longest example is {longest} tokens, but the model has {n} positions: set "
            f"data.max_len to at most {n} (and data.max_prompt_len below it)"
        )


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


def _load_checked(auto_cls, path: str | Path, what: str, trust_remote_code: bool, dtype) -> nn.Module:
    """``auto_cls.from_pretrained`` of a checked local directory (offline), its loading report checked."""
    p = require_model_dir(path, what, trust_remote_code)
    with _loading(what, p):
        model, info = auto_cls.from_pretrained(
            str(p), local_files_only=True, trust_remote_code=trust_remote_code, dtype=dtype or torch.float32,
            output_loading_info=True, ignore_mismatched_sizes=True,
        )  # fmt: skip
    _check_loaded(model, info, what, p)
    return model


def load_causal_lm(
    path: str | Path, dtype: torch.dtype | None = None, trust_remote_code: bool = False, dropout: bool = True
):
    """AutoModelForCausalLM from a local HF directory (any architecture)."""
    from transformers import AutoModelForCausalLM

    model = _load_checked(AutoModelForCausalLM, path, "model", trust_remote_code, dtype)
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
        freeze_layers: int = 0,
        keep_layers: int = 0,
    ) -> ScalarModel:
        """A fresh scalar head on the backbone of any local HF model (causal LM or encoder); ``keep_layers``
        > 0: only its lowest blocks kept (:func:`keep_lower_layers`); ``freeze_layers`` > 0: its embeddings
        and lowest blocks frozen (:func:`freeze_lower_layers`)."""
        from transformers import AutoModel

        backbone = _load_checked(AutoModel, path, "backbone", trust_remote_code, dtype)
        p = Path(path)
        tok = load_tokenizer(p, trust_remote_code=trust_remote_code)
        check_own_tokenizer(tok, backbone, p, "backbone")
        keep_lower_layers(backbone, keep_layers)
        freeze_lower_layers(backbone, freeze_layers)
        return cls(backbone, tok, seed=seed)

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

    def text_length(self, max_length: int) -> int:
        """``max_length`` capped at the model's positions (``config.max_position_embeddings``, when set)."""
        positions = getattr(self.config, "max_position_embeddings", None)
        return min(max_length, positions) if isinstance(positions, int) and positions > 0 else max_length

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


def new_value_head(hidden_size: int, seed: int) -> nn.Linear:
    """Scalar head N(0, 1/sqrt(d+1)), bias 0 — the spec's initialisation, for the shared-trunk critic."""
    head = nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / (hidden_size + 1) ** 0.5)
        head.bias.zero_()
    return head


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

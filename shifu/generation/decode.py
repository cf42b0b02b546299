"""Decoding for generation: a hand-written forward pass for GPT-2 and Llama-style models with a
preallocated KV cache, and the HF forward with its own cache for every other architecture.

:func:`decoder` picks one; each has ``forward(ids (B, T), positions (B, T)) -> logits (B, V)`` of the last
position (advancing the cache), ``key_mask`` (B, P+R) over the cache and ``last_hidden`` (B, d), the final
(normed) hidden state of the last position (for a shared-trunk value head). Both give the same logits up
to float rounding (``tests/test_rollout.py``). The fast decoders' output embedding is read in the order a
cached probe measured faster (:func:`head_product`). Used by :func:`shifu.generation.rollout.sample`.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor
from torch.nn import functional as F

from shifu.models import lora
from shifu.parallel.precision import Probe, alternating_best


def decoder(model, batch: int, max_len: int, like: Tensor, engine: str, want_hidden: bool = False):
    """The fastest decoder that supports ``model`` (``engine``: "auto", "fast" (must be supported), "hf").

    A model with LoRA adapters (peft) decodes fast too: each adapted layer is its frozen base weight (read in
    place, never copied) and its adapters' low-rank terms, applied as peft applies them
    (:func:`shifu.models.lora.linear`); adapters that are not plain LoRA on linear layers
    (:func:`shifu.models.lora.decodable`) decode through the HF forward."""
    if engine not in ("auto", "fast", "hf"):
        raise ValueError(f"engine must be 'auto', 'fast' or 'hf', not {engine!r}")
    fast = _fast(model) if engine != "hf" else None
    if fast is not None:
        return fast(lora.base_model(model), batch, max_len)
    if engine == "fast":
        what = "these LoRA adapters" if lora.is_lora(model) else f"model type {model.config.model_type!r}"
        raise ValueError(f"no fast decoder for {what}; use 'hf'")
    return _HFDecoder(model, batch, max_len, like, want_hidden)


def _fast(model) -> type[_FastDecoder] | None:
    """The hand-written decoder class for ``model`` (peft's wrapper looked through), or None."""
    if lora.is_lora(model) and not lora.decodable(model):
        return None
    plain = lora.base_model(model)
    return next((cls for cls in (_GPT2Decoder, _LlamaDecoder) if cls.supports(plain)), None)


def keeps_kv(model) -> bool:
    """Whether :func:`decoder` (``engine="auto"``) gives ``model`` a decoder that keeps its own cache."""
    return _fast(model) is not None


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of the cache a decoder that keeps its own (:func:`keeps_kv`) holds
    for ``model``: a token's keys and values are 2 x their product numbers."""
    fast = _fast(model)
    if fast is None:
        raise ValueError(f"no decoder that keeps its own cache for model type {model.config.model_type!r}")
    return fast.kv_shape(lora.base_model(model).config)


class _HFDecoder:
    """Fallback for any architecture: the HF forward with the model's own KV cache."""

    keeps_kv = False  # its cache is the model's own: no prefix reuse (shifu.generation.kv_cache)

    def __init__(self, model, batch: int, max_len: int, like: Tensor, want_hidden: bool = False):
        self.model = model
        self.want_hidden = want_hidden
        self.last_hidden: Tensor | None = None  # (B, d) final hidden state of the last position
        self.key_mask = torch.ones((batch, max_len), dtype=torch.long, device=like.device)
        self.length = 0
        self.cache = None
        # transformers >= 5.2x renamed `past_key_values` to `cache`
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        end = self.length + ids.shape[1]
        kwargs = {} if self.cache is None else {self.cache_kw: self.cache}
        out = self.model(
            input_ids=ids,
            attention_mask=self.key_mask[:, :end],
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=self.want_hidden,
            **kwargs,
        )
        if self.want_hidden:
            self.last_hidden = out.hidden_states[-1][:, -1]
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else out.past_key_values
        self.length = end
        return out.logits[:, -1]


# ---------------------------------------------------------------------------------------------------------
# Fast decode: a hand-written forward for GPT-2 and Llama-style models that reads the HF model's weights
# directly, with a preallocated KV cache (L, B, H, P+R, D) and no per-step module/cache bookkeeping. Any
# other architecture (or an unsupported option) falls back to the HF forward with its own cache.
# ---------------------------------------------------------------------------------------------------------


class _FastDecoder:
    """Shared machinery: preallocated K/V, the key-padding mask over the cache, attention over the cache.

    ``key_mask`` (B, P+R) bool is True on real prompt positions and on every generated position; the
    cache holds K/V of every position (pad ones too) and the mask hides the pad ones. ``k``/``v`` may be
    read and written between forwards (``keeps_kv``: :mod:`shifu.generation.kv_cache`'s prefix reuse), and
    ``length`` set to start a prefill past positions written so. With :attr:`paged` set, a decode step's keys
    and values are written to and read from a block pool instead (:mod:`shifu.generation.paged`).
    """

    keeps_kv = True
    paged = None  # a decode step's view of a block pool (shifu.generation.paged.PagedStep); None: own cache

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, head_dim: int, max_len: int, like: Tensor):
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.key_mask = torch.ones((batch, max_len), dtype=torch.bool, device=like.device)
        self.length = 0  # positions filled in the cache
        self.last_hidden: Tensor | None = None  # (B, d) final (normed) hidden state of the last position
        self.bias: Tensor | None = None  # (B * Hkv, 1, P+R) additive key-padding bias of decode steps

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write k, v (B, Hkv, T, D) at the current end of the cache's first B rows (all of them until
        :meth:`move` retires some); attend q (B, H, T, D) over them."""
        if self.paged is not None:
            return self.paged.attend(layer, q, k, v, scale)
        start, (B, _, T, _) = self.length, q.shape
        end = start + T
        self.k[layer, :B, :, start:end] = k
        self.v[layer, :B, :, start:end] = v
        keys, values = self.k[layer, :B, :, :end], self.v[layer, :B, :, :end]  # views, no copy
        if T == 1:
            return self._attend_one(q, keys, values, scale)
        if keys.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        # causal (query i sees keys <= start + i) and key padding; a pad query with no real key
        # before it attends to itself (its output is never used) so no row of the softmax is empty
        q_pos = torch.arange(start, end, device=q.device).unsqueeze(1)  # (T, 1)
        k_pos = torch.arange(end, device=q.device)  # (S,)
        mask = ((k_pos <= q_pos) & self.key_mask[:B, None, None, :end]) | (k_pos == q_pos)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

    def _attend_one(self, q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """One decode step: softmax(q k^T * scale + bias) v with batched matmuls over (B * Hkv) groups.

        q (B, H, 1, D); keys/values (B, Hkv, S, D) views of the cache. Query heads sharing a KV head (GQA,
        head h uses KV head h // rep) become the ``rep`` rows of one group, so the cache is never copied.
        The additive key-padding bias (0 / -inf) is built once per generation (the mask is fixed then).
        """
        B, H, _, D = q.shape
        Hkv, S = keys.shape[1], keys.shape[2]
        if self.bias is None or self.bias.shape[0] != B * Hkv:
            bias = torch.zeros((B, Hkv, 1, self.key_mask.shape[1]), dtype=q.dtype, device=q.device)
            bias.masked_fill_(~self.key_mask[:B, None, None, :], float("-inf"))
            self.bias = bias.view(B * Hkv, 1, -1)
        qg = q.reshape(B * Hkv, H // Hkv, D)
        scores = torch.baddbmm(
            self.bias[:, :, :S], qg, keys.reshape(B * Hkv, S, D).transpose(1, 2), alpha=scale
        )
        out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(B * Hkv, S, D))
        return out.view(B, H, 1, D)

    def move(self, source: int, target: int) -> None:
        """Copy cache row ``source`` (keys, values, key mask) over row ``target``: a sampler retiring an ended
        row moves its last held row into the ended one's place, and forwards the first rows only."""
        self.k[:, target] = self.k[:, source]
        self.v[:, target] = self.v[:, source]
        self.key_mask[target] = self.key_mask[source]
        self.bias = None

    @contextlib.contextmanager
    def scratch(self, rows: int, width: int):
        """A cache of its own of ``rows`` rows and ``width`` columns, every key unmasked, while the block held
        runs (a prefill of rows admitted into a paged decode: :mod:`shifu.generation.continuous`); the cache,
        :attr:`length` and :attr:`paged` as they were afterwards."""
        saved = self.k, self.v, self.key_mask, self.length, self.paged
        shape = self.k.shape[:1] + (rows,) + self.k.shape[2:3] + (width,) + self.k.shape[4:]
        self.k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        self.v = torch.empty_like(self.k)
        self.key_mask = torch.ones((rows, width), dtype=torch.bool, device=self.k.device)
        self.length, self.paged, self.bias = 0, None, None
        try:
            yield self
        finally:
            self.k, self.v, self.key_mask, self.length, self.paged = saved
            self.bias = None


class _GPT2Decoder(_FastDecoder):
    ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}

    @classmethod
    def supports(cls, model) -> bool:
        cfg = model.config
        return (
            cfg.model_type == "gpt2"
            and hasattr(model, "transformer")
            and cfg.activation_function in cls.ACTIVATIONS
            and cfg.scale_attn_weights
            and not cfg.scale_attn_by_inverse_layer_idx
            and not getattr(cfg, "add_cross_attention", False)
        )

    @staticmethod
    def kv_shape(cfg) -> tuple[int, int, int]:
        return cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head

    def __init__(self, model, batch: int, max_len: int):
        cfg, tr = model.config, model.transformer
        n_layer, self.n_head, self.head_dim = self.kv_shape(cfg)
        super().__init__(n_layer, batch, self.n_head, self.head_dim, max_len, tr.wte.weight)
        self.tr, self.eps = tr, cfg.layer_norm_epsilon
        self.head = head_product(model.lm_head.weight, batch)
        self.approximate = self.ACTIVATIONS[cfg.activation_function]
        # the weights each step reads, looked up once (module attribute access costs ~2 us a time); a LoRA
        # layer's base weight and its adapters' low-rank terms, applied after the base product (lora.linear)
        layers = [
            (b, [lora.linear(m) for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)])
            for b in tr.h
        ]
        self.blocks = [
            (
                b.ln_1.weight,
                b.ln_1.bias,
                *ls[0][:2],
                *ls[1][:2],
                b.ln_2.weight,
                b.ln_2.bias,
                *ls[2][:2],
                *ls[3][:2],
            )
            for b, ls in layers
        ]
        self.low = [tuple(low for _, _, low in ls) for _, ls in layers]  # () for a plain layer

    def forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        """(B, T) ids at (B, T) positions -> (B, V) logits of the last position; advances the cache."""
        tr, (B, T), H, D, eps = self.tr, ids.shape, self.n_head, self.head_dim, self.eps
        x = F.embedding(ids, tr.wte.weight) + F.embedding(pos, tr.wpe.weight)  # (B, T, d)
        d = x.shape[-1]
        x = x.view(B * T, d)
        for i, (ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, fc_w, fc_b, pr_w, pr_b) in enumerate(
            self.blocks
        ):
            low_qkv, low_o, low_fc, low_pr = self.low[i]
            h = F.layer_norm(x, (d,), ln1_w, ln1_b, eps)
            qkv = torch.addmm(qkv_b, h, qkv_w)  # Conv1D: x @ W + b
            qkv = lora.add_low_rank(qkv, h, low_qkv) if low_qkv else qkv
            q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
            a = self.attend(i, q, k, v, D**-0.5).transpose(1, 2).reshape(B * T, d)
            o = torch.addmm(o_b, a, o_w)
            x = (lora.add_low_rank(o, a, low_o) if low_o else o).add_(x)
            h = F.layer_norm(x, (d,), ln2_w, ln2_b, eps)
            fc = torch.addmm(fc_b, h, fc_w)
            h = F.gelu(lora.add_low_rank(fc, h, low_fc) if low_fc else fc, approximate=self.approximate)
            pr = torch.addmm(pr_b, h, pr_w)
            x = (lora.add_low_rank(pr, h, low_pr) if low_pr else pr).add_(x)
        self.length += T
        last = x.view(B, T, d)[:, -1]
        self.last_hidden = F.layer_norm(last, (d,), tr.ln_f.weight, tr.ln_f.bias, eps)
        return self.head(self.last_hidden)


class _LlamaDecoder(_FastDecoder):
    """Llama-style: RMSNorm, rotary embeddings (the model's own rotary module), GQA, SwiGLU MLP."""

    MODEL_TYPES = {"llama", "mistral", "qwen2"}

    @classmethod
    def supports(cls, model) -> bool:
        cfg = model.config
        inner = getattr(model, "model", None)
        return (
            cfg.model_type in cls.MODEL_TYPES
            and inner is not None
            and hasattr(inner, "rotary_emb")
            and getattr(cfg, "hidden_act", "silu") == "silu"
            and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "sliding_window", None) is None
            and getattr(cfg, "pretraining_tp", 1) == 1
            and (cfg.rope_parameters or {}).get("rope_type", "default") != "dynamic"
        )

    @staticmethod
    def kv_shape(cfg) -> tuple[int, int, int]:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim

    def __init__(self, model, batch: int, max_len: int):
        cfg, inner = model.config, model.model
        n_layer, self.n_kv, self.head_dim = self.kv_shape(cfg)
        self.n_head = cfg.num_attention_heads
        w = inner.embed_tokens.weight
        super().__init__(n_layer, batch, self.n_kv, self.head_dim, max_len, w)
        self.inner, self.eps = inner, cfg.rms_norm_eps
        self.head = head_product(model.lm_head.weight, batch)
        self.scale = self.head_dim**-0.5
        # q/k/v and gate/up fused into one matmul each (weights change between rollouts: fuse per call). A model
        # with LoRA adapters keeps its seven projections apart, each its base weight (never copied: it is frozen)
        # and its adapters' low-rank terms (lora.linear), as peft computes them
        proj = [
            [
                lora.linear(m)
                for m in (
                    at.q_proj,
                    at.k_proj,
                    at.v_proj,
                    at.o_proj,
                    mlp.gate_proj,
                    mlp.up_proj,
                    mlp.down_proj,
                )
            ]
            for at, mlp in ((blk.self_attn, blk.mlp) for blk in inner.layers)
        ]
        self.proj = proj if any(low for ps in proj for _, _, low in ps) else None
        self.qkv, self.qkv_bias, self.gate_up = [], [], []
        for blk in inner.layers if self.proj is None else []:
            at, mlp = blk.self_attn, blk.mlp
            self.qkv.append(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]).t())
            biases = [at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]
            self.qkv_bias.append(None if biases[0] is None else torch.cat(biases))
            self.gate_up.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t())

    def forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        inner, (B, T) = self.inner, ids.shape
        H, Hkv, D = self.n_head, self.n_kv, self.head_dim
        x = F.embedding(ids, inner.embed_tokens.weight)  # (B, T, d)
        cos, sin = inner.rotary_emb(x, pos)  # (B, T, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        d = x.shape[-1]
        x = x.view(B * T, d)
        for i, blk in enumerate(inner.layers):
            p = None if self.proj is None else self.proj[i]
            h = F.rms_norm(x, (d,), blk.input_layernorm.weight, self.eps)
            if p is not None:
                q, k, v = (_adapted(h, *p[j]) for j in range(3))
            else:
                qkv = (
                    h @ self.qkv[i]
                    if self.qkv_bias[i] is None
                    else torch.addmm(self.qkv_bias[i], h, self.qkv[i])
                )
                q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = _rope(q.reshape(B, T, H, D).transpose(1, 2), cos, sin)
            k = _rope(k.reshape(B, T, Hkv, D).transpose(1, 2), cos, sin)
            v = v.reshape(B, T, Hkv, D).transpose(1, 2)
            a = self.attend(i, q, k, v, self.scale).transpose(1, 2).reshape(B * T, H * D)
            o = blk.self_attn.o_proj
            x = (F.linear(a, o.weight, o.bias) if p is None else _adapted(a, *p[3])).add_(x)
            h = F.rms_norm(x, (d,), blk.post_attention_layernorm.weight, self.eps)
            if p is not None:
                m = F.silu(_adapted(h, *p[4])).mul_(_adapted(h, *p[5]))
                x = _adapted(m, *p[6]).add_(x)
            else:
                gate, up = (h @ self.gate_up[i]).chunk(2, dim=-1)
                x = (F.silu(gate).mul_(up) @ blk.mlp.down_proj.weight.t()).add_(x)
        self.length += T
        self.last_hidden = F.rms_norm(x.view(B, T, d)[:, -1], (d,), inner.norm.weight, self.eps)
        return self.head(self.last_hidden)


def _adapted(x: Tensor, weight: Tensor, bias: Tensor | None, low) -> Tensor:
    """A LoRA model's projection: the base layer's product, then its adapters' low-rank terms (lora.linear)."""
    return lora.add_low_rank(F.linear(x, weight, bias), x, low)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half convention (Su et al. 2021; HF Llama's layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- the output embedding's product
HEAD_MARGIN, HEAD_MIN_SAVING_S = 0.8, 1e-3
_HEAD_LAYOUTS: dict[str, bool] = {}  # this process's answers, by probe name


def head_product(weight: Tensor, rows: int):
    """``h (rows, d) -> logits (rows, V)`` of a decode step, ``h @ W^T`` as ``F.linear`` or as ``(W @ h^T)^T``,
    whichever a probe measured faster on the CPU it runs on for this weight's shape, dtype and row count.

    At a few rows a decode step is a matrix-vector product: its time is the time to read the weight. With
    torch 2.13's CPU GEMM, one thread, the SmolLM2-135M head (49152 x 576, fp32) at 4 rows read 2.1-2.3x
    faster as the left operand (7.7-8.5 ms against 16.9-18.3 ms, the AVX-512 VM; ``python
    benchmarks/decode_weights.py``), in bf16 slower (10.2 against 7.8 ms); at 16-32 rows the plain order won.
    The two orders round differently (~1e-6), so the choice must not flip between runs on one machine: it
    is kept in the probe's cache (:class:`shifu.parallel.precision.Probe`, ``decode head ...`` entries) and taken
    only when it measures below ``HEAD_MARGIN`` x the plain time *and* saves ``HEAD_MIN_SAVING_S`` per
    step (a small head is read from cache either way; timing noise there never changes the rounding)."""
    n, d = weight.shape
    name = f"decode head {rows}x{d}x{n} {str(weight.dtype).removeprefix('torch.')}"
    if name not in _HEAD_LAYOUTS:
        probe = Probe(weight.device)
        plain, left = probe.pair(name, lambda: _time_head(weight, rows))
        _HEAD_LAYOUTS[name] = left < HEAD_MARGIN * plain and plain - left > HEAD_MIN_SAVING_S
        if probe.measured:
            probe.save()
    order = _weight_left if _HEAD_LAYOUTS[name] else F.linear
    return lambda h: order(h, weight)


def _weight_left(h: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(h, weight)`` computed as ``(weight @ h^T)^T``, contiguous."""
    return (weight @ h.t()).t().contiguous()


@torch.no_grad()
def _time_head(weight: Tensor, rows: int) -> tuple[float, float]:
    """Seconds of ``F.linear(h, W)`` and of ``(W @ h^T)^T`` at ``rows`` rows: best of three, alternating."""
    h = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
    return alternating_best(lambda: F.linear(h, weight), lambda: _weight_left(h, weight), weight.device)

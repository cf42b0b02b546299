"""bf16 where it measures faster: a short GEMM probe at the model's own shapes (cached per machine) decides,
phase by phase, whether PPO decodes, scores with the frozen models and runs its update in bf16 (and, by
:func:`training`, whether SFT, reward-model and DPO training steps run under bf16 autocast); and the
weight copies that follow from the decision (cast once, never per op).

Why measure instead of reading a CPU flag: whether bf16 pays depends on the hardware (native avx512_bf16 /
AMX or emulation, CUDA), on the shapes (a decode step's 32-row GEMMs are bound by weight traffic, which bf16
halves; a large update GEMM is bound by arithmetic) and on how the weights are held (autocast casts an fp32
weight at every op; a bf16 copy is cast once). On one 2-core AMD EPYC VM with avx512_bf16, one thread,
bf16 ``F.linear`` at (512 x 576 x 1536) measured 0.54x fp32's speed one day and 2.1x on another.

The four decisions (each bf16 only if its probe time is below ``MARGIN`` x fp32's):

- ``frozen``: the reference holds a bf16 copy of its weights (no autocast); probed as no-grad ``F.linear``
  with bf16 weights at the scoring forwards' shapes.
- ``reward``: the same for the reward model, probed at *its* shapes (a MiniLM reward model's 384 x 1536
  GEMMs can gain from bf16 where a width-128 policy's lose).
- ``update``: bf16 autocast in the update's forwards (actor, critic) and in the rollout's recomputation of
  the old log-probs and values; master weights, gradients and optimiser state stay fp32. Probed as forward
  + backward of ``F.linear`` with an fp32 weight, plain vs under autocast.
- ``decode``: generation reads a bf16 copy of the actor, refreshed from the fp32 weights at every rollout
  (so once per iteration, after the update). The decode's log-probs then differ from the trainer's, so
  the old log-probs are recomputed by a full forward (logged: ``rollout/mismatch_*``); when the fp32 decode
  would have saved that forward, bf16 decode is chosen only if the decode time it saves exceeds the
  forward's (both from the probe).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

MARGIN = 0.9  # bf16 must measure below 0.9 x fp32's time: within noise, fp32 (exact, no mismatch) wins
PROBE_ROWS = 256  # larger GEMMs are timed at 256 rows and scaled (time is linear in rows from here on)
CACHE_FILE = "bf16_probe.json"


@dataclasses.dataclass(frozen=True)
class Precision:
    """Which phases run in bf16 (see the module docstring) and why, in one line."""

    decode: bool = False
    frozen: bool = False
    update: bool = False
    reason: str = "bf16=false"
    reward: bool = False

    @property
    def any(self) -> bool:
        return self.decode or self.frozen or self.update or self.reward

    def metrics(self) -> dict[str, float]:
        return {
            "precision/bf16_decode": float(self.decode),
            "precision/bf16_frozen": float(self.frozen),
            "precision/bf16_update": float(self.update),
            "precision/bf16_reward": float(self.reward),
        }


FP32 = Precision()


@dataclasses.dataclass(frozen=True)
class Workload:
    """The GEMM shapes of one PPO iteration: ``trunk`` (in, out, count) of the model's linear layers
    except the output embedding ``head`` (in, out); rows of the decode steps, of the scoring forwards and
    of an update micro-batch; sequence length ``T`` = prompt + response and response length ``R``."""

    trunk: tuple[tuple[int, int, int], ...]
    head: tuple[int, int] | None
    decode_rows: int
    score_rows: int
    train_rows: int
    T: int
    R: int


def linear_shapes(model: nn.Module) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, int] | None]:
    """(``((in, out, count), ...)`` of every linear layer but the output embedding, ``(in, out)`` of the
    output embedding or None). GPT-2's ``Conv1D`` (weight ``(in, out)``) counts as a linear layer."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    counts: dict[tuple[int, int], int] = {}
    for mod in model.modules():
        if mod is head:
            continue
        w = getattr(mod, "weight", None)
        if isinstance(mod, nn.Linear):
            key = (w.shape[1], w.shape[0])
        elif type(mod).__name__ == "Conv1D" and w is not None and w.dim() == 2:
            key = (w.shape[0], w.shape[1])
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    trunk = tuple((k, n, c) for (k, n), c in sorted(counts.items()))
    head_shape = None if head is None else (head.weight.shape[1], head.weight.shape[0])
    return trunk, head_shape


def cache_dir() -> Path:
    return Path(os.environ.get("SHIFU_CACHE") or Path.home() / ".cache" / "shifu")


# /proc/cpuinfo flags that change which GEMM kernels torch can run: two VMs may report the same model name
# ("AMD EPYC") with and without AVX-512 / native bf16, where bf16 measured ~2x faster and ~10x slower.
# Read per line, x86 ``flags`` apart from Arm ``Features`` (Graviton 3, Neoverse V1/V2: sve, bf16, i8mm):
# the names overlap (x86's ``sme`` is AMD's memory encryption, Arm's the matrix extension)
ISA_FLAGS = {
    "flags": ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"),
    "Features": ("asimd", "sve", "sve2", "bf16", "i8mm", "sme"),
}


def cpu_name_and_isa(cpuinfo: str) -> str:
    """``model name`` and the :data:`ISA_FLAGS` (x86 ``flags``, Arm ``Features``) of the first processor in
    ``/proc/cpuinfo`` text."""
    name, isa = "", None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key in ISA_FLAGS and isa is None:
            isa = [f for f in ISA_FLAGS[key] if f in value.split()]
        if name and isa is not None:
            break
    return f"{name or platform.processor() or platform.machine()}|{'+'.join(isa or []) or 'no isa flags'}"


def machine_key(device: torch.device) -> str:
    """What a probe result depends on besides the shape: the processor (its name and its GEMM-relevant ISA
    flags), torch, the thread count."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # no /proc (macOS, Windows): cpu_name_and_isa falls back to platform's name
            cpuinfo = ""
        name = cpu_name_and_isa(cpuinfo)
    return f"{device.type}|{name}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def measure(kind: str, m: int, k: int, n: int, device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """Best-of-``repeats`` seconds ``(fp32, bf16)`` of one ``(m, k) x (k, n)`` linear, alternating.

    ``kind`` "infer": no grad, the bf16 weight held in bf16. "train": forward + backward (input and weight
    gradients) with an fp32 weight, plain vs under bf16 autocast."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device)
    if kind == "infer":
        x16, w16 = x.bfloat16(), w.bfloat16()

        def run32():
            with torch.no_grad():
                F.linear(x, w)

        def run16():
            with torch.no_grad():
                F.linear(x16, w16)
    else:
        x.requires_grad_(True), w.requires_grad_(True)
        grad = torch.randn(m, n, generator=g).to(device)
        grad16 = grad.bfloat16()

        def run32():
            x.grad = w.grad = None
            F.linear(x, w).backward(grad)

        def run16():
            x.grad = w.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = F.linear(x, w)
            y.backward(grad16)

    return alternating_best(run32, run16, device, repeats)


def alternating_best(a, b, device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of calls ``a()`` and ``b()``, alternated, after one warm-up round of each
    (CUDA synchronised around every call)."""
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):  # the first round warms up
        for j, fn in enumerate((a, b)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                best[j] = min(best[j], time.perf_counter() - t0)
    return best[0], best[1]


class Probe:
    """Pairs of timings, measured once per machine and kept in ``$SHIFU_CACHE/bf16_probe.json`` (default
    ``~/.cache/shifu``) under :func:`machine_key`: ``(fp32, bf16)`` per GEMM, and the decoders' two ways of
    reading the output embedding (:func:`shifu.generation.decode.head_product`). ``cached`` / ``measured`` count the lookups."""

    def __init__(self, device: torch.device, path: Path | None = None):
        self.device, self.key = device, machine_key(device)
        self.path = path or cache_dir() / CACHE_FILE
        self.cached = self.measured = 0
        try:
            self.table = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.table = {}
        self.entries = self.table.setdefault(self.key, {})

    def time(self, kind: str, rows: int, k: int, n: int) -> tuple[float, float]:
        """Seconds ``(fp32, bf16)`` of a ``(rows, k) x (k, n)`` linear; timed at <= PROBE_ROWS rows, scaled."""
        m = min(rows, PROBE_ROWS)
        t32, t16 = self.pair(f"{kind} {m}x{k}x{n}", lambda: measure(kind, m, k, n, self.device))
        return t32 * rows / m, t16 * rows / m

    def pair(self, name: str, measure_now) -> tuple[float, float]:
        """The two timings kept under ``name``; ``measure_now()`` gives them the first time on a CPU."""
        if name in self.entries:
            self.cached += 1
        else:
            self.entries[name] = [float(t) for t in measure_now()]
            self.measured += 1
        a, b = self.entries[name]
        return a, b

    def save(self) -> None:
        """Write the table atomically (a read-only or missing home only costs the next run a new probe)."""
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.table, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)


def forward_time(probe: Probe, w: Workload, kind: str, rows: int, logit_rows: int) -> tuple[float, float]:
    """(fp32, bf16) seconds of the model's linear layers over ``rows`` token positions, the output
    embedding over ``logit_rows`` (0: none)."""
    t = [0.0, 0.0]
    for k, n, count in w.trunk:
        a, b = probe.time(kind, rows, k, n)
        t[0], t[1] = t[0] + count * a, t[1] + count * b
    if w.head is not None and logit_rows:
        a, b = probe.time(kind, logit_rows, *w.head)
        t[0], t[1] = t[0] + a, t[1] + b
    return t[0], t[1]


def choose(
    w: Workload,
    probe: Probe,
    reuse_saves_forward: bool,
    decode_possible: bool = True,
    reward: Workload | None = None,
) -> Precision:
    """The decisions of the module docstring from the probe's timings of the workload ``w``.

    ``reuse_saves_forward``: an fp32 decode would give the old log-probs for free (PPO's default), so a
    bf16 decode must also pay for the actor forward that recomputes them. ``decode_possible``: False when
    the actor cannot have a bf16 copy (sharded, LoRA), said in the reason. ``reward``: the reward model's
    scoring forward (its own linear layers, ``score_rows`` x ``T`` positions), None without a model."""
    s32, s16 = forward_time(probe, w, "infer", w.score_rows * w.T, w.score_rows * w.R)  # one forward
    u32, u16 = forward_time(probe, w, "train", w.train_rows * w.T, w.train_rows * w.R)
    d32, d16 = forward_time(probe, w, "infer", w.decode_rows, w.decode_rows)  # one decode step
    frozen, update = s16 < MARGIN * s32, u16 < MARGIN * u32
    saved = w.R * (d32 - d16)  # per generation
    # an fp32 update reuses the fp32 decode's log-probs; a bf16 decode costs it an fp32 actor forward over
    # every row (a bf16-autocast update recomputes them anyway)
    n_fwd = -(-w.decode_rows // w.score_rows)
    recompute = n_fwd * s32 if reuse_saves_forward and not update else 0.0
    decode = decode_possible and d16 < MARGIN * d32 and saved > recompute

    def ms(a, b):
        return f"{a * 1e3:.1f} vs {b * 1e3:.1f} ms"

    why = [
        f"decode step {ms(d32, d16)} fp32 vs bf16"
        + ("" if decode_possible else " (no bf16 copy of this actor: sharded or LoRA)")
        + (
            f", saving {saved * 1e3:.0f} ms per generation against a {recompute * 1e3:.0f} ms old-log-prob forward"
            if recompute
            else ""
        )
        + f" -> {'bf16' if decode else 'fp32'}",
        f"frozen scoring forward {ms(s32, s16)} -> {'bf16' if frozen else 'fp32'}",
        f"update forward+backward {ms(u32, u16)} -> {'bf16 autocast' if update else 'fp32'}",
    ]
    rewarded = False
    if reward is not None:
        r32, r16 = forward_time(probe, reward, "infer", reward.score_rows * reward.T, 0)
        rewarded = r16 < MARGIN * r32
        why.append(f"reward model scoring forward {ms(r32, r16)} -> {'bf16' if rewarded else 'fp32'}")
    src = "measured now" if probe.measured else "cached"
    reason = f"bf16 probe ({probe.key}; {src}, {probe.path}): " + "; ".join(why)
    return Precision(decode, frozen, update, reason, rewarded)


def training(model: nn.Module, rows: int, T: int, probe: Probe) -> tuple[bool, str]:
    """``bf16=true`` of ``shifu sft`` / ``rm`` / ``dpo``: bf16 autocast for the training step only when forward +
    backward of ``model``'s linear layers over a micro-batch of ``rows`` sequences of ``T`` tokens (its output
    embedding, if it has one, at every position) probes below ``MARGIN`` x fp32's time. Returns ``(bf16,
    reason)``. The same probe as PPO's ``update`` decision, at the trainer's own shapes: on a CPU without
    native bf16 it keeps fp32 (emulated bf16 GEMMs measured ~10x slower)."""
    trunk, head = linear_shapes(model)
    w = Workload(trunk, head, 0, 0, rows, T, T)
    t32, t16 = forward_time(probe, w, "train", rows * T, rows * T)
    use = t16 < MARGIN * t32
    src = "measured now" if probe.measured else "cached"
    why = f"training forward+backward {t32 * 1e3:.1f} vs {t16 * 1e3:.1f} ms fp32 vs bf16"
    return (
        use,
        f"bf16 probe ({probe.key}; {src}, {probe.path}): {why} -> {'bf16 autocast' if use else 'fp32'}",
    )


# ----------------------------------------------------------------------------------------- weights
def cast_parameters(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Cast ``model``'s floating-point parameters in place, once (buffers such as rotary frequencies and
    a reward model's gain/bias stay as they are)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return model


def bf16_copy(model: nn.Module) -> nn.Module:
    """A frozen bf16 copy of ``model`` (for decoding); :func:`refresh` copies the trained weights in."""
    clone = copy.deepcopy(model)
    return cast_parameters(clone.eval().requires_grad_(False))


@torch.no_grad()
def refresh(clone: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s (fp32) weights into the bf16 ``clone`` (same structure; tied weights counted once)."""
    for dst, src in zip(clone.parameters(), source.parameters(), strict=True):
        dst.copy_(src)

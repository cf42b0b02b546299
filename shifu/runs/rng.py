"""The random number generators' state (Python, NumPy, torch CPU and CUDA) as JSON, saved in every checkpoint's
``state.json`` so that a resumed run draws exactly the numbers the uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG state as JSON-able data (python, numpy, torch CPU and CUDA)."""
    st: dict[str, Any] = {
        "python": _py_state_to_json(random.getstate()),
        "numpy": _np_state_to_json(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(_py_state_from_json(st["python"]))
    np.random.set_state(_np_state_from_json(st["numpy"]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])


def _py_state_to_json(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def _py_state_from_json(s: list) -> tuple:
    return (s[0], tuple(s[1]), s[2])


def _np_state_to_json(s: tuple) -> list:
    return [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]


def _np_state_from_json(s: list) -> tuple:
    return (s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4])

"""What every trainer of this package uses: tokenising texts, the learning-rate schedule over a
wall-clock budget, and the check of hyperparameter names."""

from __future__ import annotations

import math

import numpy as np

from specstack import SpecstackError


def encode(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Tokenise each text without special tokens -> list of int64 arrays."""
    return [np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=np.int64) for t in texts]


def lr_factor(frac: float, warmup: float) -> float:
    """Linear warm-up then cosine decay to 5%, as a function of elapsed budget fraction."""
    if frac < warmup:
        return frac / warmup
    p = min(1.0, (frac - warmup) / max(1e-9, 1 - warmup))
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))


def check_names(hyperparams: dict, defaults: dict) -> None:
    """Every key must be one of ``defaults`` (one error line naming the first, in sorted order, that is not)."""
    unknown = sorted(set(hyperparams) - set(defaults))
    if unknown:
        raise SpecstackError(f"hyperparameter {unknown[0]!r} is not allowed; use {', '.join(defaults)}")

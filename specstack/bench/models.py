"""Where a benchmark gets its models: the embedded default, models given by the caller, or synthetic
models with a byte tokenizer (no weights needed; for tests and for trying the harness out).

A model source is picklable and loads in the process that runs the points, so a Ray task can load
its own copy; ``label`` names the models in every point id.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import attrs

from ..errors import SpecstackError


@attrs.frozen(kw_only=True, eq=False)
class Models:
    """A target, an optional draft (for stacks that need one) and their shared tokenizer."""

    target: Any
    draft: Any
    tokenizer: Any

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return () if eos is None else (int(eos),)


class ModelSource(Protocol):
    label: str

    def load(self) -> Models: ...


@attrs.frozen(kw_only=True)
class DefaultModels:
    """The embedded default (SmolLM2-135M-Instruct and its distilled draft), loaded in ``dtype``."""

    dtype: str = "float32"

    @property
    def label(self) -> str:
        from ..models import TARGET_NAME

        return TARGET_NAME

    def load(self) -> Models:
        import torch

        from ..models import load_default

        target, draft, tokenizer = load_default(dtype=getattr(torch, self.dtype))
        return Models(target=target, draft=draft, tokenizer=tokenizer)


@attrs.frozen(kw_only=True, eq=False)
class GivenModels:
    """Models the caller already loaded (pickled to each worker by the Ray executor)."""

    models: Models

    @property
    def label(self) -> str:
        target = self.models.target
        return str(getattr(target, "name", None) or type(target).__name__)

    def load(self) -> Models:
        return self.models


@attrs.frozen(kw_only=True)
class Encoding:
    input_ids: list[int]


@attrs.frozen(kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255: enough of a tokenizer for the tasks and synthetic models."""

    eos_token_id: int | None = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(input_ids=list(text.encode("utf-8")))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@attrs.frozen(kw_only=True)
class SyntheticModels:
    """A :class:`~specstack.synthetic.SyntheticLM` target over bytes and a correlated draft."""

    vocab_size: int = 256
    seed: int = 0
    sharpness: float = 3.0
    draft_noise: float = 0.5
    max_length: int = 8192

    def __attrs_post_init__(self) -> None:
        if self.vocab_size < 256:
            raise SpecstackError(f"synthetic vocab_size {self.vocab_size} is too small for the byte tokenizer; use at least 256")

    @property
    def label(self) -> str:
        return f"synthetic-v{self.vocab_size}-s{self.seed}"

    def load(self) -> Models:
        from ..synthetic import SyntheticLM

        common = dict(vocab_size=self.vocab_size, max_length=self.max_length)
        target = SyntheticLM(seed=self.seed, sharpness=self.sharpness, **common)
        draft = SyntheticLM(seed=self.seed + 1, base=target, noise=self.draft_noise, **common)
        return Models(target=target, draft=draft, tokenizer=ByteTokenizer())


def model_source(models: Any, dtype: str) -> ModelSource:
    """``None`` (the embedded default), a ``(target, draft, tokenizer)`` tuple, or a model source."""
    if models is None:
        return DefaultModels(dtype=dtype)
    if isinstance(models, Models):
        return GivenModels(models=models)
    if isinstance(models, (tuple, list)) and len(models) == 3:
        return GivenModels(models=Models(target=models[0], draft=models[1], tokenizer=models[2]))
    if callable(getattr(models, "load", None)) and isinstance(getattr(models, "label", None), str):
        return models
    raise SpecstackError(f"models {type(models).__name__} is not allowed; pass None (the embedded default), (target, draft, tokenizer) or a model source")

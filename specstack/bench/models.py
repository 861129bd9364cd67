"""Where a benchmark gets its models: the embedded default, models given by the caller, or synthetic
models with a byte tokenizer (no weights needed; for tests and for trying the harness out).

A model source is picklable and loads in the process that runs the points, so a Ray task can load
its own copy; ``label`` names the models in every point id, ``device`` and ``draft_device`` say
where they run (``cpu``, ``cuda`` or ``cuda:N``; ``draft_device`` is ``None`` without a draft).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import attrs
import torch

from ..errors import SpecstackError
from ..run import check_device


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

    @property
    def cuda_devices(self) -> tuple[torch.device, ...]:
        """The CUDA devices the models sit on (none on the CPU)."""
        found = [torch.device(device_of(model)) for model in (self.target, self.draft) if model is not None]
        return tuple(dict.fromkeys(device for device in found if device.type == "cuda"))

    def synchronize(self) -> None:
        """Wait for the work queued on the models' CUDA devices (before reading a clock)."""
        for device in self.cuda_devices:
            torch.cuda.synchronize(device)


def device_of(model: Any) -> str:
    """Where a model runs: its ``device``, or the CPU for a model that has none."""
    return str(getattr(model, "device", None) or "cpu")


class ModelSource(Protocol):
    label: str
    device: str
    draft_device: str | None

    def load(self) -> Models: ...


@attrs.frozen(kw_only=True)
class DefaultModels:
    """The embedded default (SmolLM2-135M-Instruct and its distilled draft), loaded in ``dtype``, the
    target on ``device`` and the draft on ``draft_device``."""

    dtype: str = "float32"
    device: str = "cpu"
    draft_device: str = "cpu"
    context: int | None = None  # the target's window; None: its trained one
    rope_scaling: str | None = "yarn"  # how a window beyond the trained one is reached

    @property
    def label(self) -> str:
        """The target's name, and its window when one was set (a RoPE-scaled model is another model:
        its runs never share ids with the unscaled one's)."""
        from ..models import TARGET_NAME

        return TARGET_NAME if self.context is None else f"{TARGET_NAME}@{self.context}:{self.rope_scaling}"

    def load(self) -> Models:
        from ..models import load_default

        target, draft, tokenizer = load_default(dtype=getattr(torch, self.dtype), device=self.device, draft_device=self.draft_device,
                                                context=self.context, rope_scaling=self.rope_scaling)
        return Models(target=target, draft=draft, tokenizer=tokenizer)


@attrs.frozen(kw_only=True, eq=False)
class GivenModels:
    """Models the caller already loaded (pickled to each worker by the Ray executor), where they are."""

    models: Models

    @property
    def label(self) -> str:
        target = self.models.target
        return str(getattr(target, "name", None) or type(target).__name__)

    @property
    def device(self) -> str:
        return device_of(self.models.target)

    @property
    def draft_device(self) -> str | None:
        return None if self.models.draft is None else device_of(self.models.draft)

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


def _spelled_device(instance, attribute, value) -> None:
    check_device(value, available=False)  # whether it exists is checked where the models load


@attrs.frozen(kw_only=True)
class SyntheticModels:
    """A :class:`~specstack.synthetic.SyntheticLM` target over bytes on ``device`` and a correlated draft on
    ``draft_device`` (default: ``device``)."""

    vocab_size: int = 256
    seed: int = 0
    sharpness: float = 3.0
    draft_noise: float = 0.5
    max_length: int = 8192
    device: str = attrs.field(default="cpu", validator=_spelled_device)
    draft_device: str = attrs.field(default=attrs.Factory(lambda self: self.device, takes_self=True), validator=_spelled_device)

    def __attrs_post_init__(self) -> None:
        if self.vocab_size < 256:
            raise SpecstackError(f"synthetic vocab_size {self.vocab_size} is too small for the byte tokenizer; use at least 256")

    @property
    def label(self) -> str:
        return f"synthetic-v{self.vocab_size}-s{self.seed}"

    def load(self) -> Models:
        from ..synthetic import SyntheticLM

        common = dict(vocab_size=self.vocab_size, max_length=self.max_length)
        target = SyntheticLM(seed=self.seed, sharpness=self.sharpness, device=check_device(self.device), **common)
        draft = SyntheticLM(seed=self.seed + 1, base=target, noise=self.draft_noise, device=check_device(self.draft_device), **common)
        return Models(target=target, draft=draft, tokenizer=ByteTokenizer())


def model_source(models: Any, grid: Any) -> ModelSource:
    """``None`` (the embedded default, in the grid's dtype on its devices), a ``(target, draft,
    tokenizer)`` tuple, or a model source. Models that are already placed must sit where the grid's
    ``device`` and ``draft_device`` say, if it says."""
    if models is None:
        device = grid.device or "cpu"
        scaling = None if grid.rope_scaling == "none" else grid.rope_scaling
        return DefaultModels(dtype=grid.dtype, device=device, draft_device=grid.draft_device or device, context=grid.context, rope_scaling=scaling)
    if isinstance(models, Models):
        source = GivenModels(models=models)
    elif isinstance(models, (tuple, list)) and len(models) == 3:
        source = GivenModels(models=Models(target=models[0], draft=models[1], tokenizer=models[2]))
    elif callable(getattr(models, "load", None)) and isinstance(getattr(models, "label", None), str):
        source = models
    else:
        raise SpecstackError(f"models {type(models).__name__} is not allowed; pass None (the embedded default), (target, draft, tokenizer) or a model source")
    for key, asked, actual in zip(("device", "draft_device"), (grid.device, grid.draft_device), devices_of(source)):
        if asked is not None and actual is not None and not _same_device(asked, actual):
            raise SpecstackError(f"grid key '{key}' {asked!r} is not allowed with models {source.label}, which run on {actual}; "
                                 f"use {actual} or leave '{key}' out")
    return source


def devices_of(source: ModelSource) -> tuple[str, str | None]:
    """``(device, draft_device)`` of a source's models (the CPU for a source that does not say)."""
    return getattr(source, "device", None) or "cpu", getattr(source, "draft_device", "cpu")


def _same_device(asked: str, actual: str) -> bool:
    """``cuda`` names the current CUDA device (the first, on a machine without CUDA)."""
    a, b = torch.device(asked), torch.device(actual)
    if a == b or a.type != "cuda" or b.type != "cuda":
        return a == b
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)

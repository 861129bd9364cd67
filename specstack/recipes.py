"""Stack recipes: named compositions of levels, registered like any other component."""

from __future__ import annotations

import inspect
from typing import Callable

import attrs

from .errors import SpecstackError


@attrs.frozen(kw_only=True)
class StackRecipe:
    """``build(registry, target=…, draft=…, **options)`` returns the levels, lowest first.

    ``needs_draft`` says whether the recipe needs a draft model in addition to the target.
    ``conformance_options(vocab)``, for a recipe whose default weights are made for one model (Medusa's
    heads), gives the options under which it runs on the conformance suite's synthetic models.
    """

    name: str
    description: str
    build: Callable
    needs_draft: bool = False
    conformance_options: Callable[[int], dict] | None = None

    def options(self) -> dict[str, object]:
        """The recipe's tunable parameters and their defaults."""
        params = inspect.signature(self.build).parameters.values()
        return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in ("target", "draft")}

    def levels(self, registry, *, target, draft=None, **options) -> list:
        if self.needs_draft and draft is None:
            raise SpecstackError(f"stack '{self.name}' needs a draft model; pass one")
        unknown = sorted(set(options) - set(self.options()))
        if unknown:
            tuning = " (gamma=auto or gamma=adaptive tunes every level's γ)" if unknown[0] == "gamma" else ""
            raise SpecstackError(f"stack '{self.name}' has no option '{unknown[0]}'; options: {', '.join(self.options()) or 'none'}{tuning}")
        extra = {"draft": draft} if self.needs_draft else {}
        return self.build(registry, target=target, **extra, **options)

"""The EAGLE drafter: the chained heads' trees, each step one row of EAGLE's draft layer over the target's features.

Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (the layer:
:mod:`specstack_medusa.eagle`). It drafts as :class:`~specstack_medusa.drafter.MedusaDrafter` drafts with chained
heads (the same trees of rank paths, pricing, draft vocabulary, drawn candidates); only a step differs. A chained
head's step reads one state and one token. Here a step is a row of the draft layer, and the row attends over:

* the rows of the last ``window`` committed positions. Their features are the level's own last hidden states, read
  through the :class:`~specstack.channels.HiddenStateChannel` (:meth:`~specstack.channels.HiddenStateChannel.run`;
  the drafter asks the level to log the last ``window`` rows of each forward, so a prompt's last positions too)
  and kept as keys and values in a :class:`~specstack_medusa.eagle.FeatureCache`;
* the drafted rows on its path in the tree (its ancestors), and itself (EAGLE's tree attention).

Committed rows are computed once, as the text grows. A round adds the rows of the positions the level committed
since the last one, and the row of q, the position whose state drafts (it reads x_{q+1}, committed). Rows whose
token the prefix no longer holds are dropped first (a level below the top may see its tokens rejected). The
drafted rows live for one round.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import attrs
import numpy as np
import torch

from specstack import LevelStats

from .drafter import MedusaDrafter
from .eagle import EagleLayer, FeatureCache, attend, load_layer, synthetic_layer


@attrs.define(eq=False, kw_only=True)
class EagleDrafter(MedusaDrafter):
    """Level 0 of the ``eagle`` stacks: ``tree_size`` candidates from EAGLE's draft layer ``heads`` (a layer file,
    the name of a shipped layer (``eagle``, the default) or a loaded :class:`~specstack_medusa.eagle.EagleLayer`).
    Every other option is the Medusa drafter's, with the same meaning."""

    name: ClassVar[str] = "eagle"

    heads: str | EagleLayer | None = "eagle"
    stats: LevelStats = attrs.field(factory=lambda: LevelStats(name="eagle"))
    _cache: FeatureCache = attrs.field(init=False, default=None)
    _q: int = attrs.field(init=False, default=0)  # this round's q: the position whose state drafts
    _position: int = attrs.field(init=False, default=0)  # the position of the next drafted rows
    _drafted: list = attrs.field(init=False, factory=list)  # this round's drafted rows: (keys, values) [m, A, D] per depth
    _ancestors: list = attrs.field(init=False, factory=list)  # per row of the last depth: the drafted rows it sees (its own included)

    def _load(self) -> EagleLayer:
        layer = self.heads if isinstance(self.heads, EagleLayer) else load_layer(self.heads or "eagle")
        self._cache = FeatureCache(window=layer.info.window)
        return layer

    @classmethod
    def conformance_instance(cls, vocab: int) -> "EagleDrafter":
        """A random layer for the conformance suite's synthetic models (hidden size 8)."""
        return cls(vocab=vocab, heads=synthetic_layer(vocab), tree_size=8)

    def attach_hidden_states(self, channel) -> None:
        super().attach_hidden_states(channel)
        channel.keep_recent(self.info.window)  # the states of a prompt's last positions too: the first rounds' rows

    def reset(self) -> None:
        super().reset()
        self._cache.clear()

    def _found(self, prefix: Sequence[int], position: int) -> None:
        self._q = position
        with torch.inference_mode():
            self._catch_up(prefix, position)

    def _catch_up(self, prefix: Sequence[int], q: int) -> None:
        """Bring the committed rows up to position q - 1: drop those whose token the prefix no longer holds, then
        add the rows the level's states allow, the last ``window`` at most."""
        cache = self._cache
        cache.truncate(q)
        held = np.asarray(prefix[cache.first + 1 : cache.next + 1], dtype=np.int64)  # the token after each row's position
        cache.truncate(cache.first + cache.agreeing(held))
        first, states = self._channel.run(prefix, max(cache.next, q - cache.window), q)
        if states is None:
            return
        if first != cache.next:
            cache.clear(first)  # positions between the rows held and the run are unknown: start over from the run
        tokens = np.asarray(prefix[first + 1 : q + 1], dtype=np.int64)  # [n]
        _, _, keys, values = self._layer_rows(states, torch.from_numpy(tokens).to(states.device), first)
        cache.append(keys, values, tokens)

    def _layer_rows(self, states: torch.Tensor, tokens: torch.Tensor, position: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of features [n, H] (any dtype) and the tokens [n] after them, from ``position`` on (or at
        ``position`` [n]) -> u [n, H], queries, keys, values [n, A, D] in the layer's dtype."""
        embedded = self._embedded(tokens)  # [n, H]
        positions = position if isinstance(position, torch.Tensor) else torch.arange(position, position + states.shape[0])
        return self._model.rows(states.to(embedded.dtype), embedded, positions.to(states.device))

    def _begin(self, state: torch.Tensor, after: int | None, first: int) -> torch.Tensor:
        """Depth 0's parent: the state at q when the LM head drafts depth 0 (``first`` 0), else the row of q, which
        reads x_{q+1} (committed: it joins the cache) and attends over the committed rows."""
        self._drafted, self._ancestors, self._position = [], [[]], self._q + first
        if first == 0:
            return state[None]  # [1, H]
        tokens = torch.tensor([after], device=state.device)
        u, q, k, v = self._layer_rows(state[None], tokens, self._q)  # [1, H], [1, A, D] x3
        self._cache.append(k, v, np.array([after], dtype=np.int64))
        keys, values = self._cache.view()  # [w, A, D]
        out = self._model.finish(u, attend(q, keys, values, torch.ones(1, keys.shape[0], dtype=torch.bool, device=keys.device)))
        return out.to(state.dtype)  # [1, H]

    def _advance(self, frontier: torch.Tensor, slot: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The drafted rows of ``tokens`` [m], each after its parent's row ``slot`` [m] of ``frontier`` [f, H]: each
        attends over the committed rows, its ancestors' rows and itself. -> [m, H] their predicted features."""
        u, q, k, v = self._layer_rows(frontier[slot], tokens, torch.full((tokens.shape[0],), self._position))  # [m, H], [m, A, D] x3
        done = sum(keys.shape[0] for keys, _ in self._drafted)  # drafted rows before this depth's
        self._ancestors = [self._ancestors[s] + [done + i] for i, s in enumerate(slot.tolist())]
        self._drafted.append((k, v))
        self._position += 1
        committed, committed_values = self._cache.view()  # [w, A, D]
        keys = torch.cat([committed, *(keys for keys, _ in self._drafted)])  # [w + r, A, D]
        values = torch.cat([committed_values, *(values for _, values in self._drafted)])
        allowed = torch.zeros(len(slot), keys.shape[0], dtype=torch.bool)  # [m, w + r]
        allowed[:, : committed.shape[0]] = True
        for i, seen in enumerate(self._ancestors):
            allowed[i, [committed.shape[0] + j for j in seen]] = True
        out = self._model.finish(u, attend(q, keys, values, allowed.to(keys.device)))  # [m, H]
        return out.to(frontier.dtype)

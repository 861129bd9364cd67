"""The model protocol and :class:`CachedModel`, a model bound to one level's cache view.

A model is anything with this small surface (see :class:`CausalLM`): tokens and their positions in,
logits out, appending to a cache it created. The synthetic models of :mod:`specstack.synthetic`
and the transformers-backed models implement it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Protocol, Sequence, runtime_checkable

import attrs
import torch

from .batch import TokenBatch
from .channels import FullCacheChannel, HiddenLog, HiddenStateChannel, QueryLog
from .errors import SpecstackError
from .policies import CachePolicy, CacheState, check_selection
from .types import Capability, Draft, LevelStats, SeenTokens, TokenView, as_tokens


@runtime_checkable
class KVCache(Protocol):
    """Preallocated per-level storage. Slots hold ascending sequence positions."""

    positions: torch.Tensor  # [n] positions of the occupied slots (-1 where they differ per head)
    horizon: int  # positions below this were gathered from another cache (0: none)

    def __len__(self) -> int: ...

    def truncate(self, position: int) -> None:
        """Drop every slot whose position is >= ``position`` (O(1): moves a length pointer)."""

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only ``slots`` ([K], or [L, H, K] per layer and KV head; ascending), moved to the front."""

    def keep_path(self, base: int, path: list[int]) -> None:
        """After a token tree was written from slot ``base``: keep the nodes ``path``, drop the rest."""

    def attention_mass(self) -> torch.Tensor:
        """[L, H, n]: attention received by each occupied slot since it was written."""

    # what a gathering level reads of a full cache, through a FullCacheChannel
    def keys_before(self, horizon: int) -> torch.Tensor:
        """[L, H, horizon, D]: the keys of the first ``horizon`` slots."""

    def gather_from(self, source: "KVCache", slots: torch.Tensor, horizon: int) -> None:
        """Fill this cache with ``source``'s entries at ``slots`` ([K] or [L, H, K]), all below ``horizon``."""


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as a stack sees it. It may also offer ``weights_held()``, a context manager over
    which its weights stay as they are (:func:`weights_held`)."""

    vocab_size: int
    max_length: int  # the model's context window
    device: torch.device  # where its logits and KV cache live
    capabilities: frozenset[Capability]
    tokenizer_id: str | None  # identifies the tokenizer; levels of one stack must agree

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> KVCache:
        """A fresh, empty cache with room for ``capacity`` slots; with ``relative_positions`` rotary
        positions are slot indices (keys are re-rotated when slots move)."""

    def forward(self, batch: TokenBatch, cache: KVCache) -> torch.Tensor:
        """Append ``batch``'s tokens to ``cache`` and return the logits of its last ``batch.num_logits``
        tokens ([num_logits, V]); each token attends to the cache and to the new tokens ``batch.sees``
        allows (a chain, or a token tree with ``Capability.TREE_ATTENTION``). A model with
        ``Capability.HIDDEN_STATES`` leaves the last hidden states of those tokens in ``batch.hidden``
        ([num_logits, H]) when ``batch.keep_hidden`` is set, and has ``hidden_size``,
        ``output_logits(states [n, H]) -> [n, V]``, its output head, ``output_head(rows [R])``, a function
        ``[n, H] -> [n, R]`` computing only the logits of the token ids ``rows``, and
        ``input_embeddings(tokens [n]) -> [n, H]``, its input embedding."""


@contextlib.contextmanager
def weights_held(models: Sequence[CausalLM]) -> Iterator[None]:
    """A scope over which the weights of ``models`` stay as they are (a generation), opened for each model that offers
    one (an optional method ``weights_held()`` returning a context manager; :class:`specstack.hf.HFCausalLM` does), so
    that it may check them once rather than before every forward."""
    with contextlib.ExitStack() as scope:
        for model in {id(model): model for model in models}.values():
            hold = getattr(model, "weights_held", None)
            if hold is not None:
                scope.enter_context(hold())
        yield


@attrs.define(eq=False)
class CachedModel:
    """A model plus the cache view of one level, kept in step with a token sequence.

    ``logits(tokens, n)`` returns the logits predicting the last ``n`` positions of ``tokens``. The
    cache is first rolled back to the longest prefix it already holds (a pointer move), then the
    remaining tokens are fed, in chunks when the policy has to evict on the way. ``tree_logits``
    scores a token tree in one forward pass; ``accept_path`` then keeps the accepted path.

    ``tokens`` is best a :class:`~specstack.types.TokenView` of the generation's shared sequence:
    finding the prefix already held then compares only the tokens past the last verified point
    (:class:`~specstack.types.SeenTokens`), so a round's bookkeeping is O(γ), not O(context). Any
    other ``Sequence[int]`` is copied into a view first (O(n)).
    """

    model: CausalLM
    policy: CachePolicy
    stats: LevelStats
    channel: FullCacheChannel | None = None  # the full-cache level a gathering policy reads from
    capacity: int = attrs.field(init=False)
    cache: KVCache = attrs.field(init=False)
    _queries: QueryLog | None = attrs.field(init=False, default=None)  # logged for a gathering level below
    _hidden: HiddenLog | None = attrs.field(init=False, default=None)  # logged for a drafter that reads hidden states
    _fed: SeenTokens = attrs.field(init=False, factory=SeenTokens)  # token at every position fed so far
    _tree: tuple[int, list[int]] | None = attrs.field(init=False, default=None)  # (first slot, tokens) of a scored tree
    _tree_hidden: torch.Tensor | None = attrs.field(init=False, default=None)  # [k+1, H] its rows' hidden states, until a path is kept
    _acceptance: float | None = attrs.field(init=False, default=None)  # rolling, of this level's drafts

    def __attrs_post_init__(self) -> None:
        self.capacity = self.policy.capacity(self.model.max_length)
        self.cache = self.model.new_cache(self.capacity, relative_positions=self.policy.relative_positions)
        self.stats.cache_bytes = getattr(self.cache, "nbytes", 0)
        if self.policy.gathers_from_full and self.channel is None:
            raise SpecstackError(f"cache policy '{self.policy.name}' needs a full-cache level of the same model above it")

    @property
    def device(self) -> torch.device:
        return torch.device(self.model.device)

    def open_channel(self) -> FullCacheChannel:
        """The channel through which a gathering level of the same model below reads this level."""
        self._queries = self._queries or QueryLog()
        return FullCacheChannel(self, self._queries)

    def open_hidden_channel(self) -> HiddenStateChannel:
        """The channel through which the drafter below reads this level's hidden states."""
        if Capability.HIDDEN_STATES not in self.model.capabilities:
            raise SpecstackError(f"level '{self.stats.name}' cannot hand hidden states to a drafter: its model does not provide them")
        self._hidden = self._hidden or HiddenLog()
        return HiddenStateChannel(self, self._hidden)

    def reset(self) -> None:
        self.cache.truncate(0)
        self._fed.truncate(0)
        self._tree = None
        self._acceptance = None

    def observe(self, drafted: int, accepted: int, decay: float = 0.8) -> None:
        """Record how the level above judged this level's draft (a rolling acceptance rate)."""
        if drafted:
            rate = accepted / drafted
            self._acceptance = rate if self._acceptance is None else decay * self._acceptance + (1 - decay) * rate

    def fed_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` this level's cache has already seen."""
        return self._fed.common_prefix(as_tokens(tokens))

    def logits(self, tokens: Sequence[int], num_logits: int) -> torch.Tensor:
        """[num_logits, V]: the logits after each of the last ``num_logits`` of ``tokens`` (0: just feed them)."""
        tokens = as_tokens(tokens)
        if not 0 <= num_logits <= len(tokens):
            raise SpecstackError(f"level '{self.stats.name}' was asked for the logits of the last {num_logits} of {len(tokens)} tokens; ask for 0 to {len(tokens)}")
        self._drop_tree()
        if self.policy.gathers_from_full:
            self._gather_if_due(tokens, num_logits, incoming=0)
        start = self._rollback(tokens, num_logits)
        rows = []
        while start < len(tokens):
            size = self._chunk(len(tokens) - start)
            wanted = max(0, min(size, num_logits - (len(tokens) - start - size)))
            rows.append(self._forward(TokenBatch.chain(tokens[start : start + size], start, wanted)))  # [wanted, V]
            start += size
        self._fed.mark(tokens)
        if not rows:  # nothing left to feed and no logits wanted
            return torch.empty(0, self.model.vocab_size, device=self.device)  # [0, V]
        return rows[0] if len(rows) == 1 else torch.cat(rows)  # [num_logits, V]; one forward's rows need no copy

    def can_adopt(self, source: "CachedModel") -> bool:
        """Whether :meth:`adopt` may copy ``source``'s cache: the same model, both caches complete."""
        return source.model is self.model and self.policy.complete and source.policy.complete

    def adopt(self, source: "CachedModel", tokens: Sequence[int]) -> None:
        """Hold ``tokens`` by copying ``source``'s cache of them instead of prefilling: both levels run
        the same model over complete caches (the target levels of two stacks given one prompt)."""
        tokens = as_tokens(tokens)
        if not self.can_adopt(source):
            raise SpecstackError(f"level '{self.stats.name}' can adopt the cache of a level of the same model only, both with complete caches")
        held = source.fed_prefix(tokens)
        if held < len(tokens):
            raise SpecstackError(f"level '{source.stats.name}' holds {held} of the {len(tokens)} tokens level '{self.stats.name}' would adopt")
        self._drop_tree()
        if self._hidden is not None:
            self._hidden.forget_from(0)  # copied keys come without the states that made them
        self.cache.copy_prefix(source.cache, len(tokens))
        self._fed.become(tokens)

    def tree_logits(self, prefix: Sequence[int], draft: Draft) -> torch.Tensor:
        """[k+1, V]: the logits after ``prefix`` (row 0) and after each node of ``draft``'s token tree
        (row i+1), from one forward pass over the tokens of ``prefix`` not yet cached and the tree.
        Call :meth:`accept_path` before the next forward."""
        prefix = as_tokens(prefix)
        self._drop_tree()
        if self.policy.gathers_from_full:
            self._gather_if_due(prefix, 1, incoming=len(draft))
        start = self._rollback(prefix, 1)
        if len(self.cache) + len(prefix) - start + len(draft) > self.capacity and len(prefix) - start > 1:
            self.logits(prefix[:-1], 1)  # a long uncached tail: feed it in chunks first, then the tree
            start = self._rollback(prefix, 1)
        batch = TokenBatch.tree(prefix[start:], start, draft)
        if len(batch) > self.capacity:
            raise SpecstackError(f"a tree of {len(draft)} tokens does not fit level '{self.stats.name}', whose cache holds {self.capacity} slots; use a smaller tree or a larger budget")
        self._make_room(len(batch))
        self._tree = (len(self.cache) + len(prefix) - start, draft.tokens.tolist())
        return self._forward(batch)

    def accept_path(self, path: Sequence[int]) -> None:
        """Keep the accepted root path ``path`` (indices into the last scored tree), drop the rest."""
        base, tokens = self._tree
        if self._tree_hidden is not None:  # row 0 (the root: the last committed token, fed last) and the path's rows
            rows = torch.tensor([0, *(i + 1 for i in path)], dtype=torch.long, device="cpu")  # [m+1]
            root = len(self._fed) - 1
            self._hidden.record(root + torch.arange(len(rows), device="cpu"), self._tree_hidden[rows.to(self._tree_hidden.device)])
        self._tree_hidden = None
        self.cache.keep_path(base, list(path))
        self._fed.extend([tokens[i] for i in path])
        self._tree = None

    def _drop_tree(self) -> None:
        """A tree scored but never resolved (the round was abandoned): forget all of it."""
        if self._tree is not None:
            self.cache.keep_path(self._tree[0], [])
            self._tree = self._tree_hidden = None

    def _rollback(self, tokens: TokenView, num_logits: int) -> int:
        """Roll the cache back to the longest prefix of ``tokens`` it holds, leaving ``num_logits`` to feed."""
        start = self._fed.common_prefix(tokens[: len(tokens) - num_logits])
        self.cache.truncate(start)
        if len(self.cache) == 0:  # the rollback reached into evicted or per-head slots: start over
            start = 0
        self._fed.truncate(start)
        return start

    def _gather_if_due(self, tokens: TokenView, num_logits: int, incoming: int) -> None:
        """Rebuild this level's view through the channel when the policy asks for it; ``incoming``
        tree nodes will follow ``tokens``. Nothing is gathered before a token is committed (the
        prompt of a one-token prompt): the view then simply holds what it is fed."""
        context = tokens[: len(tokens) - num_logits]
        if len(context) == 0:
            return
        seen = self._fed.common_prefix(tokens)  # one comparison serves all three checks below
        appended = min(seen, len(context)) - self.cache.horizon
        stale = self.cache.horizon == 0 or appended < 0
        out_of_room = len(self.cache) + len(tokens) - seen + incoming > self.capacity
        refresh = self.policy.needs_refresh(appended, self._acceptance) and self.channel.caught_up(context)
        if not (stale or out_of_room or refresh):
            return
        horizon = self.channel.horizon(context)  # may run the full-cache level's forward (counted there) at the prompt
        began = time.perf_counter()
        slots = self.channel.gather(self.policy, horizon)
        self.channel.copy_into(self.cache, slots, horizon)
        self._fed.become(context[:horizon])
        self.stats.gathers += 1
        self.stats.gather_seconds += time.perf_counter() - began

    def _chunk(self, remaining: int) -> int:
        if len(self.cache) + remaining <= self.capacity:
            return remaining
        return max(1, min(remaining, self.capacity // 4))

    def _forward(self, batch: TokenBatch) -> torch.Tensor:
        self._check_window(batch)
        self._make_room(len(batch))
        batch.queries = self._queries
        batch.record_attention = Capability.ATTENTION_WEIGHTS in self.policy.requires
        batch.attend = self.policy.attend if Capability.SPARSE_ATTENTION in self.policy.requires else None
        batch.keep_hidden = self._hidden is not None
        batch.hidden_rows = self._hidden.recent if batch.keep_hidden else 0
        began = time.perf_counter()
        out = self.model.forward(batch, self.cache)  # [num_logits, V]
        self._log_hidden(batch)
        if out.is_cuda:  # the forward is queued, not done: wait for it, so that forward_seconds means its time
            torch.cuda.synchronize(out.device)
        self._fed.extend(batch.chain_tokens())
        self.stats.forward_calls += 1
        self.stats.forward_tokens += len(batch)
        self.stats.forward_seconds += time.perf_counter() - began
        return out

    def _log_hidden(self, batch: TokenBatch) -> None:
        """Log the hidden states of the rows this forward scored: by position for a chain; for a tree,
        those on the accepted path once :meth:`accept_path` knows it. Every state from the forward's
        first position on is stale: those positions were written again."""
        if self._hidden is None:
            return
        self._hidden.forget_from(int(batch.positions[0]))
        if not batch.is_chain:
            self._tree_hidden = batch.hidden  # [k+1, H]
        elif len(batch.hidden):
            self._hidden.record(batch.positions[len(batch) - len(batch.hidden) :], batch.hidden)  # [n], [n, H]: the last n rows

    def _check_window(self, batch: TokenBatch) -> None:
        """A level whose rotary positions are sequence positions must stay inside its model's window
        (a draft with cache-relative positions, StreamingLLM's, never leaves it)."""
        if self.policy.relative_positions or len(batch) == 0:
            return
        last = int(batch.positions.max())  # [T] -> the furthest position written
        if last >= self.model.max_length:
            raise SpecstackError(f"level '{self.stats.name}' reached position {last}, beyond its model's window of {self.model.max_length} tokens; "
                                 f"give that level a cache with slot positions (StreamingLLM), a longer window (--context), or a shorter prompt")

    def _make_room(self, incoming: int) -> None:
        if len(self.cache) + incoming <= self.capacity:
            return
        attention = self.cache.attention_mass() if Capability.ATTENTION_WEIGHTS in self.policy.requires else None  # [L, H, n]
        state = CacheState(positions=self.cache.positions, capacity=self.capacity, incoming=incoming, attention=attention)
        self.cache.keep(check_selection(self.policy, self.policy.select(state), state))


def check_window(model: CausalLM, needed: int, what: str) -> None:
    if needed > model.max_length:
        raise SpecstackError(f"{what} needs {needed} positions but the model's window is {model.max_length}; shorten the prompt or max_new_tokens")

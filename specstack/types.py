"""Value objects that travel between the parts of a stack.

Glossary (see docs/architecture.md):

* **level** – one model (or model-free drafter) with its own cache view. L0 drafts; Ln is the
  target whose distribution is preserved.
* **round** – one verification step of a level: ask the level below for up to γ tokens, score them
  in one forward pass, accept a prefix of them and emit one more token.
* **drafted** – tokens a level was offered by the level below in a round.
* **accepted** – the drafted tokens that passed verification.
* **recovered** – the token sampled from the residual distribution after the first rejection.
* **bonus** – the token sampled from the verifier's own distribution when every drafted token was
  accepted.

The token sequence of a generation is one :class:`TokenSequence` shared by every level, read through
O(1) :class:`TokenView` prefixes; what a level has taken in of it is a :class:`SeenTokens`.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence

import attrs
import numpy as np
import torch


class Capability(str, enum.Enum):
    """Data a component may need from a model, declared up front and checked when a stack is built."""

    ATTENTION_WEIGHTS = "attention_weights"  # accumulated attention mass per cached slot (H2O)
    SPARSE_ATTENTION = "sparse_attention"  # a policy restricts each query to slots it picks (Top-K oracle)
    QUERIES = "queries"
    KEYS = "keys"
    HIDDEN_STATES = "hidden_states"
    TREE_ATTENTION = "tree_attention"


class DraftKind(str, enum.Enum):
    """How a draft's tokens were drawn. A verifier declares the kinds it verifies losslessly
    (``Verifier.accepts``) and a drafter the kind it produces (``Drafter.draft_kind``); the stack
    refuses a mismatch when it is built."""

    CHAIN = "chain"  # one token per position, each drawn from its row of ``probs`` (one-hot: deterministic)
    TREE_WITHOUT_REPLACEMENT = "tree-without-replacement"  # siblings drawn in order, without replacement (Sequoia)
    TREE_WITH_REPLACEMENT = "tree-with-replacement"  # siblings drawn independently from the same q (SpecInfer)
    TREE_DETERMINISTIC = "tree-deterministic"  # candidates chosen without randomness (top-k, lookup matches)


def _check_parents(parents: torch.Tensor, k: int) -> None:
    """Parents [k] must be topologically ordered: -1 (a child of the last committed token) or an
    earlier index."""
    if parents.dim() != 1 or parents.shape[0] != k or parents.dtype != torch.long:
        raise ValueError(f"draft parents must be a [{k}] long tensor, got {parents.dtype} {tuple(parents.shape)}")
    if k and not bool(((parents >= -1) & (parents < torch.arange(k, device=parents.device))).all()):
        raise ValueError(f"draft parents {parents.tolist()} are not topologically ordered (need -1 <= parents[i] < i)")


@attrs.frozen(kw_only=True, eq=False)
class Draft:
    """Tokens proposed by a drafter, with the distributions they were drawn from.

    ``tokens`` [k] are the proposed tokens and ``probs`` [k, V] the proposal distribution ``q`` each
    token was drawn from: for a tree node, the drafter's distribution after its parent, *before* any
    sibling was removed (siblings share the row). ``parents`` [k] describes a token tree: the index of
    each token's parent inside the draft, -1 for children of the last committed token, always an
    earlier index (topological order); siblings are tried in index order. ``None`` means a chain
    (``parents[i] == i - 1``). ``kind`` says how siblings were drawn (:class:`DraftKind`).
    """

    tokens: torch.Tensor = attrs.field()  # [k]
    probs: torch.Tensor = attrs.field()  # [k, V]
    parents: torch.Tensor | None = None  # [k]
    kind: DraftKind = DraftKind.CHAIN

    @tokens.validator
    def _check(self, attribute, tokens: torch.Tensor) -> None:
        if tokens.dim() != 1 or self.probs.dim() != 2 or self.probs.shape[0] != tokens.shape[0]:
            raise ValueError(f"draft shapes disagree: tokens {tuple(tokens.shape)}, probs {tuple(self.probs.shape)}")
        if self.parents is not None:
            _check_parents(self.parents, tokens.shape[0])
        elif self.kind is not DraftKind.CHAIN:
            raise ValueError(f"a {self.kind.value} draft needs parents")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @classmethod
    def empty(cls, vocab_size: int, device: torch.device | str = "cpu") -> "Draft":
        return cls(tokens=torch.empty(0, dtype=torch.long, device=device), probs=torch.empty(0, vocab_size, device=device))

    @property
    def device(self) -> torch.device:
        return self.probs.device

    def to(self, device: torch.device | str) -> "Draft":
        """This draft on ``device`` (itself if it is there): the verifying level moves a draft made on
        another device to its own."""
        if self.device == torch.device(device):
            return self
        parents = None if self.parents is None else self.parents.to(device)
        return Draft(tokens=self.tokens.to(device), probs=self.probs.to(device), parents=parents, kind=self.kind)

    def parent_index(self) -> torch.Tensor:
        """[k] the parent of every token (``i - 1`` along a chain)."""
        return self.parents if self.parents is not None else torch.arange(len(self), device=self.tokens.device) - 1

    def depths(self) -> torch.Tensor:
        """[k] tokens on the path from the root to each token, itself included minus one (0 for the
        children of the last committed token)."""
        parents, depth = self.parent_index().tolist(), []
        for parent in parents:
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return torch.tensor(depth, dtype=torch.long, device="cpu")  # host metadata: positions of a TokenBatch

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (-1: the root), in the order they were drawn."""
        return torch.nonzero(self.parent_index() == node).flatten().tolist()

    def path(self, node: int) -> list[int]:
        """Indices from the root's first child down to ``node``."""
        parents, path = self.parent_index().tolist(), []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def stop_at(self, stop_tokens: frozenset[int]) -> "Draft":
        """The draft without the tokens after a stop token (a round never runs past one)."""
        if not stop_tokens or len(self) == 0:
            return self
        stops = torch.tensor([int(t) in stop_tokens for t in self.tokens.tolist()], device="cpu")  # [k]
        if not bool(stops.any()):
            return self
        if self.parents is None:
            return self.head(int(torch.nonzero(stops)[0]) + 1)
        parents, cut = self.parents.tolist(), []
        for i, parent in enumerate(parents):  # a node is cut if its parent is a stop token or was cut
            cut.append(parent >= 0 and (bool(stops[parent]) or cut[parent]))
        keep = torch.nonzero(~torch.tensor(cut, dtype=torch.bool, device="cpu")).flatten()  # [k'] ascending
        return self.subtree(keep)

    def head(self, n: int) -> "Draft":
        """The tokens at depth < ``n`` (the first ``n`` of a chain); a tree stays a tree of the same kind."""
        if self.parents is None:
            return Draft(tokens=self.tokens[:n], probs=self.probs[:n])
        return self.subtree(torch.nonzero(self.depths() < n).flatten())  # [k'] on the CPU

    def subtree(self, keep: torch.Tensor) -> "Draft":
        """The tree restricted to ``keep`` [k'] (ascending, closed under taking parents), renumbered."""
        if keep.shape[0] == len(self):
            return self
        keep = keep.to(self.tokens.device)  # [k']
        renumber = torch.full((len(self),), -1, dtype=torch.long, device=keep.device).scatter_(0, keep, torch.arange(keep.shape[0], device=keep.device))
        parents = self.parents[keep]  # [k']
        parents = torch.where(parents >= 0, renumber[parents.clamp_min(0)], parents)
        return Draft(tokens=self.tokens[keep], probs=self.probs[keep], parents=parents, kind=self.kind)


@attrs.frozen(kw_only=True)
class Verdict:
    """The outcome of verifying one draft.

    ``accepted`` are the indices of the accepted draft tokens, in order along the accepted path
    (``[0, 1, …, m-1]`` for a chain; a root path of the tree otherwise). ``next_token`` is the
    recovered token if a rejection happened, the bonus token otherwise; ``bonus`` tells which.
    """

    accepted: tuple[int, ...]
    next_token: int
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def rows(self) -> list[int]:
        """The rows of the verifier's ``p`` [k+1, V] that the emitted tokens were drawn from: the root's
        row 0, then row ``i + 1`` after each accepted token i."""
        return [0, *(i + 1 for i in self.accepted)]


@attrs.define(kw_only=True)
class LevelStats:
    """Running counters of one level, updated once per round."""

    name: str
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended in a rejection (the rest accepted their whole draft)
    emitted: int = 0
    forward_calls: int = 0
    forward_tokens: int = 0
    forward_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0  # time outside forwards and gathers: a verifying level's rounds (sampling, verification, a model-free drafter's drafting below it), a drafting model's steps (sampling)
    gathers: int = 0
    gather_seconds: float = 0.0  # a gathering level's re-gathers of its view (scoring, copying)
    cache_bytes: int = 0  # a gauge, not a counter: the level's preallocated KV cache (its memory, whatever it holds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def examined(self) -> int:
        """Drafted tokens the verifier looked at: the accepted ones and each round's first rejected one
        (a drafted token after the first rejection of its round is never examined)."""
        return self.accepted + self.rejected

    @property
    def token_acceptance_rate(self) -> float:
        """Accepted / examined tokens. This estimates α, the probability that a draft token is accepted
        (Leviathan et al., 2023), which is what the TriForce paper reports as acceptance rate."""
        return self.accepted / self.examined if self.examined else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def since(self, before: "LevelStats") -> "LevelStats":
        """The counts added since ``before`` (this level's counters at an earlier point); the gauge as it is now."""
        counters = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in attrs.fields(LevelStats) if f.name not in ("name", "cache_bytes")}
        return LevelStats(name=self.name, cache_bytes=self.cache_bytes, **counters)

    def as_dict(self) -> dict:
        """The counters and rates; a level that drafted nothing (γ 0, or a lookup that never matched) has no
        acceptance (None), not an acceptance of 0."""
        return {
            **attrs.asdict(self),
            "acceptance_rate": self.acceptance_rate if self.drafted else None,
            "token_acceptance_rate": self.token_acceptance_rate if self.examined else None,
            "mean_accepted_per_round": self.mean_accepted_per_round,
        }


@attrs.frozen(kw_only=True)
class GenerationResult:
    """What :meth:`SpeculationStack.generate` returns."""

    prompt_length: int
    tokens: tuple[int, ...]
    levels: tuple[LevelStats, ...]  # counters of the decoding phase, lowest level first
    seconds: float  # decoding, after the prompt was processed
    prefill_seconds: float
    stopped_by: str  # "eos" or "max_new_tokens"

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {
            "prompt_length": self.prompt_length,
            "tokens": list(self.tokens),
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "tokens_per_second": self.tokens_per_second,
            "stopped_by": self.stopped_by,
            "levels": [level.as_dict() for level in self.levels],
        }


class TokenSequence:
    """The tokens of one generation, shared by every level of a stack (host memory).

    One growable buffer: the prompt and the committed tokens at the front, behind them the tokens
    of the rounds in flight, rewritten in place as drafts are accepted or rejected. The calls of a
    stack nest, so each call owns the positions past the prefix it was given: the top level writes
    what it emits behind the committed tokens, the level below writes its draft behind that, and so
    on down. Nothing ever rewrites a position that an enclosing call still reads.

    Levels read it through :class:`TokenView` prefixes (O(1) to make) and learn what changed since
    they last looked from a change log: every write that alters a token already written records the
    lowest position it altered, so "which prefix is unchanged since version v" costs O(writes since
    v), never O(context) (:meth:`unchanged_since`, used by :class:`SeenTokens`).
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        initial = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [n]
        self._data = np.zeros(max(64, 2 * initial.shape[0]), dtype=np.int64)  # [capacity]
        self._data[: initial.shape[0]] = initial
        self._written = initial.shape[0]  # positions ever written; the rest of the buffer is unused
        self._altered: list[int] = []  # version v -> the lowest position write v altered

    def __len__(self) -> int:
        """Positions written so far (the longest view there can be)."""
        return self._written

    @property
    def version(self) -> int:
        """How many writes altered a token already written."""
        return len(self._altered)

    def view(self, length: int) -> "TokenView":
        """The first ``length`` tokens."""
        if not 0 <= length <= self._written:
            raise ValueError(f"a view of {length} tokens of a sequence holding {self._written}")
        return TokenView(self, length)

    def write(self, start: int, tokens: Sequence[int]) -> "TokenView":
        """Put ``tokens`` at positions ``start, start+1, …`` (rewriting what was there, if anything)
        and return the view that ends after them. Rewriting a token with itself changes nothing."""
        new = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [k]
        end = start + new.shape[0]
        if not 0 <= start <= self._written:
            raise ValueError(f"a write at position {start} of a sequence holding {self._written} tokens leaves a gap")
        if end > self._data.shape[0]:
            self._data = np.concatenate([self._data, np.zeros(max(end, 2 * self._data.shape[0]) - self._data.shape[0], dtype=np.int64)])
        overlap = min(end, self._written) - start
        if overlap > 0:
            differ = np.flatnonzero(self._data[start : start + overlap] != new[:overlap])
            if differ.size:
                self._altered.append(start + int(differ[0]))
        self._data[start:end] = new
        self._written = max(self._written, end)
        return TokenView(self, end)

    def unchanged_since(self, version: int) -> int:
        """Every position below the returned one holds the token it held at ``version``."""
        return min(self._altered[version:], default=sys.maxsize)


class TokenView(Sequence):
    """The first ``len(view)`` tokens of a :class:`TokenSequence`, read in place (a ``Sequence[int]``).

    Slicing a prefix (``view[:n]``) gives another view; any other slice a list. ``array()`` is a
    read-only numpy view. A view is valid until its tokens are rewritten (an enclosing call never
    rewrites them while a call it made runs); reading a stale view in bulk raises.
    """

    __slots__ = ("sequence", "_length", "_version")

    def __init__(self, sequence: TokenSequence, length: int, version: int | None = None) -> None:
        self.sequence = sequence
        self._length = length
        self._version = sequence.version if version is None else version  # the sequence's version when it was made

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                return self.tolist()[index]
            if start == 0:
                return TokenView(self.sequence, max(stop, 0), self._version)
            return self.array()[start:stop].tolist()
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"token {index} of a view of {self._length}")
        return int(self.sequence._data[index])

    def __iter__(self):
        return iter(self.tolist())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array(self.array(), dtype=dtype)  # a copy: the buffer's tail is rewritten later

    def __repr__(self) -> str:
        return f"TokenView({self._length} tokens)"

    def array(self) -> np.ndarray:
        """[n] the tokens, read-only, in place (valid while the view is)."""
        if self.sequence.unchanged_since(self._version) < self._length:
            raise RuntimeError("a token view was read after its tokens were rewritten; make a new view")
        out = self.sequence._data[: self._length].view()  # [n]
        out.flags.writeable = False
        return out

    def tolist(self) -> list[int]:
        return self.array().tolist()


def as_tokens(tokens: Sequence[int]) -> TokenView:
    """``tokens`` as a view: itself if it is one, else a view of a new sequence holding a copy (O(n):
    for callers outside a stack's rounds, such as tests and benchmarks)."""
    if isinstance(tokens, TokenView):
        return tokens
    return TokenSequence(tokens).view(len(tokens))


@attrs.define(eq=False)
class SeenTokens:
    """What a level has taken in of a token sequence (fed to its cache, or indexed), and how many
    leading tokens of a new :class:`TokenView` it shares with that.

    ``common_prefix`` compares only past the point it last found equal in the same
    :class:`TokenSequence`, capped by what the sequence's change log says is unchanged since: one
    round costs O(γ), not O(context). A view of another sequence is compared from the start.
    """

    _tokens: np.ndarray = attrs.field(init=False, factory=lambda: np.zeros(64, dtype=np.int64))  # [capacity]
    _length: int = attrs.field(init=False, default=0)
    _sequence: TokenSequence | None = attrs.field(init=False, default=None)  # the sequence last compared with
    _version: int = attrs.field(init=False, default=0)  # its version then
    _equal: int = attrs.field(init=False, default=0)  # leading tokens then known equal to it

    def __len__(self) -> int:
        return self._length

    def array(self) -> np.ndarray:
        """[n] the tokens taken in (a view into the buffer)."""
        return self._tokens[: self._length]

    def common_prefix(self, tokens: TokenView) -> int:
        """How many leading ``tokens`` equal the tokens taken in."""
        limit = min(self._length, len(tokens))
        start = min(self._verified(tokens.sequence), limit)
        new = tokens.array()  # [n]
        differ = np.flatnonzero(self._tokens[start:limit] != new[start:limit])
        common = start + int(differ[0]) if differ.size else limit
        self._remember(tokens.sequence, common)
        return common

    def mark(self, tokens: TokenView) -> None:
        """The tokens taken in are now exactly ``tokens`` (the caller fed them)."""
        self._remember(tokens.sequence, len(tokens))

    def truncate(self, length: int) -> None:
        self._length = min(self._length, length)
        self._equal = min(self._equal, length)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [k]
        end = self._length + new.shape[0]
        if end > self._tokens.shape[0]:
            self._tokens = np.concatenate([self._tokens, np.zeros(max(end, 2 * self._tokens.shape[0]) - self._tokens.shape[0], dtype=np.int64)])
        self._tokens[self._length : end] = new
        self._length = end

    def become(self, tokens: TokenView) -> None:
        """Take in exactly ``tokens``, copying only those past the common prefix."""
        common = self.common_prefix(tokens)
        self.truncate(common)
        self.extend(tokens.array()[common:])
        self.mark(tokens)

    def _verified(self, sequence: TokenSequence) -> int:
        if sequence is not self._sequence:
            return 0
        return min(self._equal, sequence.unchanged_since(self._version))

    def _remember(self, sequence: TokenSequence, equal: int) -> None:
        self._sequence, self._version, self._equal = sequence, sequence.version, min(equal, self._length)

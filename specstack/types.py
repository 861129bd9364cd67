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
"""

from __future__ import annotations

import enum

import attrs
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
        return self._subset(keep)

    def head(self, n: int) -> "Draft":
        """The tokens at depth < ``n`` (the first ``n`` of a chain); a tree stays a tree of the same kind."""
        if self.parents is None:
            return Draft(tokens=self.tokens[:n], probs=self.probs[:n])
        return self._subset(torch.nonzero(self.depths() < n).flatten())  # [k'] on the CPU

    def _subset(self, keep: torch.Tensor) -> "Draft":
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
    gathers: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance_rate(self) -> float:
        """Accepted / examined tokens: a drafted token after the first rejection of its round is never
        examined. This estimates α, the probability that a draft token is accepted (Leviathan et al.,
        2023), which is what the TriForce paper reports as acceptance rate."""
        examined = self.accepted + self.rejected
        return self.accepted / examined if examined else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            **attrs.asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "token_acceptance_rate": self.token_acceptance_rate,
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
